"""DeepSpeed's JIT-built ops: where torch builds them, a stale build lock, and a prebuild.

DeepSpeed builds its CPU Adam (``cpu_adam``) and its shared-memory collectives
(``deepspeed_shm_comm``) on first use with ``torch.utils.cpp_extension.load``, which guards
each build directory with a lock file (``FileBaton``). A build that is killed mid-way (a
timeout, the OOM killer, Ctrl-C) leaves that file behind, and every later load of the op, by
any process of the same user, waits on it forever without printing anything: the trainer
hangs at its optimizer and every test that trains hangs with it (CI of stop 22, 2026-12-02).
:func:`check_build_locks` turns that into one line at start-up (a lock older than
:data:`STALE_LOCK_S`, or, on Linux, a younger one that no process is building under: torch runs
ninja and the compilers in the build folder); :func:`build_ops` builds the
ops ahead of time (``make venv`` runs ``tools/build_ops.py``, into ``.venv/torch_extensions``), so that no test or
rank pays for, or can interrupt, a build.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, List, Optional, Sequence

from megatron_cegrpo.errors import ConfigError

__all__ = ["JIT_OPS", "STALE_LOCK_S", "ORPHAN_GRACE_S", "SHARED_FS", "ops_for_this_machine", "build_lock_path",
           "builders_in", "check_build_locks", "build_ops"]

# extension name (torch's build folder) -> DeepSpeed op builder class
JIT_OPS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder",
           "fused_adam": "FusedAdamBuilder"}
# a build of cpu_adam took 46-53 s here (shm_comm 23-31 s) on 2 loaded cores; a lock this old is no build's
STALE_LOCK_S = 10 * 60
# a younger lock with no process working in its folder this long is a killed build's too (torch holds
# the lock with no process there only while it checks the compiler and writes build.ninja: seconds
# at most, on a loaded host)
ORPHAN_GRACE_S = 5.0
#: filesystems a build on another host can lock (this host's /proc cannot see that build)
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "gpfs", "beegfs", "9p",
             "afs", "virtiofs")


def ops_for_this_machine() -> tuple:
    """The JIT ops a trainer rank loads here: ``fused_adam`` with CUDA (``optim/factory.py``),
    else ``cpu_adam`` and ``deepspeed_shm_comm`` (DeepSpeed's CPU collectives)."""
    import torch

    return ("fused_adam",) if torch.cuda.is_available() else ("cpu_adam", "deepspeed_shm_comm")


def build_lock_path(name: str) -> str:
    """The lock file torch holds while it builds extension ``name``:
    ``$TORCH_EXTENSIONS_DIR/<name>/lock``, or ``~/.cache/torch_extensions/py311_cpu/<name>/lock``
    without that variable (``torch.utils.cpp_extension._get_build_directory``, which also
    creates the folder)."""
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.join(_get_build_directory(name, verbose=False), "lock")


def _fs_type(path: str) -> Optional[str]:
    """The filesystem type of the mount holding ``path`` (``/proc/self/mountinfo``), None if unknown."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mounts = [(ln.split()[4], ln.split(" - ", 1)[1].split()[0]) for ln in f if " - " in ln]
    except (OSError, IndexError):
        return None
    path = os.path.realpath(path)
    best = max((m for m in mounts if path == m[0] or path.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


def builders_in(build_dir: str) -> Optional[List[int]]:
    """PIDs of this host's processes whose working directory is ``build_dir`` (torch runs ninja
    there, and ninja the compilers); None where that cannot tell whether a build is running: no
    ``/proc`` (not Linux), or the folder on a filesystem another host may build in
    (:data:`SHARED_FS`, ``fuse.*``)."""
    return _pids_in(build_dir) if _local_builds_visible(build_dir) else None


def _local_builds_visible(build_dir: str) -> bool:
    """Whether this host's ``/proc`` shows every build of ``build_dir``: Linux, and a filesystem no
    other host builds in (not :data:`SHARED_FS`, not ``fuse.*``)."""
    if not os.path.isdir("/proc/self"):
        return False
    fs = _fs_type(build_dir)
    return not (fs is None or fs in SHARED_FS or fs.startswith("fuse"))


def _pids_in(build_dir: str) -> List[int]:
    """PIDs whose working directory is ``build_dir`` (this user's; others' are not readable)."""
    target, pids = os.path.realpath(build_dir), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == target:
                    pids.append(int(entry))
            except OSError:  # gone meanwhile, or another user's
                continue
    return pids


def _orphaned(lock: str, grace_s: float, max_wait_s: float) -> bool:
    """True when ``lock`` stays in place with no process building in its folder for ``grace_s``
    seconds in a row (checked every 0.1 s). False when the lock goes, where :func:`builders_in`
    cannot tell or another user made the lock (their processes are not readable), and after
    ``max_wait_s`` of a build still running (the load waits for it anyway; a build whose Python
    parent was killed keeps its compilers running a while, then leaves the lock: caught here once
    they end)."""
    folder, start = os.path.dirname(lock), time.monotonic()
    try:
        if os.stat(lock).st_uid != os.getuid():
            return False
    except FileNotFoundError:
        return False
    if not _local_builds_visible(folder):  # decided once: the mount does not change while polling
        return False
    idle_since = start
    while os.path.exists(lock):
        pids = _pids_in(folder)
        now = time.monotonic()
        if now - start > max_wait_s:
            return False
        if pids:
            idle_since = now
        elif now - idle_since >= grace_s:
            return True
        time.sleep(0.1)
    return False


def _fix(lock: str) -> str:
    return (f"fix: delete {os.path.dirname(lock)} (it is rebuilt on next use) or set TORCH_EXTENSIONS_DIR "
            "to another folder")


def check_build_locks(names: Optional[Iterable[str]] = None, stale_after_s: float = STALE_LOCK_S,
                      now: Optional[float] = None, grace_s: float = ORPHAN_GRACE_S) -> None:
    """Stop at start-up when a killed build left a lock that would make this run wait forever.

    Args:
        names: extension names (keys of :data:`JIT_OPS`); default :func:`ops_for_this_machine`.
        stale_after_s: a lock file older than this (seconds, by its mtime) is a dead build's.
        now: the current time (``time.time()``; a parameter for tests).
        grace_s: a younger lock is a dead build's too when no process works in its folder for
            this many seconds in a row (Linux, a local filesystem, the lock this user's:
            :func:`builders_in`); while a build runs (ninja or a compiler there) this waits for it,
            at most until the lock is ``stale_after_s`` old.
    Raises:
        ConfigError: naming the lock, its age or that no build holds it, and the fix (delete the
            build folder, or point ``TORCH_EXTENSIONS_DIR`` elsewhere). A build in progress: no error.
    """
    now = time.time() if now is None else now
    for name in ops_for_this_machine() if names is None else names:
        lock = build_lock_path(name)
        try:
            age = now - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue
        if age > stale_after_s:
            raise ConfigError(
                f"torch extension build lock {lock} is {age / 60:.0f} min old: a build of DeepSpeed's "
                f"{name} op was killed and every load of it would wait forever; {_fix(lock)}")
        if _orphaned(lock, grace_s, max_wait_s=stale_after_s - age):
            raise ConfigError(
                f"torch extension build lock {lock} is held by no running build (no process in its folder "
                f"for {grace_s:g} s): a build of DeepSpeed's {name} op was killed and every load of it "
                f"would wait forever; {_fix(lock)}")


def build_ops(names: Optional[Sequence[str]] = None) -> None:
    """Build (or load, when already built) DeepSpeed's JIT ops ``names`` (default
    :func:`ops_for_this_machine`) now, in this process,
    so that later processes only load them. Raises what the op builder raises (a compiler
    error) and ConfigError for a stale lock (:func:`check_build_locks`)."""
    from deepspeed.accelerator import get_accelerator

    names = ops_for_this_machine() if names is None else names
    check_build_locks(names)
    for name in names:
        t0 = time.time()
        get_accelerator().create_op_builder(JIT_OPS[name]).load(verbose=False)
        print(f"[cegrpo] DeepSpeed op {name}: ready in {time.time() - t0:.0f} s "
              f"({os.path.dirname(build_lock_path(name))})", flush=True)
