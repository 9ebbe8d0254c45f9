"""Checkpoint ring with the anchor's staleness contract (DESIGN.md section 4).

The trainer ships weight checkpoints theta(s) at s = 0, c, 2c, ...; the ring
keeps the newest ``capacity`` of them.  At fire step ``t`` the anchor may read
only checkpoints written at or before ``t - K`` (``K`` = ``delay``).  Every
read goes through :meth:`CheckpointRing.read` (or the helpers built on it),
which refuses a fresher checkpoint, counts the attempt in
``num_no_peek_violations`` and raises :class:`StalenessError`.

Pure tensor code, no torch.distributed.  Tensors are stored as detached clones
(a caller that later updates its live parameters in place cannot leak fresh
weights into the ring) in the dtype they were given.  The forecasts difference
checkpoints that move by ~0.1 % over a 20-step horizon, below bf16 resolution,
so ship fp32 master weights or bf16 *deltas* against a mirror (``anchor/shipment.py``), never
plain bf16 weights.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import torch

__all__ = ["CheckpointRing", "StalenessError"]


class StalenessError(ValueError):
    """A read asked for a checkpoint fresher than ``t - K`` (the no-peek contract)."""


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class CheckpointRing:
    """The newest ``capacity`` checkpoints, keyed by the step that wrote them.

    Args:
        capacity: how many checkpoints to keep (>= 1); the oldest is evicted first.
        delay: K, the staleness of the contract: at fire ``t`` only steps
            ``<= t - delay`` are readable (>= 0).

    Note: with checkpoints put at the step that writes them (before the fire
    at that step), the readable ones at fire ``t`` are at most
    ``capacity - ceil(K / c)``; a forecast needing ``n`` points wants
    ``capacity >= n + ceil(K / c)``.
    """

    def __init__(self, capacity: int = 4, delay: int = 20):
        self.capacity = _check_int("capacity", capacity, 1)
        self.delay = _check_int("delay", delay, 0)
        self._ckpts: "OrderedDict[int, Dict[str, torch.Tensor]]" = OrderedDict()
        self._last_step = None  # newest step ever put (survives eviction)
        self.num_no_peek_violations = 0

    # ------------------------------------------------------------------ write
    def put(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store theta(``step``) (cloned, detached); evicts the oldest beyond capacity.

        Raises:
            ValueError: ``step`` not strictly greater than the newest stored or
                ever-evicted step, a non-tensor value, or names/shapes that differ
                from the checkpoints already held.
        """
        _check_int("step", step, 0)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"checkpoint steps must be strictly increasing: got {step} after {self._last_step}")
        if not tensors:
            raise ValueError("put() needs at least one tensor")
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"checkpoint entry {name!r} is not a tensor: {type(value).__name__}")
        if self._ckpts:
            ref = next(iter(self._ckpts.values()))
            ref_sig = {k: tuple(v.shape) for k, v in ref.items()}
            new_sig = {k: tuple(v.shape) for k, v in tensors.items()}
            if ref_sig != new_sig:
                raise ValueError(
                    "checkpoint names/shapes differ from the ones held: "
                    f"missing={sorted(ref_sig.keys() - new_sig.keys())}, "
                    f"extra={sorted(new_sig.keys() - ref_sig.keys())}, "
                    f"reshaped={sorted(k for k in ref_sig.keys() & new_sig.keys() if ref_sig[k] != new_sig[k])}"
                )
        self._ckpts[step] = {name: value.detach().clone() for name, value in tensors.items()}
        self._last_step = step
        while len(self._ckpts) > self.capacity:
            self._ckpts.popitem(last=False)

    # ------------------------------------------------------------------- read
    @property
    def steps(self) -> List[int]:
        """All held steps, oldest first (readable or not; for logging only)."""
        return list(self._ckpts)

    def newest(self) -> Optional[Tuple[int, Dict[str, torch.Tensor]]]:
        """(step, theta(step)) of the newest checkpoint held (the ring's own storage), or None."""
        if not self._ckpts:
            return None
        step = next(reversed(self._ckpts))
        return step, self._ckpts[step]

    def __len__(self) -> int:
        return len(self._ckpts)

    def available(self, t: int) -> List[int]:
        """Held steps readable at fire ``t`` (``<= t - K``), oldest first."""
        horizon = t - self.delay
        return [s for s in self._ckpts if s <= horizon]

    def read(self, step: int, t: int) -> Dict[str, torch.Tensor]:
        """theta(``step``) for a fire at ``t``.

        The returned dict is new but its tensors are the ring's own storage:
        do not modify them in place.

        Raises:
            StalenessError: ``step > t - K`` (checked first, counted in
                ``num_no_peek_violations``; nothing is returned).
            KeyError: ``step`` was never put or has been evicted.
        """
        if step > t - self.delay:
            self.num_no_peek_violations += 1
            raise StalenessError(
                f"no-peek: fire at t={t} may read checkpoints written at or before "
                f"t-K={t - self.delay}, asked for step {step} "
                f"(violation #{self.num_no_peek_violations})"
            )
        if step not in self._ckpts:
            raise KeyError(f"checkpoint step {step} is not held (held: {self.steps})")
        return dict(self._ckpts[step])

    def latest_readable(self, t: int, n: int) -> List[Tuple[int, Dict[str, torch.Tensor]]]:
        """Up to ``n`` newest checkpoints readable at ``t``, oldest first, as (step, tensors)."""
        _check_int("n", n, 1)
        return [(s, self.read(s, t)) for s in self.available(t)[-n:]]

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Plain ints, lists, dicts and tensors (loads with ``torch.load(weights_only=True)``).

        Tensors are the ring's own storage (like ``nn.Module.state_dict``).
        """
        return {
            "capacity": self.capacity,
            "delay": self.delay,
            "steps": list(self._ckpts),
            "checkpoints": [dict(v) for v in self._ckpts.values()],
            "last_step": -1 if self._last_step is None else self._last_step,
            "num_no_peek_violations": self.num_no_peek_violations,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; tensors are cloned.

        Raises:
            ValueError: the state was written by a ring with a different
                ``capacity`` or ``delay``, or is malformed.
        """
        for key in ("capacity", "delay", "steps", "checkpoints", "last_step", "num_no_peek_violations"):
            if key not in state:
                raise ValueError(f"ring state is missing {key!r}")
        if state["capacity"] != self.capacity or state["delay"] != self.delay:
            raise ValueError(
                f"ring state has capacity={state['capacity']}, delay={state['delay']}; "
                f"this ring has capacity={self.capacity}, delay={self.delay}"
            )
        steps = [int(s) for s in state["steps"]]
        if len(steps) != len(state["checkpoints"]) or len(steps) > self.capacity:
            raise ValueError("ring state: steps and checkpoints disagree or exceed capacity")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"ring state steps are not strictly increasing: {steps}")
        last = int(state["last_step"])
        if steps and last < steps[-1]:
            raise ValueError(f"ring state last_step={last} is older than its newest checkpoint {steps[-1]}")
        self._ckpts = OrderedDict(
            (s, {k: v.detach().clone() for k, v in ck.items()}) for s, ck in zip(steps, state["checkpoints"])
        )
        self._last_step = None if last < 0 else last
        self.num_no_peek_violations = int(state["num_no_peek_violations"])
