"""Byte accounting for boundary traffic.

DESIGN.md section 3: every codec reports the bytes it put on the wire per
direction; the log shows ``comm/bytes_ratio`` = wire bytes / dense bytes,
measured from the payload tensors actually sent (not computed from a formula).
Pure Python/tensor code: no torch.distributed (aggregation across ranks, if
wanted, is the caller's business).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict

import torch

__all__ = ["ByteMeter"]

_DIRECTIONS = ("fwd", "bwd")


class ByteMeter:
    """Accumulates wire and dense-equivalent bytes per direction and boundary.

    ``add`` records ``payload.numel() * payload.element_size()`` wire bytes and
    ``dense_numel * payload.element_size()`` dense-equivalent bytes (what the
    dense codec would have sent in the same dtype).

    ``snapshot_and_reset()`` returns the interval's counters (ints unless noted)::

        comm/fwd_bytes, comm/bwd_bytes      wire bytes per direction
        comm/dense_equiv_bytes              dense-equivalent bytes, both directions
        comm/bytes_ratio                    (fwd + bwd) / dense_equiv, float; 0.0 if no traffic
        comm/boundary_{i}/fwd_bytes         per boundary seen in the interval
        comm/boundary_{i}/bwd_bytes
        comm/basis_bytes                    of comm/fwd_bytes: bases shipped by the sender
                                            (``add_basis``; lowrank with a fast-owned basis)
        comm/total_wire_bytes               cumulative wire bytes since creation/restore
        comm/total_dense_equiv_bytes        cumulative dense-equivalent bytes, the same span

    ``state_dict()`` holds the cumulative totals (``comm/total_wire_bytes``,
    ``comm/total_dense_equiv_bytes``) so they survive a checkpoint.
    """

    def __init__(self) -> None:
        self._total_wire = 0
        self._total_dense = 0
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._wire: Dict[str, int] = {d: 0 for d in _DIRECTIONS}
        self._basis = 0
        self._dense = 0
        self._per_boundary: Dict[int, Dict[str, int]] = defaultdict(lambda: {d: 0 for d in _DIRECTIONS})

    def add(self, direction: str, boundary: int, payload: torch.Tensor, dense_numel: int) -> int:
        """Record one payload; returns its wire bytes.

        Raises:
            ValueError: direction not in {"fwd", "bwd"}, negative boundary or
            dense_numel, or payload not a tensor.
        """
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")
        if not isinstance(boundary, int) or isinstance(boundary, bool) or boundary < 0:
            raise ValueError(f"boundary must be a non-negative int, got {boundary!r}")
        if not isinstance(payload, torch.Tensor):
            raise ValueError("payload must be a torch.Tensor")
        if not isinstance(dense_numel, int) or isinstance(dense_numel, bool) or dense_numel < 0:
            raise ValueError(f"dense_numel must be a non-negative int, got {dense_numel!r}")
        elem = payload.element_size()
        wire = payload.numel() * elem
        dense = dense_numel * elem
        self._wire[direction] += wire
        self._dense += dense
        self._per_boundary[boundary][direction] += wire
        self._total_wire += wire
        self._total_dense += dense
        return wire

    def add_basis(self, boundary: int, basis: torch.Tensor) -> int:
        """Record a basis the sender ships forward (no dense equivalent: it is pure overhead, so it
        counts in ``comm/fwd_bytes`` and the ratio, and separately in ``comm/basis_bytes``).
        Returns its wire bytes. Raises ValueError as :meth:`add`."""
        wire = self.add("fwd", boundary, basis, 0)
        self._basis += wire
        return wire

    def snapshot_and_reset(self) -> dict:
        """Return the interval's counters (see class docstring) and start a new interval."""
        fwd, bwd = self._wire["fwd"], self._wire["bwd"]
        out = {
            "comm/fwd_bytes": fwd,
            "comm/bwd_bytes": bwd,
            "comm/dense_equiv_bytes": self._dense,
            "comm/bytes_ratio": float(fwd + bwd) / self._dense if self._dense > 0 else 0.0,
        }
        if self._basis:
            out["comm/basis_bytes"] = self._basis
        for i in sorted(self._per_boundary):
            out[f"comm/boundary_{i}/fwd_bytes"] = self._per_boundary[i]["fwd"]
            out[f"comm/boundary_{i}/bwd_bytes"] = self._per_boundary[i]["bwd"]
        out["comm/total_wire_bytes"] = self._total_wire
        out["comm/total_dense_equiv_bytes"] = self._total_dense
        self._reset_interval()
        return out

    def state_dict(self) -> dict:
        return {
            "comm/total_wire_bytes": self._total_wire,
            "comm/total_dense_equiv_bytes": self._total_dense,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore cumulative totals; the current interval is cleared.

        Raises:
            ValueError: missing ``comm/total_wire_bytes`` or negative values.
        """
        if "comm/total_wire_bytes" not in state:
            raise ValueError("state must contain 'comm/total_wire_bytes'")
        wire = int(state["comm/total_wire_bytes"])
        dense = int(state.get("comm/total_dense_equiv_bytes", 0))
        if wire < 0 or dense < 0:
            raise ValueError("cumulative byte totals must be non-negative")
        self._total_wire = wire
        self._total_dense = dense
        self._reset_interval()
