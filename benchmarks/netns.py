"""Network namespaces joined by veth pairs, for bench_link's kernel-throttled (tbf) setting.

Everything is created inside namespaces this module makes; nothing is added to, changed in
or removed from the namespace the benchmark was started in.

* PP = 2: namespaces ``<tag>-r0`` and ``<tag>-r1`` joined by one veth pair; each end is
  called ``cgb0`` inside its namespace.
* PP > 2: one more namespace ``<tag>-hub`` holding a bridge; every rank namespace has a
  veth ``cgb0`` whose peer ``h<r>`` is a port of that bridge (a star: each stage has one
  uplink, like a host on the internet).

Addresses: ``<subnet>.<r + 1>/24`` on rank r's ``cgb0`` (default subnet 10.213.0), only
inside these namespaces. ``tag`` is ``cegrpo-bench-<pid>`` so that leftovers of a crashed
run can be recognised (``cleanup_stale``) without touching a run that is still alive.

The rate limit (``tc qdisc ... tbf``) is put on and taken off by each rank on its own
``cgb0`` (egress), between steps; this module only builds and removes the topology.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import List, Optional

__all__ = ["PREFIX", "IFNAME", "Topology", "list_namespaces", "cleanup_stale", "netns_available"]

PREFIX = "cegrpo-bench-"
IFNAME = "cgb0"


def _run(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_available() -> Optional[str]:
    """None if namespaces + tbf can be used here, else the reason why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns / tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    return None


def list_namespaces() -> List[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(force: bool = False) -> List[str]:
    """Delete ``cegrpo-bench-<pid>-*`` namespaces whose creating process is gone (all of them
    with ``force``). Rank processes still running inside such a namespace (left by a run
    killed with SIGKILL) are killed first; deleting a namespace removes the veths and the
    bridge inside it. Returns the names removed."""
    removed = []
    for name in list_namespaces():
        m = re.match(re.escape(PREFIX) + r"(\d+)-", name)
        if not m:
            continue
        if not force and _pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid():
            continue
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:  # only processes inside a namespace this tool made
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    return removed


class Topology:
    """Namespaces + veths for ``pp`` ranks; use as a context manager or call create()/destroy()."""

    def __init__(self, pp: int, subnet: str = "10.213.0", tag: Optional[str] = None):
        if pp < 2:
            raise ValueError("a link topology needs pp >= 2")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must look like 10.213.0, got {subnet!r}")
        self.pp = pp
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        self.rank_ns = [f"{self.tag}-r{r}" for r in range(pp)]
        self.hub_ns = f"{self.tag}-hub" if pp > 2 else None
        self.addrs = [f"{subnet}.{r + 1}" for r in range(pp)]
        self.ifname = IFNAME
        self._created: List[str] = []

    def namespaces(self) -> List[str]:
        return self.rank_ns + ([self.hub_ns] if self.hub_ns else [])

    def create(self) -> "Topology":
        for ns in self.namespaces():
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.hub_ns is None:
            _run(["ip", "-n", self.rank_ns[0], "link", "add", IFNAME, "type", "veth",
                  "peer", "name", IFNAME, "netns", self.rank_ns[1]])
        else:
            _run(["ip", "-n", self.hub_ns, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub_ns, "link", "set", "br0", "up"])
            for r, ns in enumerate(self.rank_ns):
                _run(["ip", "-n", self.hub_ns, "link", "add", f"h{r}", "type", "veth",
                      "peer", "name", IFNAME, "netns", ns])
                _run(["ip", "-n", self.hub_ns, "link", "set", f"h{r}", "master", "br0"])
                _run(["ip", "-n", self.hub_ns, "link", "set", f"h{r}", "up"])
        for ns, addr in zip(self.rank_ns, self.addrs):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        return self

    def destroy(self) -> None:
        """Delete this topology's namespaces, also half-made ones (idempotent, never raises)."""
        present = set(list_namespaces())
        for ns in reversed(self.namespaces()):  # names carry our pid: nobody else's
            if ns in present or ns in self._created:
                _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()

    def exec_prefix(self, rank: int) -> List[str]:
        return ["ip", "netns", "exec", self.rank_ns[rank]]

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.destroy()
