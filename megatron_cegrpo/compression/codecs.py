"""The boundary codec: what crosses a pipeline-stage boundary, in both directions.

Source: DESIGN.md section 3; system status 2026-07-31 section 1.2 ("keep exactly
k of d coordinates per token, scale by d/k, mask derived at both ends from
PRF(seed, layer, step, sample, position, channel)"); issue 10 item 4 (independent forward and
backward codecs); issue 34 (one codec interface).

Every codec is a :class:`BoundaryCodec`: a forward half and a backward half, each a
:class:`~megatron_cegrpo.compression.halves.DirectionCodec` from the one registry
(``halves.py``). ``--boundary-codec mask`` is the ``mask`` half in both directions (one
instance: one index cache), ``pcaq:lrq`` two different halves; ``spec.build_codec`` is the one
constructor. A codec maps the dense boundary tensor ``[s, b, d]`` to a wire payload and back:

* forward:  sender ``encode_forward(x)`` -> wire -> receiver ``decode_forward``
* backward: receiver ``encode_backward(dL/d x_hat)`` -> wire -> sender ``decode_backward``.

What the backward is. The sender back-propagates BWD's reconstruction of dL/dx_hat, i.e. it
treats the forward codec as the identity (the straight-through estimator; Bengio, Leonard &
Courville 2013) and compresses the gradient on its own. When FWD and BWD are the same
self-adjoint linear map of ctx (``mask``, ``dense``) or one map seen from both sides
(``lowrank``: ``coupled``) this IS the exact chain rule (J^T g). For any other pair it is not:
e.g. ``pcaq:lrq`` back-propagates a rank-r approximation of dL/dx_hat, not V^T V dL/dx_hat (the
chain rule through the projection). Why: the target is the dense network's gradient; the chain
rule of a projection throws away every gradient component outside the ACTIVATIONS' top
subspace, which the dense gradient has, while the activation-gradient has its own, different,
low-rank structure (issue 10's table: a rank-29 projection of the gradient keeps cos 0.92 with
dense forward).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

if TYPE_CHECKING:  # halves.py imports this module
    from .halves import DirectionCodec

__all__ = ["BoundaryContext", "BoundaryCodec"]


@dataclass(frozen=True)
class BoundaryContext:
    """Everything both ends of a boundary need to derive the same mask.

    Attributes:
        seed: run seed, int in [0, 2**64).
        boundary: boundary index = pipeline rank of the SENDING stage
            (0 = between stage 0 and stage 1).
        step: training iteration t (all passes of one iteration use the same t).
        sample_ids: LongTensor[b], global index of each sample of the micro-batch
            within the iteration's batch.
    """

    seed: int
    boundary: int
    step: int
    sample_ids: torch.Tensor


def register_into(registry: Dict[str, type], what: str, name: str, cls: type) -> type:
    """Put ``cls`` into ``registry`` under ``name`` and set ``cls.name``.

    Raises:
        ValueError: ``name`` already registered to another class (message starts with ``what``).
    """
    existing = registry.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"{what} {name!r} already registered to {existing.__name__}")
    registry[name] = cls
    cls.name = name
    return cls


def _check_shape(shape) -> Tuple[int, int, int]:
    shape = tuple(int(v) for v in shape)
    if len(shape) != 3:
        raise ValueError(f"boundary tensor shape must be [s, b, d], got {shape}")
    return shape  # type: ignore[return-value]


class _PairMap(torch.autograd.Function):
    """forward: FWD.roundtrip(x); backward: BWD.roundtrip(g) (see module docstring), with what the
    forward held for it (``DirectionCodec.forward_roundtrip``: a coupled codec's basis of that step)."""

    @staticmethod
    def forward(ctx, x, codec, bctx):
        ctx.codec, ctx.bctx = codec, bctx
        y, ctx.held = codec.fwd.forward_roundtrip(x, bctx)
        return y

    @staticmethod
    def backward(ctx, g):
        return ctx.codec.bwd.backward_roundtrip(g.contiguous(), ctx.bctx, ctx.held), None, None


class BoundaryCodec:
    """A boundary's codec: forward half ``fwd`` and backward half ``bwd`` (``spec`` is the
    ``--boundary-codec`` text they came from; ``name`` the same text).

    Payload shapes may differ per direction and, for halves with per-step state (``pcaq``),
    per message: the communicator asks :meth:`wire_shape` with the message's context.
    Capabilities (``replica_invariant``, ``tp_splittable``, ``claims_budget``, ``precomputes``)
    follow from the halves' declarations, never from probing.
    """

    def __init__(self, fwd: "DirectionCodec", bwd: "DirectionCodec", spec: str = ""):
        """Raises ValueError: a coupled half (``lowrank``) with any backward but its own view; a
        backward half with ``prefix`` or ``prepass`` (forward-only options: gradients differ per
        sequence, and the prepass is a forward)."""
        for h in (fwd, bwd):
            if h.coupled and bwd is not fwd.own_backward():
                raise ValueError(f"{h.name} couples its two directions (one basis for both): it only goes alone")
        for opt in ("prefix", "prepass"):
            if bwd is not fwd and getattr(bwd, opt, 0):
                raise ValueError(f"{bwd.name}/{opt}=1 is a forward-half option (before the ':'); fix: "
                                 f"{fwd.name}/{opt}=1:{bwd.name}")
        self.fwd, self.bwd, self.spec = fwd, bwd, spec or f"{fwd.name}:{bwd.name}"
        self.name = self.spec
        self._halves = (fwd,) if fwd is bwd else (fwd, bwd)

    # -- declared capabilities ---------------------------------------------------------
    @property
    def replica_invariant(self) -> bool:
        """Every payload depends only on its micro-batch's data and keys (seed, boundary, step,
        sample ids), not on other micro-batches' traffic: data-parallel replicas that split a
        mini-batch into whole micro-batches then send what one replica would (issue 14;
        ``plan.check_codec_layout``). Both halves must be."""
        return bool(self.fwd.replica_invariant and self.bwd.replica_invariant)

    @property
    def tp_splittable(self) -> bool:
        """The TP ranks of a stage can split this codec's traffic (issue 14, docs/parallelism.md):
        every payload, basis and state is a deterministic function of the (bit-identical) boundary
        tensors, the context and what arrived over the boundary. Both halves must be."""
        return bool(self.fwd.tp_splittable and self.bwd.tp_splittable)

    @property
    def claims_budget(self) -> bool:
        """The codec is sized by ``--boundary-keep-ratio`` and the start-up byte-budget check
        applies (``spec.check_codec_budget``); False only for ``dense`` named alone (one half serving
        both directions), the uncompressed control: ``dense:dense`` is checked, and refused."""
        return bool(self.fwd.claims_budget or self.bwd.claims_budget or self.fwd is not self.bwd)

    @property
    def precomputes(self) -> bool:
        """A half has context-only work to do ahead of a crossing (``mask``'s PRF indices):
        ``pipeline/prefetch.py`` calls :meth:`precompute` off the critical path."""
        return any(h.precomputes for h in self._halves)

    @property
    def wants_prepass(self) -> bool:
        """The forward half fits its basis to the step's own boundary states (``pcaq/prepass=1``):
        the first stage runs a forward over the batch first (``PipelineRunner.boundary_prepass``)."""
        return bool(getattr(self.fwd, "prepass", 0))

    def prepass_due(self, ctx: BoundaryContext) -> bool:
        """A prepass would fit a basis at ``ctx``'s (boundary, step): ``prepass`` = 1 and the
        sender holds no basis of that step's window yet (``every`` = R: the window's first
        compressed step)."""
        return self.wants_prepass and self.fwd.prepass_due(ctx)

    def observe_prepass(self, x: torch.Tensor, ctx: BoundaryContext) -> None:
        """The prepass's boundary state ``x`` [s, b, d] of one micro-batch, before any crossing of
        ``ctx``'s step (``SubspaceQuantHalf.observe_prepass``); a no-op for other codecs."""
        if self.wants_prepass:
            self.fwd.observe_prepass(x, ctx)

    @property
    def is_chain_rule(self) -> bool:
        """The backward is the exact chain rule of the forward map (module docstring)."""
        if self.fwd.coupled:
            return True  # one map seen from both sides (lowrank: J = Q Q^T, symmetric)
        # one spec gives both halves the run's keep ratio, and self-adjoint halves take no params
        return type(self.fwd) is type(self.bwd) and self.fwd.self_adjoint_linear

    @property
    def derivations(self) -> dict:
        """Index derivation counters summed over the halves (``mask`` keeps them):
        {"precomputed": n, "on_demand": m}; {} when neither half derives anything."""
        out: dict = {}
        for h in self._halves:
            for k, v in h.derivations.items():
                out[k] = out.get(k, 0) + v
        return out

    # -- start-up ------------------------------------------------------------------------
    def summary(self, d: int) -> str:
        """What the start-up line adds after the codec's name at width ``d`` (e.g. mask: ``" (k=29
        of d)"``): a single-name codec's half's summary, "" for a pair of two halves."""
        return self.fwd.summary(d) if (self.fwd is self.bwd or self.fwd.coupled) else ""

    def check_width(self, d: int) -> None:
        """Raise ValueError (naming the flag) when a half's budget cannot code width ``d``."""
        for h in self._halves:
            h.check_width(d)

    # -- shapes and bytes --------------------------------------------------------------
    def _half(self, direction: str) -> "DirectionCodec":
        if direction not in ("fwd", "bwd"):
            raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
        return self.fwd if direction == "fwd" else self.bwd

    def wire_shape(self, direction: str, shape, ctx: BoundaryContext, dtype: torch.dtype, role: str):
        """Payload shape of the next ``direction`` ("fwd"/"bwd") message of this boundary as
        ``role`` ("send"/"recv") sees it."""
        return tuple(self._half(direction).wire_shape(_check_shape(shape), ctx, dtype, role))

    def payload_shape(self, shape) -> Tuple[int, ...]:
        """The payload shape of both directions for a dense ``shape`` (s, b, d), for halves whose
        payload does not vary per message (``dense``, ``mask``, ``lowrank``).

        Raises:
            ValueError: the directions' payloads differ (use :meth:`wire_shape`).
        """
        ctx = BoundaryContext(seed=0, boundary=0, step=0, sample_ids=torch.zeros(0, dtype=torch.long))
        f = self.fwd.wire_shape(_check_shape(shape), ctx, torch.float32, "recv")
        b = self.bwd.wire_shape(_check_shape(shape), ctx, torch.float32, "recv")
        if tuple(f) != tuple(b):
            raise ValueError(f"{self.spec}: the directions' payloads differ ({f} vs {b}); use wire_shape")
        return tuple(f)

    def bytes_per_message(self, direction: str, shape, elem: int, first_of_step: bool) -> int:
        """Documented wire bytes of one message (the half's ``nbytes``)."""
        return self._half(direction).nbytes(_check_shape(shape), elem, first_of_step)

    # -- the wire ----------------------------------------------------------------------
    def precompute(self, ctx: BoundaryContext, shape, device="cpu") -> bool:
        """Derive, ahead of the crossing ``ctx`` of dense ``shape`` (s, b, d), whatever ``ctx``
        alone determines (issue 10 item 6; ``pipeline/prefetch.py`` calls it on a background
        thread). Thread-safe; the same bits as deriving on demand. Returns True if a half derived
        something (or already held it)."""
        done = [h.precompute(ctx, shape, device) for h in self._halves]
        return any(done)

    def encode_forward(self, x: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Sending stage, forward: activations [s, b, d] -> contiguous payload (no grad)."""
        return self.fwd.encode(x, ctx)

    def decode_forward(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Receiving stage, forward: payload -> dense [s, b, d] input of the next stage."""
        return self.fwd.decode(payload, ctx, shape)

    def decode_sent_forward(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Sending stage: what the receiver decodes from ``payload`` (just encoded here), without
        touching receive-side state (``codec/error_persistence``)."""
        return self.fwd.decode_sent(payload, ctx, shape)

    def encode_backward(self, grad: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Receiving stage, backward: dL/d(decoded input) [s, b, d] -> payload."""
        return self.bwd.encode(grad, ctx)

    def decode_backward(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Sending stage, backward: payload -> dL/d(its output x) [s, b, d]."""
        return self.bwd.decode(payload, ctx, shape)

    def forward_map(self, x: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Differentiable single-process reference: FWD.roundtrip forward, BWD.roundtrip of the
        incoming gradient backward (the pipeline's exact maps, same state updates)."""
        return _PairMap.apply(x, self, ctx)

    # -- basis traffic (a forward half whose two ends share a basis the sender refreshes) ----
    def basis_to_send(self, ctx: BoundaryContext) -> Optional[torch.Tensor]:
        """Sender, after ``encode_forward``: a tensor to ship before this payload (metered as
        basis bytes), or None."""
        return self.fwd.basis_to_send(ctx)

    def basis_to_receive(self, ctx: BoundaryContext, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Receiver, before ``decode_forward``: an empty buffer for the tensor the sender ships with
        this payload, or None."""
        return self.fwd.basis_to_receive(ctx, shape, dtype)

    def accept_basis(self, ctx: BoundaryContext, basis: torch.Tensor) -> None:
        """Receiver: the tensor announced by :meth:`basis_to_receive` has arrived."""
        self.fwd.accept_basis(ctx, basis)

    def stage_basis(self, boundary: int, q: torch.Tensor, first_step: int) -> None:
        """An anchor-sent basis for ``boundary``, used from iteration ``first_step`` on (an
        anchor-owned ``lowrank``; ``anchor/circuit.py``). Raises ValueError for other codecs."""
        self.fwd.stage_basis(boundary, q, first_step)

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The halves' state that outlives a step: ``{}`` when neither has any (checkpoints of the
        stateless codecs unchanged), else ``{"fwd": ..., "bwd": ...}``."""
        f, b = self.fwd.state_dict(), self.bwd.state_dict()
        return {"fwd": f, "bwd": b} if (f or b) else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output into the halves (``{}``: both start without state).
        A coupled codec's checkpoint written before issue 34 (the whole ``lowrank`` state at the
        top level) loads into its forward half.

        Raises:
            ValueError: keys other than fwd / bwd, or a half that rejects its part (the message
            names the flag to change).
        """
        state = dict(state or {})
        if self.fwd.coupled and state and "fwd" not in state:
            state = {"fwd": state}
        extra = sorted(set(state) - {"fwd", "bwd"})
        if extra:
            raise ValueError(f"{self.spec}: unexpected codec state keys {extra}")
        self.fwd.load_state_dict(state.get("fwd", {}))
        if self.bwd is not self.fwd:
            self.bwd.load_state_dict(state.get("bwd", {}))

    def reset(self) -> None:
        """Drop per-step state of both halves."""
        for h in self._halves:
            h.reset()
