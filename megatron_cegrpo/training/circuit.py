"""The slot for a correction circuit beside the fast circuit (DESIGN.md section 4).

The stage worker and the loop call a circuit at fixed points of each iteration without
knowing what it is; the anchor (``anchor/circuit.py``) is the one implementation. A run
without one (``--anchor-ranks 0``) builds none, and the loop iterates over an empty list.
"""

from __future__ import annotations

from typing import Dict, List, Protocol

from megatron_cegrpo.anchor.circuit import AnchorCircuit
from megatron_cegrpo.grpo.batch import RolloutBatch

__all__ = ["Circuit", "circuits_of"]


class Circuit(Protocol):
    """What a correction circuit provides, in the order the loop calls it.

    Attributes:
        name: its key in each stage's ``trainer_state`` checkpoint blob.
        phase: the timer of its after-rollout step (``timing_s/<phase>``).
    """

    name: str
    phase: str

    def connect(self) -> None:
        """Once, after the checkpoint (if any) is loaded."""

    def after_rollout(self, t: int, batch: RolloutBatch) -> None:
        """Iteration ``t``'s batch exists on every stage, before any pass."""

    def before_optimizer_step(self, t: int, timers) -> None:
        """Before the update's optimizer steps (its pre-step hook runs inside them)."""

    def stage_metrics(self, t: int) -> Dict[str, float]:
        """This stage's numbers for iteration ``t``; reduced on the driver as declared in
        :meth:`declare_metrics`."""

    def declare_metrics(self, reducer) -> None:
        """Declare the reduction of each key of :meth:`stage_metrics` (``training/reduce.py``)."""

    def driver_metrics(self) -> Dict:
        """On the driver, after the reduction: what only the driver received (the anchor's
        own statistics on a fire)."""

    def save_into(self, tmp_dir: str) -> None:
        """On the driver, while a checkpoint is written: anything of the circuit's own."""

    def finish(self, t: int, timers) -> None:
        """After the last iteration."""

    def state_dict(self) -> Dict: ...

    def load_state_dict(self, state: Dict) -> None: ...


def circuits_of(cfg, ctx, stage) -> List[Circuit]:
    """The circuits of this run: the anchor when the launch has an anchor rank."""
    if ctx.anchor_rank is None:
        return []
    return [AnchorCircuit(cfg, ctx, stage)]
