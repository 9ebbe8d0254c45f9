"""``codec/error_persistence``: does a codec's forward error keep its direction across steps?

Source: issue 10 item 5 (the seeds saw collapse only with codecs whose error keeps a
direction across steps; status 2026-07-31 section 3).

For boundary ``i`` (sent by pipeline rank ``i``) and iteration ``t`` the *mean boundary error*
is the fp64 vector

    e_t^(i) = (1 / N_t^(i)) * sum over tokens of (x_hat - x)[p, j, :]        in R^d

where the sum runs over every token — every position ``p`` and sample ``j`` of every
micro-batch, padding positions included (the codec sends them like any other) — that the
sending stage sends forward across boundary ``i`` during iteration ``t``'s *update* passes
(all mini-batches and PPO epochs; the old-logprob, reference and probe passes are not
counted), ``N_t^(i)`` their number, ``x`` the dense activations [s, b, d] the sender holds and
``x_hat = codec.decode_forward(codec.encode_forward(x))`` what the receiver decodes, computed
again at the sender from the payload it just encoded (one decode per forward send, no extra
traffic). The logged numbers are

    codec/error_persistence/boundary_<i> = cos(e_t^(i), e_{t-1}^(i))
    codec/error_persistence = sum_i <e_t^(i), e_{t-1}^(i)> / sqrt(sum_i |e_t^(i)|^2 * sum_i |e_{t-1}^(i)|^2)

(the cosine of the boundaries' vectors concatenated), each only where defined: from the
second iteration on, and when neither vector is zero (the dense codec has no error, so it
never logs them). The previous iteration's vectors are checkpointed (:meth:`state_dict`), so
a resumed run logs the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import math
import re
from typing import Dict, Optional

import torch

__all__ = ["BoundaryErrorTracker", "error_persistence_metrics", "declare_error_persistence"]

_PREFIX = "_errpersist/"
_KEY = re.compile(r"^_errpersist/boundary_(\d+)/(dot|sq_cur|sq_prev)$")


class BoundaryErrorTracker:
    """Accumulates one stage's forward boundary error per iteration (see the module docstring).

    Data parallel (issue 14): with the stage's DP ``group`` the token sums and counts are added
    over the replicas at the end of each iteration, so ``e_t`` is the whole batch's mean on every
    replica (the state a checkpoint keeps from replica 0 is every replica's) and each replica
    reports the same raw sums; the metrics reducer adds them over the replicas, which scales the
    dot products and squared norms alike and leaves the cosines unchanged."""

    def __init__(self, group=None) -> None:
        self.group = group  # data parallel (issue 14): the stage's DP group; None at DP = 1
        self._sum: Dict[int, torch.Tensor] = {}
        self._count: Dict[int, int] = {}
        self._prev: Dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, boundary: int, x: torch.Tensor, x_hat: torch.Tensor) -> None:
        """Add one forward send: ``x`` the dense activations, ``x_hat`` the decoded ones, both
        [s, b, d] (any float dtype; the token sum is accumulated in fp64).

        Raises:
            ValueError: shapes differ or are not 3-D.
        """
        if x.dim() != 3 or x.shape != x_hat.shape:
            raise ValueError(f"boundary error needs two [s, b, d] tensors of one shape, got "
                             f"{tuple(x.shape)} and {tuple(x_hat.shape)}")
        e = (x_hat.detach() - x.detach().to(x_hat.dtype)).sum(dim=(0, 1), dtype=torch.float64)
        if boundary in self._sum:
            self._sum[boundary] += e
            self._count[boundary] += x.shape[0] * x.shape[1]
        else:
            self._sum[boundary], self._count[boundary] = e, x.shape[0] * x.shape[1]

    def end_iteration(self) -> Dict[str, float]:
        """Close the iteration: the raw sums of :func:`error_persistence_metrics` for every
        boundary seen now and in the previous iteration (``_errpersist/boundary_<i>/dot``,
        ``/sq_cur``, ``/sq_prev``), then keep this iteration's means as the previous ones.
        A boundary not seen this iteration is forgotten."""
        if self.group is not None:  # the mean over every replica's tokens, the same on each replica
            for b in sorted(self._sum):
                n = torch.tensor([float(self._count[b])], dtype=torch.float64)
                torch.distributed.all_reduce(self._sum[b], group=self.group)
                torch.distributed.all_reduce(n, group=self.group)
                self._count[b] = int(n.item())
        cur = {b: s / self._count[b] for b, s in self._sum.items()}
        out = {}
        for b, e in sorted(cur.items()):
            prev = self._prev.get(b)
            if prev is not None and prev.shape == e.shape:
                out[f"{_PREFIX}boundary_{b}/dot"] = float(torch.dot(e, prev))
                out[f"{_PREFIX}boundary_{b}/sq_cur"] = float(torch.dot(e, e))
                out[f"{_PREFIX}boundary_{b}/sq_prev"] = float(torch.dot(prev, prev))
        self._prev = cur
        self._sum, self._count = {}, {}
        return out

    def state_dict(self) -> dict:
        """The previous iteration's mean error per boundary ({"prev": {i: fp64 [d]}})."""
        return {"prev": {int(b): e.clone() for b, e in self._prev.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the current (unfinished) iteration is cleared.

        Raises:
            ValueError: no ``prev`` entry.
        """
        if "prev" not in state:
            raise ValueError("boundary error state must contain 'prev'")
        self._prev = {int(b): torch.as_tensor(e, dtype=torch.float64).clone() for b, e in state["prev"].items()}
        self._sum, self._count = {}, {}


def _cos(dot: float, sq_a: float, sq_b: float) -> Optional[float]:
    if sq_a <= 0.0 or sq_b <= 0.0:
        return None
    return dot / math.sqrt(sq_a * sq_b)


def error_persistence_metrics(reduced: Dict) -> Dict[str, float]:
    """Derived metric (``training/reduce.py``): ``codec/error_persistence`` and its
    ``/boundary_<i>`` values from the summed ``_errpersist/boundary_<i>/*`` keys (formulas in
    the module docstring); nothing when no boundary has both iterations' errors, and no
    boundary value where one of its vectors is zero."""
    per: Dict[int, Dict[str, float]] = {}
    for k, v in reduced.items():
        m = _KEY.match(k)
        if m:
            per.setdefault(int(m.group(1)), {})[m.group(2)] = float(v)
    out: Dict[str, float] = {}
    tot = {"dot": 0.0, "sq_cur": 0.0, "sq_prev": 0.0}
    for b in sorted(per):
        s = per[b]
        c = _cos(s["dot"], s["sq_cur"], s["sq_prev"])
        if c is not None:
            out[f"codec/error_persistence/boundary_{b}"] = c
        for k in tot:
            tot[k] += s[k]
    c = _cos(tot["dot"], tot["sq_cur"], tot["sq_prev"]) if per else None
    if c is not None:
        out["codec/error_persistence"] = c
    return out


def declare_error_persistence(reducer) -> None:
    """Declare the raw keys (one stage reports each boundary: summed) and the derivation."""
    reducer.declare(_PREFIX, "sum").derive(error_persistence_metrics)
