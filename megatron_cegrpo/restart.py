"""Automatic restart under torchrun's elastic agent (issue 35, item 1).

Launched with ``torchrun --max-restarts N``, a rank that dies (a stage, the driver, the anchor,
or the process torchrun launched for any of them) makes the agent stop every rank and start
them all again, up to N times; it tells each worker which start it is through
``TORCHELASTIC_RESTART_COUNT`` (0 for the first) and ``TORCHELASTIC_MAX_RESTARTS``. This
module reads them (standard library only: the supervisor imports it) and decides what a
restarted worker loads (:func:`restart_load_dir`): the newest complete checkpoint under
``--save``, so the run resumes with no person involved. No launcher of our own: the agent
restarts, this module only makes the restart resume.

With the DeepSpeed launcher (no elastic agent), or torchrun without ``--max-restarts``, nothing
changes: a stage death ends the run and its supervisor names the newest checkpoint and, in one
more line, :func:`how_to_restart`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["ElasticRestarts", "elastic_restarts", "restarts_left", "restart_load_dir", "how_to_restart"]

ENV_COUNT = "TORCHELASTIC_RESTART_COUNT"
ENV_MAX = "TORCHELASTIC_MAX_RESTARTS"


@dataclass(frozen=True)
class ElasticRestarts:
    """Where this worker stands among torchrun's restarts: ``count`` restarts done before this
    start (0: the first start), ``max`` allowed (``--max-restarts``)."""

    count: int
    max: int

    @property
    def left(self) -> int:
        """Restarts the agent still makes after this start fails."""
        return max(self.max - self.count, 0)

    @property
    def restarted(self) -> bool:
        """True when this start is a restart (the run died at least once)."""
        return self.count > 0


def elastic_restarts(env: Mapping[str, str] = os.environ) -> Optional[ElasticRestarts]:
    """The restart count and limit torchrun's elastic agent gave this worker, or None when it was
    not started by the agent (the DeepSpeed launcher, a plain process) or asked for no restarts."""
    try:
        count, most = int(env[ENV_COUNT]), int(env[ENV_MAX])
    except (KeyError, ValueError):
        return None
    return ElasticRestarts(count, most) if most > 0 else None


def restarts_left(env: Mapping[str, str] = os.environ) -> int:
    """How many more times the elastic agent restarts every rank if this start dies (0 without it)."""
    r = elastic_restarts(env)
    return r.left if r is not None else 0


def restart_load_dir(save: Optional[str], load: Optional[str], env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The ``--load`` this worker uses: ``load`` unchanged on a first start or without ``--save``;
    on a restart, ``save`` when it holds a complete checkpoint (the run's newest one wins over
    the ``--load`` it started from), else ``load`` as given (a fault before the first checkpoint:
    the run starts over from where it started), else ``save`` itself (empty: ``--save X --load X``
    starts at iteration 0 and keeps the metrics log to recount it, ``docs/reliability.md``)."""
    r = elastic_restarts(env)
    if r is None or not r.restarted or not save:
        return load
    from megatron_cegrpo.checkpointing import has_checkpoint  # torch: only in the worker, never the supervisor

    if has_checkpoint(save) or not load:
        return save
    return load


def how_to_restart(env: Mapping[str, str] = os.environ) -> str:
    """One line for a run that stops on a rank's death: what would have restarted it."""
    if ENV_MAX in env and env.get(ENV_MAX, "0") not in ("", "0"):
        return (f"[cegrpo] the {env[ENV_MAX]} restart(s) of torchrun --max-restarts are spent; raise "
                "--max-restarts to restart more often")
    return ("[cegrpo] to restart every rank automatically from the newest checkpoint, launch with "
            "torchrun --max-restarts N (with --save DIR --save-interval K)")
