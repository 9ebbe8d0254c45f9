"""``lowrank``: the seeds' low-rank challenger, a PowerSGD-style projection of the boundary activation.

Sources: system status 2026-07-31 section 3 ("send y = xQ, reconstruct x_hat = yQ^T, backward
through the same projector"; "Q <- orth(X^T (X Q))"); the LA-WARMUP-V2 report (2026-07-04)
sections 6, 7 and 10 (fast-owned Q refreshed every step vs anchor-owned Q rebuilt at fires);
PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019, Algorithm 1: one warm-started power
iteration per step, orthogonalised); issue 10 item 3; DESIGN.md section 3.

Per boundary ``b`` the two ends hold the same orthonormal basis ``Q_b`` [d, r] (in the
pipeline dtype, the dtype it travels in). For a token's activation x [d]:

* forward map   f(x) = (x Q) Q^T; the sender ships the r coefficients ``x Q``;
* backward      the receiver ships ``g Q`` (r numbers a token); the sender rebuilds
  ``(g Q) Q^T`` = J_f^T g, the exact chain rule of f with Q held constant (Q Q^T is symmetric).
  Q is a constant of the step: no gradient flows into how it was computed.

Who owns Q (``q_owner``):

* ``fast``: on the first forward crossing of boundary b in iteration t (the first micro-batch
  of the old-logprob pass), the sender refreshes ``Q_b <- orth(X^T (X Q_b))`` from that
  micro-batch's activations X [s*b, d] (one power iteration warm-started from the previous
  Q; orth = reduced QR with the signs fixed so that diag(R) >= 0), and ships the new Q to the
  receiver once (:meth:`LowRankHalf.basis_to_send`, metered as basis bytes). All passes of
  iteration t (old-logprob, reference, update) then use this one Q at both ends.
* ``anchor``: the anchor rebuilds Q from its dense replay at each fire and sends it to both
  stages of the boundary with its signs (``anchor/basis.py``); a Q received during iteration t
  takes effect at iteration t + 1 at both ends (:meth:`LowRankHalf.stage_basis`). Until the
  first one arrives both ends use :func:`initial_basis` (derived from the run seed; no traffic).

The rank (:func:`lowrank_rank`) is the largest r whose wire bytes, coefficients in both
directions plus basis traffic amortised per iteration, stay within ``keep_ratio`` of dense.

The two directions are one map seen from both ends: ``--boundary-codec lowrank`` is the
forward half :class:`LowRankHalf`, which owns the bases, and its backward view
(:meth:`LowRankHalf.own_backward`), which codes gradients with the same Q (``coupled``: the
half cannot be paired with another, e.g. ``lowrank:mask``).

Pure tensor code: no torch.distributed (the communicator and the anchor client move the bases).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from megatron_cegrpo.compat.placement import compute_device
from .codecs import BoundaryContext, _check_shape
from .halves import DirectionCodec, register_half

__all__ = ["LowRankHalf", "Q_OWNERS", "initial_basis", "lowrank_rank", "orthonormalize", "power_step"]

Q_OWNERS = ("fast", "anchor")


def lowrank_rank(d: int, keep_ratio: float, tokens_per_iteration: int, basis_sends_per_iteration: float) -> int:
    """The rank r of the ``lowrank`` codec at hidden size ``d``.

    Per boundary and iteration, with T = ``tokens_per_iteration`` (token vectors that cross the
    boundary in all passes, both directions) and q = ``basis_sends_per_iteration`` (bases of
    d x r values shipped, amortised), every element in the pipeline dtype::

        wire  = r * T + q * d * r          dense = d * T
        r     = floor(keep_ratio * d * T / (T + q * d))     (the largest r with wire <= keep_ratio * dense)

    e.g. SmolLM2 (d = 576) at the 128-token rollout shape (32 sequences x 128 tokens x 4 crossings:
    old-logprob, reference, update forward and backward; T = 16384), ratio 0.05: r = 27 with a
    fast-owned basis (q = 1), r = 28 with an anchor-owned one (q = 2 / c, c = 4).

    Raises:
        ValueError: non-positive d / T, negative q, keep_ratio outside (0, 1], or a ratio too
            small for rank 1 (the message names ``--boundary-keep-ratio``).
    """
    if int(d) <= 0 or int(tokens_per_iteration) <= 0 or basis_sends_per_iteration < 0:
        raise ValueError(f"lowrank_rank: need d > 0, tokens_per_iteration > 0, basis sends >= 0; got "
                         f"{d}, {tokens_per_iteration}, {basis_sends_per_iteration}")
    if not 0.0 < float(keep_ratio) <= 1.0:
        raise ValueError(f"--boundary-keep-ratio {keep_ratio} must be in (0, 1]")
    d, T, q = int(d), int(tokens_per_iteration), float(basis_sends_per_iteration)
    r = min(d, math.floor(float(keep_ratio) * d * T / (T + q * d)))
    if r < 1:
        raise ValueError(f"--boundary-keep-ratio {keep_ratio} leaves the lowrank codec less than rank 1 at d={d} "
                         f"with {T} boundary tokens per iteration and {q:g} basis sends; fix: raise "
                         f"--boundary-keep-ratio")
    return r


def orthonormalize(m: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis [d, r] of the columns of ``m`` [d, r] (fp32 or fp64), deterministic.

    Reduced Householder QR; each column's sign is flipped so that diag(R) >= 0, which makes the
    result a function of ``m`` alone (identical at both ends). Columns of a rank-deficient ``m``
    still come out orthonormal (Householder Q is orthogonal).
    """
    q, r = torch.linalg.qr(m, mode="reduced")
    sign = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)
    return q * sign


def power_step(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One warm-started power iteration ``orth(X^T (X Q))`` (status 2026-07-31 section 3; PowerSGD
    Algorithm 1), computed in fp32.

    Args:
        q: the previous basis [d, r].
        x: activations [..., d] (flattened to [n, d]).
    Returns:
        the new orthonormal basis [d, r], fp32.
    """
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    return orthonormalize(x2.t() @ (x2 @ q.float()))


def initial_basis(seed: int, boundary: int, d: int, r: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The basis both ends (and the anchor) start from, derived from the run seed: no traffic.

    ``orth(G)`` for G [d, r] standard normal from ``torch.Generator`` seeded with
    ``(seed * 1_000_003 + boundary) mod 2**63``; returned in ``dtype``.
    """
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(boundary)) % (2 ** 63))
    return orthonormalize(torch.randn(int(d), int(r), generator=gen, dtype=torch.float64)).to(dtype)


@register_half("lowrank")
class LowRankHalf(DirectionCodec):
    """Rank-r projection with a warm-started orthonormal basis (module docstring): the forward
    half, owner of the bases; :meth:`own_backward` is the backward view of the same bases.

    Payload per direction: [s, b, r] in the pipeline dtype (``x Q`` forward, ``g Q`` backward);
    a fast-owned basis adds one [d, r] tensor per boundary and iteration, sent forward before
    the first payload (``basis_to_send``). Bytes per iteration and boundary:
    ``e * (r * T + q * d * r)``, e the element size (:func:`lowrank_rank`).

    Args:
        keep_ratio: ``--boundary-keep-ratio``, the byte budget (coefficients + bases) over dense.
        q_owner: ``fast`` or ``anchor`` (``--lowrank-q-owner``).
        tokens_per_iteration: T of :func:`lowrank_rank` (``TrainConfig.boundary_codec_options``).
        anchor_interval: c; an anchor-owned basis costs q = 2 / c sends per iteration.
    State (``state_dict``): per boundary the basis, the iteration it serves from, and an
        anchor-sent basis waiting for its iteration; resumes bit-exactly.
    Raises:
        ValueError: unknown q_owner, bad ratio (see :func:`lowrank_rank`), shape mismatches, or a
            receiver asked to decode an iteration whose basis never arrived.
    """

    RUN_OPTIONS = ("q_owner", "tokens_per_iteration", "anchor_interval")
    coupled = True
    alone = True

    def __init__(self, keep_ratio: float = 0.05, q_owner: str = "fast", tokens_per_iteration: int = 16384,
                 anchor_interval: int = 4):
        if q_owner not in Q_OWNERS:
            raise ValueError(f"--lowrank-q-owner {q_owner!r}: valid values are {', '.join(Q_OWNERS)}")
        self.keep_ratio = float(keep_ratio)
        self.q_owner = q_owner
        self.tokens_per_iteration = int(tokens_per_iteration)
        self.anchor_interval = int(anchor_interval)
        self.basis_sends_per_iteration = 1.0 if q_owner == "fast" else 2.0 / self.anchor_interval
        self._q: Dict[int, torch.Tensor] = {}  # boundary -> basis [d, r], pipeline dtype
        self._q_step: Dict[int, int] = {}  # boundary -> iteration the basis serves (-1: initial)
        self._pending: Dict[int, Tuple[torch.Tensor, int]] = {}  # anchor-sent basis, first iteration
        self._outgoing: Dict[int, torch.Tensor] = {}  # fast owner: refreshed basis not yet shipped
        self._backward = _LowRankBackward(self)

    def own_backward(self) -> "DirectionCodec":
        """The backward half: ``g Q`` forward over the wire, ``(g Q) Q^T`` back, with this half's
        bases (the exact chain rule of the forward map with Q held constant)."""
        return self._backward

    @property
    def tp_splittable(self) -> bool:
        """Fast-owned: the sender's power step ``orth(X^T (X Q))`` runs on bit-identical X and Q on
        every TP rank (QR is deterministic on identical inputs), so every TP rank encodes the same
        coefficients and the same Q, and the communicator splits both over the TP ranks (Q crosses
        once in total). Anchor-owned: the anchor sends Q to each stage's TP rank 0 only
        (``anchor/basis.py``), so the other TP ranks would decode with the initial basis: False."""
        return self.q_owner == "fast"

    # -- the basis -----------------------------------------------------------------
    def rank(self, d: int) -> int:
        """r at hidden size d (:func:`lowrank_rank`)."""
        return lowrank_rank(d, self.keep_ratio, self.tokens_per_iteration, self.basis_sends_per_iteration)

    def summary(self, d: int) -> str:
        return f" (rank {self.rank(d)} of d, {self.q_owner}-owned basis)"

    def check_width(self, d: int) -> None:
        """A budget too small for rank 1 fails here, naming the flag (:func:`lowrank_rank`)."""
        self.rank(d)

    def basis_shape(self, d: int) -> Tuple[int, int]:
        return (int(d), self.rank(d))

    def _current(self, ctx: BoundaryContext, d: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """The basis serving ctx.step at boundary ctx.boundary, in ``dtype`` on ``device`` (the
        tensor it multiplies: the seed-derived and anchor-sent bases are made on the CPU)."""
        b = ctx.boundary
        pend = self._pending.get(b)
        if pend is not None and ctx.step >= pend[1]:
            self._q[b], self._q_step[b] = pend[0].to(dtype), pend[1]
            del self._pending[b]
        if b not in self._q:
            self._q[b], self._q_step[b] = initial_basis(ctx.seed, b, d, self.rank(d), dtype), -1
        if device is not None and self._q[b].device != torch.device(device):
            self._q[b] = self._q[b].to(device)
        return self._q[b]

    def _refresh_if_new_step(self, x: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Sender side: the basis of ctx.step, refreshed from ``x`` on its first crossing (fast owner)."""
        q = self._current(ctx, x.shape[-1], x.dtype, x.device)
        if self.q_owner == "fast" and self._q_step[ctx.boundary] != ctx.step:
            q = power_step(q, x).to(x.dtype)
            self._q[ctx.boundary], self._q_step[ctx.boundary] = q, ctx.step
            self._outgoing[ctx.boundary] = q
        return q

    def basis_to_send(self, ctx: BoundaryContext) -> Optional[torch.Tensor]:
        """Sender, right after ``encode_forward``: the refreshed basis [d, r] to ship once, or None."""
        return self._outgoing.pop(ctx.boundary, None)

    def basis_to_receive(self, ctx: BoundaryContext, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Receiver, before ``decode_forward``: an empty [d, r] buffer when the sender ships this
        iteration's basis with this payload (fast owner, first crossing of ctx.step), else None."""
        if self.q_owner != "fast" or self._q_step.get(ctx.boundary) == ctx.step:
            return None
        d = _check_shape(shape)[2]
        return torch.empty(self.basis_shape(d), dtype=dtype, device=compute_device())  # where the payload lands

    def accept_basis(self, ctx: BoundaryContext, q: torch.Tensor) -> None:
        """Receiver: install the basis the sender shipped for ctx.step."""
        self._q[ctx.boundary], self._q_step[ctx.boundary] = q.clone(), ctx.step

    def stage_basis(self, boundary: int, q: torch.Tensor, first_step: int) -> None:
        """Anchor owner: a basis from the anchor, used from iteration ``first_step`` on (both ends
        receive it in the same iteration and pass the same ``first_step``)."""
        self._pending[int(boundary)] = (q.detach().clone(), int(first_step))

    def _installed(self, ctx: BoundaryContext, d: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        q = self._current(ctx, d, dtype, device)
        if self.q_owner == "fast" and self._q_step[ctx.boundary] != ctx.step:
            raise ValueError(f"lowrank: boundary {ctx.boundary} has no basis for iteration {ctx.step} "
                             f"(serves {self._q_step[ctx.boundary]}); the sender's basis never arrived")
        return q

    # -- the half's API -------------------------------------------------------------------
    def wire_shape(self, shape, ctx, dtype, role):
        s, b, d = _check_shape(shape)
        return (s, b, self.rank(d))

    def nbytes(self, shape, elem, first_of_step):
        """Coefficient bytes of one message, s * b * r * elem; a fast-owned basis (d * r elements a
        boundary and iteration) is metered apart as basis bytes and budgeted in :func:`lowrank_rank`."""
        s, b, d = _check_shape(shape)
        return s * b * self.rank(d) * elem

    def encode(self, t, ctx):
        q = self._refresh_if_new_step(t, ctx)
        return (t.detach() @ q).contiguous()

    def decode(self, payload, ctx, shape):
        """P Q^T for a payload [s, b, r] (both directions). Raises ValueError on a wrong shape."""
        s, b, d = _check_shape(shape)
        if tuple(payload.shape) != (s, b, self.rank(d)):
            raise ValueError(f"payload shape {tuple(payload.shape)} != {(s, b, self.rank(d))}")
        return payload @ self._installed(ctx, d, payload.dtype, payload.device).t()

    def roundtrip(self, t, ctx):
        """Single-process reference ``(x Q) Q^T``, refreshing Q as the sender would (the refreshed
        basis is not queued for shipping: nobody receives it)."""
        return self.forward_roundtrip(t, ctx)[0]

    def forward_roundtrip(self, t, ctx):
        """``((x Q) Q^T, Q)``: the backward of this very map projects with this Q, whatever basis the
        half holds by then (a later step's, an anchor-sent one)."""
        with torch.no_grad():
            q = self._refresh_if_new_step(t, ctx)
            self._outgoing.pop(ctx.boundary, None)
            return (t.detach() @ q) @ q.t(), q

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"q_owner": self.q_owner,
                "bases": {b: (q.clone(), self._q_step[b]) for b, q in self._q.items()},
                "pending": {b: (q.clone(), s) for b, (q, s) in self._pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Raises ValueError when the checkpoint's basis owner differs from this run's."""
        if state.get("q_owner") != self.q_owner:
            raise ValueError(f"the checkpoint's lowrank basis is {state.get('q_owner')}-owned, this run's "
                             f"--lowrank-q-owner is {self.q_owner}; fix: resume with --lowrank-q-owner "
                             f"{state.get('q_owner')}")
        self._q = {int(b): q.clone() for b, (q, _) in state["bases"].items()}
        self._q_step = {int(b): int(s) for b, (_, s) in state["bases"].items()}
        self._pending = {int(b): (q.clone(), int(s)) for b, (q, s) in state["pending"].items()}
        self._outgoing = {}


class _LowRankBackward(DirectionCodec):
    """The backward direction of ``lowrank`` (:meth:`LowRankHalf.own_backward`): the receiver
    sends ``g Q`` [s, b, r], the sender rebuilds ``(g Q) Q^T``, both with the forward half's
    bases. Keeps no state of its own."""

    name = "lowrank"
    coupled = True

    def __init__(self, owner: LowRankHalf):
        self.owner = owner

    @property
    def tp_splittable(self) -> bool:
        """As the forward half's (:attr:`LowRankHalf.tp_splittable`)."""
        return self.owner.tp_splittable

    def wire_shape(self, shape, ctx, dtype, role):
        return self.owner.wire_shape(shape, ctx, dtype, role)

    def nbytes(self, shape, elem, first_of_step):
        return self.owner.nbytes(shape, elem, first_of_step)

    def encode(self, t, ctx):
        return (t.detach() @ self.owner._installed(ctx, t.shape[-1], t.dtype, t.device)).contiguous()

    def decode(self, payload, ctx, shape):
        return self.owner.decode(payload, ctx, shape)

    def backward_roundtrip(self, g, ctx, held):
        """``(g Q) Q^T`` with the Q of the forward map (``held``; the installed basis without one)."""
        if held is None:
            return self.roundtrip(g, ctx)
        with torch.no_grad():
            return (g.detach() @ held) @ held.t()
