"""Network namespaces joined by veth pairs: one namespace per "host" on this machine.

Used by bench_link's kernel-throttled (tbf) setting (one namespace per pipeline rank) and by
the two-host launch test (tests/e2e/test_multihost_netns.py: one namespace per DeepSpeed
node, each running its node's ranks). Everything is created inside namespaces this module
makes; nothing is added to, changed in or removed from the namespace the caller runs in.

* 2 nodes: namespaces ``<tag>-r0`` and ``<tag>-r1`` joined by one veth pair; each end is
  called ``cgb0`` inside its namespace.
* more nodes: one more namespace ``<tag>-hub`` holding a bridge; every node namespace has a
  veth ``cgb0`` whose peer ``h<r>`` is a port of that bridge (a star: each node has one
  uplink, like a host on the internet).

Addresses: ``<subnet>.<r + 1>/24`` on node r's ``cgb0`` (default subnet 10.213.0), only
inside these namespaces. ``tag`` starts with ``cegrpo-bench-<pid>`` so that leftovers of a
crashed run can be recognised (``cleanup_stale``) without touching a run that is still alive.

The rate limit (``tc qdisc ... tbf``) is put on and taken off by each bench_link rank on its
own ``cgb0`` (egress), between steps; this module only builds and removes the topology, and
stops the process groups started inside it (``kill_process_groups``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from typing import List, Optional, Sequence

__all__ = ["PREFIX", "IFNAME", "Topology", "list_namespaces", "cleanup_stale", "netns_available",
           "kill_process_groups"]

PREFIX = "cegrpo-bench-"
IFNAME = "cgb0"


def _run(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_available(tools: Sequence[str] = ("ip", "tc")) -> Optional[str]:
    """None if network namespaces (and the iproute2 ``tools``) can be used here, else the reason
    why not, as one line (callers skip with it). bench_link's tbf setting needs ``ip`` and
    ``tc``; the two-host launch test only ``ip``. Creating a namespace can still fail inside a
    container without CAP_SYS_ADMIN: ``Topology.create`` raises RuntimeError then."""
    if os.geteuid() != 0:
        return f"needs root ({' / '.join(tools)})"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    return None


def kill_process_groups(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop processes started with ``start_new_session=True`` (each leads its own process
    group, e.g. a rank, or a ``deepspeed`` launcher and the ranks it spawned): SIGTERM to every
    group still running, then SIGKILL to those still alive after ``grace_s`` seconds; reaps
    them all. Only the groups of ``procs`` are signalled."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


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
    """Namespaces + veths for ``nodes`` hosts (bench_link: one per pipeline rank); use as a
    context manager or call create()/destroy().

    Raises:
        ValueError: ``nodes`` < 2, a malformed ``subnet``, or a ``tag`` not starting with
            ``cegrpo-bench-<pid>`` (cleanup_stale must be able to recognise it).
    """

    def __init__(self, nodes: int, subnet: str = "10.213.0", tag: Optional[str] = None):
        if nodes < 2:
            raise ValueError("a link topology needs at least 2 nodes")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must look like 10.213.0, got {subnet!r}")
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        if not re.match(re.escape(PREFIX) + r"\d+($|-)", self.tag):
            raise ValueError(f"tag must start with {PREFIX}<pid>, got {self.tag!r}")
        self.nodes = nodes
        self.node_ns = [f"{self.tag}-r{r}" for r in range(nodes)]
        self.hub_ns = f"{self.tag}-hub" if nodes > 2 else None
        self.addrs = [f"{subnet}.{r + 1}" for r in range(nodes)]
        self.ifname = IFNAME
        self._created: List[str] = []

    def namespaces(self) -> List[str]:
        return self.node_ns + ([self.hub_ns] if self.hub_ns else [])

    def create(self) -> "Topology":
        for ns in self.namespaces():
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.hub_ns is None:
            _run(["ip", "-n", self.node_ns[0], "link", "add", IFNAME, "type", "veth",
                  "peer", "name", IFNAME, "netns", self.node_ns[1]])
        else:
            _run(["ip", "-n", self.hub_ns, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub_ns, "link", "set", "br0", "up"])
            for r, ns in enumerate(self.node_ns):
                _run(["ip", "-n", self.hub_ns, "link", "add", f"h{r}", "type", "veth",
                      "peer", "name", IFNAME, "netns", ns])
                _run(["ip", "-n", self.hub_ns, "link", "set", f"h{r}", "master", "br0"])
                _run(["ip", "-n", self.hub_ns, "link", "set", f"h{r}", "up"])
        for ns, addr in zip(self.node_ns, self.addrs):
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

    def exec_prefix(self, node: int) -> List[str]:
        """The argv prefix that runs a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node_ns[node]]

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.destroy()
