"""A rank's supervisor: run the rank's work in a child process and report how it ended.

DeepSpeed's launcher (and torchrun) stop every rank as soon as one exits non-zero, and name
only a command line. The anchor circuit is advisory (DESIGN.md section 4), so an anchor that
dies (SIGKILL, out of memory, a bug) must not take the pipeline stages with it; and when a
stage dies, the user needs to know which rank, why, and where the last checkpoint is.

So under a launcher (``WORLD_SIZE`` > 1) each launched process re-runs its own command line
in a child (``CEGRPO_SUPERVISED=1``; the child dies with its supervisor) and waits for it:

- the child exits 0: exit 0;
- the anchor rank's child dies in any way: one line saying so, exit 0 (the stages notice
  the closed connection, log ``anchor/alive`` 0 and train on without the correction);
- a stage's child is killed by a signal or fails: one line naming the rank, the stage, the
  signal or status and the newest complete checkpoint, then the same non-zero status (a
  signal N as 128 + N), so the launcher stops the run; status 2 (a configuration error,
  already reported) and ``heartbeat.EXIT_NO_HEARTBEAT`` (the heartbeat watchdog ended the child
  after naming the hung rank, ``heartbeat.py``) are passed on silently.

Under torchrun's elastic agent with restarts left (``--max-restarts N``, ``restart.py``) every
death is a failure the agent answers by restarting every rank from the newest complete
checkpoint, the anchor's included (a run without the correction would leave the fault-free
trajectory): the line then says so and the status is non-zero. Without restarts left, a stage's
line is followed by one saying how to get them (:func:`~megatron_cegrpo.restart.how_to_restart`).

SIGTERM and SIGINT sent to the supervisor are passed to the child, with a SIGCONT (a stopped
child acts on them at once rather than when the launcher's grace ends in SIGKILL). Set
``CEGRPO_NO_SUPERVISOR=1`` to run ranks unsupervised.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from typing import List, Mapping, Optional

from megatron_cegrpo.heartbeat import EXIT_NO_HEARTBEAT
from megatron_cegrpo.restart import elastic_restarts, how_to_restart

__all__ = ["should_supervise", "supervise", "rank_role", "restart_line"]

ENV_SUPERVISED = "CEGRPO_SUPERVISED"
ENV_DISABLE = "CEGRPO_NO_SUPERVISOR"


def should_supervise(env: Mapping[str, str] = os.environ) -> bool:
    """True for a launched rank of a multi-rank run that is not already the supervised child."""
    return (env.get(ENV_SUPERVISED) != "1" and env.get(ENV_DISABLE) != "1"
            and int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" in env)


def rank_role(argv: List[str], rank: int, world_size: int) -> str:
    """``"anchor"`` for the anchor ranks (the last ``--anchor-ranks`` of the world, DESIGN.md
    section 1), else ``"pipeline stage <rank>"``, or with data parallelism (issue 14; stage-major
    ranks, ``layout.Layout``) ``"pipeline stage <s> (data-parallel replica <r>)"``;
    at ``--tensor-model-parallel-size`` T > 1 (Megatron's order, TP fastest) the parenthesis adds
    ``"TP rank <t>"``, e.g. ``"pipeline stage 1 (data-parallel replica 0, TP rank 1)"``."""
    from megatron_cegrpo.arguments import AnchorConfig, ParallelConfig
    from megatron_cegrpo.layout import Layout

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--anchor-ranks", type=int, default=AnchorConfig.anchor_ranks)
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=ParallelConfig.pipeline_model_parallel_size)
    ap.add_argument("--tensor-model-parallel-size", type=int, default=ParallelConfig.tensor_model_parallel_size)
    args, _ = ap.parse_known_args(argv)
    return Layout(world_size, max(args.pipeline_model_parallel_size, 1), max(args.tensor_model_parallel_size, 1),
                  max(args.anchor_ranks, 0)).role(rank)


def _save_dir(argv: List[str]) -> Optional[str]:
    """``--save`` of a command line, or None."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--save", default=None)
    args, _ = ap.parse_known_args(argv)
    return args.save or None


def _latest_checkpoint(argv: List[str]) -> Optional[str]:
    save = _save_dir(argv)
    if not save:
        return None
    try:
        with open(os.path.join(save, "latest")) as f:
            return os.path.join(save, f.read().strip())
    except OSError:
        return None


def _resume_hint(argv: List[str]) -> str:
    """What the user can resume from: the newest complete checkpoint, none yet under ``--save``,
    or no ``--save`` at all."""
    ckpt = _latest_checkpoint(argv)
    if ckpt:
        return f"; the newest complete checkpoint is {ckpt}: rerun the same command with --load to resume"
    if _save_dir(argv):
        return (f"; no checkpoint had been written under --save {_save_dir(argv)} yet (the first comes at "
                f"--save-interval): rerunning starts the run over")
    return "; no checkpoint was written (pass --save DIR --save-interval N to be able to resume)"


def restart_line(argv: List[str], env: Mapping[str, str]) -> Optional[str]:
    """With torchrun restarts left: what the agent does next (restart every rank and resume from
    the newest complete checkpoint, or from the start when none is written yet); else None.
    Also the end of the heartbeat watchdog's line (``heartbeat.py``)."""
    r = elastic_restarts(env)
    if r is None or not r.left:
        return None
    ckpt = _latest_checkpoint(argv)
    where = (f"resume from the newest complete checkpoint {ckpt}" if ckpt else
             "start over from iteration 0 (no checkpoint written yet" +
             (")" if _save_dir(argv) else "; pass --save DIR --save-interval N to resume instead)"))
    return f"torchrun restarts every rank (restart {r.count + 1} of {r.max}) to {where}"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGKILL when its supervisor dies (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
            # the kernel's out-of-memory killer sends SIGKILL (a study arm died so on 2026-12-02)
            return f"was killed by {name}" + (" (if nobody sent it: out of memory? see `dmesg`)"
                                               if rc == -signal.SIGKILL else "")
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def supervise(env: Mapping[str, str] = os.environ) -> int:
    """Run this process's own command line (``sys.orig_argv``) as a supervised child; return
    the exit status this rank should report (see the module docstring)."""
    argv = list(sys.argv[1:])
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    role = rank_role(argv, rank, world)
    child = subprocess.Popen(list(sys.orig_argv), env=dict(env, **{ENV_SUPERVISED: "1"}),
                             preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)
            child.send_signal(signal.SIGCONT)  # a stopped (hung) child acts on it now, not after the launcher's grace

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = child.wait()
    if rc == 0:
        return 0
    if rc == EXIT_NO_HEARTBEAT:  # the heartbeat watchdog ended it and printed the line (names the hung rank)
        return rc
    what = f"[cegrpo] rank {rank} ({role}, pid {child.pid}) {_describe(rc)}"
    status = 128 - rc if rc < 0 else rc
    restart = restart_line(argv, env)
    if restart is not None and rc != 2:  # the elastic agent restarts every rank, the anchor's death too
        print(f"{what}; {restart}", flush=True)
        return status
    if role == "anchor":
        print(f"{what}; the pipeline stages go on without the sign correction (anchor/alive = 0)", flush=True)
        return 0
    if rc == 2:
        return 2  # a configuration error, reported by the rank itself
    print(f"{what}; the run stops{_resume_hint(argv)}\n{how_to_restart(env)}", flush=True)
    return status
