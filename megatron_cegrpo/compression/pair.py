"""PairCodec: a boundary codec whose forward and backward directions are independent halves.

Issue 10, item 4. ``--boundary-codec FWD:BWD`` (``spec.py``) builds a :class:`PairCodec` from
two :class:`~megatron_cegrpo.compression.halves.DirectionCodec` halves:

* forward: the sender encodes activations x with FWD, the receiver decodes x_hat;
* backward: the receiver encodes g = dL/dx_hat with BWD, the sender decodes g_hat and
  back-propagates g_hat into its stage as dL/dx.

What the backward is. The sender back-propagates BWD's reconstruction of dL/dx_hat, i.e. it
treats the forward codec as the identity (the straight-through estimator; Bengio, Leonard &
Courville 2013) and compresses the gradient on its own. When FWD and BWD are the same
self-adjoint linear map of ctx (``mask:mask``, ``dense:dense``) this IS the exact chain rule
(J^T g with J = J^T = the map), bit-identical to the single-name codec. For any other pair
it is not: e.g. ``pcaq:lrq`` back-propagates a rank-r approximation of dL/dx_hat, not
V^T V dL/dx_hat (the chain rule through the projection, with straight-through through the
rounding). Why: the target is the dense network's gradient; the chain rule of a projection
throws away every gradient component outside the ACTIVATIONS' top subspace, which the dense
gradient has, while the activation-gradient has its own, different, low-rank structure
(issue 10's table: a rank-29 projection of the gradient keeps cos 0.92 with dense forward).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import torch

from .codecs import BoundaryCodec, BoundaryContext, _check_shape
from .halves import DirectionCodec

__all__ = ["PairCodec"]


class _PairMap(torch.autograd.Function):
    """forward: FWD.roundtrip(x); backward: BWD.roundtrip(g) (see module docstring)."""

    @staticmethod
    def forward(ctx, x, codec, bctx):
        ctx.codec, ctx.bctx = codec, bctx
        return codec.fwd.roundtrip(x, bctx)

    @staticmethod
    def backward(ctx, g):
        return ctx.codec.bwd.roundtrip(g.contiguous(), ctx.bctx), None, None


class PairCodec(BoundaryCodec):
    """Forward half ``fwd`` and backward half ``bwd`` (``spec`` is the text they came from).

    Payload shapes may differ per direction and, for halves with per-step state (``pcaq``),
    per message: the communicator asks :meth:`wire_shape` with the message's context.
    :meth:`payload_shape` answers only for stateless halves of equal shape (``mask:mask``).
    """

    def __init__(self, fwd: DirectionCodec, bwd: DirectionCodec, spec: str = ""):
        self.fwd, self.bwd, self.spec = fwd, bwd, spec or f"{fwd.name}:{bwd.name}"
        self.name = self.spec
        #: whether a half has context-only work to do ahead of a crossing (``has_precompute``)
        self.precomputes = any(type(h).precompute is not DirectionCodec.precompute for h in (fwd, bwd))

    def precompute(self, ctx: BoundaryContext, shape, device="cpu") -> bool:
        """Both halves' :meth:`DirectionCodec.precompute` for the crossing ``ctx`` of dense
        ``shape`` (s, b, d) (issue 10 item 6: a ``mask`` half's PRF indices leave the critical
        path as the single ``mask`` codec's do). Returns True if either derived something."""
        f = self.fwd.precompute(ctx, shape, device)
        b = self.bwd.precompute(ctx, shape, device)
        return bool(f or b)

    @property
    def derivations(self) -> dict:
        """Index derivation counters summed over the halves that keep them (``mask``):
        {"precomputed": n, "on_demand": m}; {} when neither does."""
        out: dict = {}
        for h in (self.fwd, self.bwd):
            for k, v in getattr(h, "derivations", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def replica_invariant(self) -> bool:
        """Both halves are (:attr:`BoundaryCodec.replica_invariant`)."""
        return bool(self.fwd.replica_invariant and self.bwd.replica_invariant)

    @property
    def tp_splittable(self) -> bool:
        """Both halves are (:attr:`BoundaryCodec.tp_splittable`)."""
        return bool(self.fwd.tp_splittable and self.bwd.tp_splittable)

    @property
    def is_chain_rule(self) -> bool:
        """True when the backward is the exact chain rule of the forward map (module docstring)."""
        return type(self.fwd) is type(self.bwd) and self.fwd.self_adjoint_linear and (
            getattr(self.fwd, "keep_ratio", None) == getattr(self.bwd, "keep_ratio", None))

    def wire_shape(self, direction: str, shape, ctx: BoundaryContext, dtype: torch.dtype, role: str):
        """Payload shape of the next ``direction`` ("fwd"/"bwd") message; ``role`` "send"/"recv"."""
        half = self.fwd if direction == "fwd" else self.bwd
        return tuple(half.wire_shape(_check_shape(shape), ctx, dtype, role))

    def payload_shape(self, shape):
        ctx = BoundaryContext(seed=0, boundary=0, step=0, sample_ids=torch.zeros(0, dtype=torch.long))
        f = self.fwd.wire_shape(shape, ctx, torch.float32, "recv")
        b = self.bwd.wire_shape(shape, ctx, torch.float32, "recv")
        if f != b:
            raise ValueError(f"{self.spec}: the directions' payloads differ ({f} vs {b}); use wire_shape")
        return tuple(f)

    def bytes_per_message(self, direction: str, shape, elem: int, first_of_step: bool) -> int:
        """Documented wire bytes of one message (halves' ``nbytes``)."""
        half = self.fwd if direction == "fwd" else self.bwd
        return half.nbytes(_check_shape(shape), elem, first_of_step)

    def encode_forward(self, x, ctx):
        return self.fwd.encode(x, ctx)

    def decode_forward(self, payload, ctx, shape):
        return self.fwd.decode(payload, ctx, shape)

    def decode_sent_forward(self, payload, ctx, shape):
        return self.fwd.decode_sent(payload, ctx, shape)

    def encode_backward(self, grad, ctx):
        return self.bwd.encode(grad, ctx)

    def decode_backward(self, payload, ctx, shape):
        return self.bwd.decode(payload, ctx, shape)

    def forward_map(self, x, ctx):
        """Differentiable single-process reference: FWD.roundtrip forward, BWD.roundtrip of
        the incoming gradient backward (the pipeline's exact maps, same state updates)."""
        return _PairMap.apply(x, self, ctx)

    def state_dict(self) -> dict:
        """The halves' state that outlives a step (``DirectionCodec.state_dict``): ``{}`` when
        neither has any (every pair without a warm-started basis: checkpoints unchanged), else
        ``{"fwd": ..., "bwd": ...}``."""
        f, b = self.fwd.state_dict(), self.bwd.state_dict()
        return {"fwd": f, "bwd": b} if (f or b) else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output into the halves (``{}``: both start without state).

        Raises:
            ValueError: keys other than fwd / bwd, or a half that rejects its part (the message
            names the flag to change).
        """
        state = dict(state or {})
        extra = sorted(set(state) - {"fwd", "bwd"})
        if extra:
            raise ValueError(f"{self.spec}: unexpected codec state keys {extra}")
        self.fwd.load_state_dict(state.get("fwd", {}))
        self.bwd.load_state_dict(state.get("bwd", {}))

    def reset(self) -> None:
        """Drop per-step state of both halves."""
        self.fwd.reset()
        self.bwd.reset()
