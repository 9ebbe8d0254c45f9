"""The drift controller (issue 31 item 3; docs/training_health.md): schedules dense steps from the
drift probe's dense-view KL to the base model, inside a target band, within a byte budget.

At the end of every probe iteration t (``--drift-probe-interval``) it reads

- ``measured`` = ``probe/kl_to_base``: KL(pi_t || pi_base) per response token on the probe batch,
  both models' log-probs through dense boundaries (``training/drift_probe.py``). Never a
  compression-view number: those carry the codec's own error (``probe/view_abs_logprob_diff``)
  and the seeds call them inflated (status 2026-07-31 section 3);
- the byte meters' cumulative boundary totals W (``comm/total_wire_bytes``) and D
  (``comm/total_dense_equiv_bytes``) over every stage, whose quotient is the run's
  ``comm/avg_boundary_ratio``;

and decides whether iteration t + 1 is a dense step (``training/dense_step.py``: exactly what an
interval dense step is):

1. the band, with hysteresis: the controller turns *on* when ``measured > HIGH``
   (``--drift-target-kl``) and *off* when ``measured < LOW`` (``--drift-target-kl-low``, default
   HIGH / 2); between the two it keeps its state, so one noisy probe near an edge does not
   toggle it and, once on, it keeps taking dense steps until the drift is back below LOW;
2. the budget: while on, it takes one dense step per probe if the run's average boundary ratio
   stays within ``--drift-max-boundary-ratio`` R after it,

       (W + d) / (D + d) <= R,   d = D / t,

   d being the mean dense-equivalent boundary bytes of one iteration so far (the dense step's
   bytes, estimated: its real size depends on its batch's lengths). Otherwise it waits
   (``drift/action`` -1) and tries again at the next probe, when the compressed iterations in
   between have lowered the average.

Every rank holds a controller; the driver's reduced inputs reach every rank in one broadcast
(``GRPOTrainer._drift_control``), so every rank takes the same decision and holds the same state,
which every stage checkpoints (``trainer_state["drift_controller"]``): a resumed run takes the
dense step a checkpoint's iteration scheduled.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

__all__ = ["DriftController", "ACTIONS"]

#: ``drift/action`` values
ACTIONS = {"hold": 0, "dense": 1, "over_budget": -1}


class DriftController:
    """The decision logic and its state: pure Python, no collective (the caller broadcasts).

    Args:
        high: HIGH, ``--drift-target-kl`` (nats per response token, > 0).
        low: LOW, ``--drift-target-kl-low`` (in [0, HIGH]); None: HIGH / 2.
        max_ratio: R, ``--drift-max-boundary-ratio`` (in (0, 1]).
    Raises:
        ValueError: a band or budget out of range (the flags are checked at start-up first).
    """

    def __init__(self, high: float, low: Optional[float] = None, max_ratio: float = 0.1):
        low = high / 2 if low is None else low
        if not (high > 0 and 0 <= low <= high and 0 < max_ratio <= 1):
            raise ValueError(f"drift controller: need 0 <= low <= high, high > 0, 0 < max_ratio <= 1; got "
                             f"high={high!r}, low={low!r}, max_ratio={max_ratio!r}")
        self.high, self.low, self.max_ratio = float(high), float(low), float(max_ratio)
        self.active = False  # inside the band: the last edge crossed was HIGH
        self.scheduled: Optional[int] = None  # the iteration it made dense, until it has run
        self.dense_steps = 0  # dense steps it scheduled that have run
        self._last: Dict[str, float] = {}  # the last observe()'s measured value and action, for metrics()

    def is_dense(self, t: int) -> bool:
        """Whether the controller scheduled iteration ``t`` as a dense step."""
        return self.scheduled == t

    def end_iteration(self, t: int) -> None:
        """After iteration ``t``'s passes: a scheduled dense step that ran is counted."""
        if self.scheduled is not None and self.scheduled <= t:
            self.dense_steps += int(self.scheduled == t)
            self.scheduled = None
        self._last = {}

    def fits_budget(self, t: int, wire_total: float, dense_total: float) -> bool:
        """Whether one more dense iteration keeps ``(W + d) / (D + d) <= R`` with ``d = D / t``.

        Args:
            t: iterations so far (>= 1): the byte totals span iterations 1..t.
            wire_total, dense_total: W and D, bytes (cumulative over the run and every stage).
        Returns:
            False without boundary traffic yet (D = 0: nothing to estimate from).
        """
        if dense_total <= 0 or t < 1:
            return False
        d = dense_total / t
        return (wire_total + d) <= self.max_ratio * (dense_total + d)

    def observe(self, t: int, measured: float, wire_total: float, dense_total: float, next_dense: bool = False) -> int:
        """The decision at the end of probe iteration ``t`` (call :meth:`end_iteration` first).

        Args:
            t: the iteration just finished.
            measured: the dense-view KL to the base, nats per response token; NaN or inf (no
                measurement) holds: no state change, no dense step.
            wire_total, dense_total: W and D (see :meth:`fits_budget`).
            next_dense: iteration t + 1 is a dense step anyway (``--dense-step-interval``): the
                controller then schedules nothing of its own (action 0) but still moves its band state.
        Returns:
            the action (:data:`ACTIONS`): 1 iteration t + 1 is dense, 0 none wanted, -1 wanted but
            over the budget.
        """
        action = ACTIONS["hold"]
        if math.isfinite(measured):
            if measured > self.high:
                self.active = True
            elif measured < self.low:
                self.active = False
            if self.active and not next_dense:
                action = ACTIONS["dense"] if self.fits_budget(t, wire_total, dense_total) else ACTIONS["over_budget"]
        if action == ACTIONS["dense"]:
            self.scheduled = t + 1
        self._last = {"drift/measured": float(measured), "drift/action": action}
        return action

    def metrics(self) -> Dict[str, float]:
        """``drift/target`` (HIGH), ``drift/target_low`` (LOW), ``drift/active`` (0/1),
        ``drift/dense_steps`` (dense steps it scheduled that have run), ``drift/action`` (0 on an
        iteration without a probe) and, on a probe iteration, ``drift/measured`` (the KL it read)."""
        out = {"drift/target": self.high, "drift/target_low": self.low, "drift/active": int(self.active),
               "drift/dense_steps": self.dense_steps, "drift/action": ACTIONS["hold"]}
        out.update(self._last)
        return out

    def state_dict(self) -> Dict:
        return {"active": self.active, "scheduled": self.scheduled, "dense_steps": self.dense_steps}

    def load_state_dict(self, state: Dict) -> None:
        self.active, self.scheduled = bool(state["active"]), state["scheduled"]
        self.dense_steps, self._last = int(state["dense_steps"]), {}
