"""DeepSpeed's JIT-built ops: where torch builds them, a stale build lock, and a prebuild.

DeepSpeed builds its CPU Adam (``cpu_adam``) and its shared-memory collectives
(``deepspeed_shm_comm``) on first use with ``torch.utils.cpp_extension.load``, which guards
each build directory with a lock file (``FileBaton``). A build that is killed mid-way (a
timeout, the OOM killer, Ctrl-C) leaves that file behind, and every later load of the op, by
any process of the same user, waits on it forever without printing anything: the trainer
hangs at its optimizer and every test that trains hangs with it (CI of stop 22, 2026-12-02).
:func:`check_build_locks` turns that into one line at start-up; :func:`build_ops` builds the
ops ahead of time (``make venv`` does, into ``.venv/torch_extensions``), so that no test or
rank pays for, or can interrupt, a build.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Optional, Sequence

from megatron_cegrpo.errors import ConfigError

__all__ = ["JIT_OPS", "STALE_LOCK_S", "ops_for_this_machine", "build_lock_path", "check_build_locks",
           "build_ops"]

# extension name (torch's build folder) -> DeepSpeed op builder class
JIT_OPS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder",
           "fused_adam": "FusedAdamBuilder"}
# a build of cpu_adam takes one to three minutes on 2 loaded cores; a lock this old is no build's
STALE_LOCK_S = 30 * 60


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


def check_build_locks(names: Optional[Iterable[str]] = None, stale_after_s: float = STALE_LOCK_S,
                      now: Optional[float] = None) -> None:
    """Stop at start-up when a killed build left a lock that would make this run wait forever.

    Args:
        names: extension names (keys of :data:`JIT_OPS`); default :func:`ops_for_this_machine`.
        stale_after_s: a lock file older than this (seconds, by its mtime) is a dead build's.
        now: the current time (``time.time()``; a parameter for tests).
    Raises:
        ConfigError: naming the lock, its age and the fix (delete the build folder, or point
            ``TORCH_EXTENSIONS_DIR`` elsewhere). A younger lock is a build in progress: no error.
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
                f"{name} op was killed and every load of it would wait forever; fix: delete "
                f"{os.path.dirname(lock)} (it is rebuilt on next use) or set TORCH_EXTENSIONS_DIR "
                f"to another folder")


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


if __name__ == "__main__":  # make venv: python -m megatron_cegrpo.optim.jit_ops
    build_ops()
