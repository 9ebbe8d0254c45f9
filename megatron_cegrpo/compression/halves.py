"""One direction of a stage boundary: the halves a ``FWD:BWD`` codec spec names.

A :class:`DirectionCodec` turns a dense boundary tensor ``[s, b, d]`` into a wire payload on
the sending stage and back on the receiving one, for ONE direction (activations forward or
activation-gradients backward). :class:`~megatron_cegrpo.compression.pair.PairCodec` joins
two of them into a :class:`~megatron_cegrpo.compression.codecs.BoundaryCodec`
(issue 10, item 4: independent forward and backward codecs).

Halves registered here: ``dense`` (identity) and ``mask`` (the exact-k PRF mask of
:class:`~megatron_cegrpo.compression.codecs.MaskCodec`); ``subspace.py`` adds ``pcaq`` and
``lrq``, ``repeat.py`` adds ``rpq``. Payloads are in the dense tensor's dtype (the pipeline dtype megatron-core's p2p
buffers use); halves whose payload is a byte string view it as that dtype (``wire.py``).

Sender and receiver state are kept apart (a stage can be both, for different boundaries, and
the single-process reference :meth:`DirectionCodec.roundtrip` plays both).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Tuple, Type

import torch

from .codecs import BoundaryContext, MaskCodec, _check_shape, register_into

__all__ = ["DirectionCodec", "DenseHalf", "MaskHalf", "register_half", "get_half", "available_halves"]

_HALVES: Dict[str, Type["DirectionCodec"]] = {}


def register_half(name: str) -> Callable[[Type["DirectionCodec"]], Type["DirectionCodec"]]:
    """Class decorator registering a :class:`DirectionCodec` under ``name`` (a spec half).

    Raises:
        ValueError: ``name`` already registered to another class.
    """

    def deco(cls):
        return register_into(_HALVES, "half codec", name, cls)

    return deco


def available_halves() -> List[str]:
    """Sorted names usable on either side of ``FWD:BWD``."""
    return sorted(_HALVES)


def get_half(name: str, keep_ratio: float, params: Dict[str, str]) -> "DirectionCodec":
    """Instantiate half ``name`` with the run's keep ratio and the spec's ``key=value`` params
    (converted to the constructor's annotated int/float types).

    Raises:
        ValueError: unknown name, unknown parameter or a value of the wrong type/range.
    """
    cls = _HALVES.get(name)
    if cls is None:
        raise ValueError(f"unknown half codec {name!r}; valid: {', '.join(available_halves())}")
    kwargs = {}
    for key, raw in params.items():
        kind = cls.PARAMS.get(key)
        if kind is None:
            raise ValueError(f"{name} takes no parameter {key!r} (its parameters: {', '.join(cls.PARAMS) or 'none'})")
        try:
            kwargs[key] = kind(raw)
        except ValueError:
            raise ValueError(f"{name}/{key}={raw!r} is not a number") from None
    if cls.claims_budget:
        kwargs["keep_ratio"] = keep_ratio
    return cls(**kwargs)


class DirectionCodec(abc.ABC):
    """One direction's codec. ``shape`` is always the dense ``(s, b, d)``."""

    name = "abstract"
    #: the Jacobian of roundtrip is its own transpose and roundtrip is linear given ctx
    #: (mask, dense): as the backward half after the same forward half it is the exact chain rule
    self_adjoint_linear = False
    #: every payload depends only on its micro-batch's data and keys (seed, boundary, step,
    #: sample ids, positions), not on other micro-batches' traffic: data-parallel replicas that
    #: split a mini-batch into whole micro-batches then send what one replica would (issue 14;
    #: ``plan.check_codec_layout``). False for a basis kept per step or per run.
    replica_invariant = False
    #: what :attr:`BoundaryCodec.tp_splittable` says, for one direction: every payload and all state
    #: of both roles follow deterministically from the dense tensor, ctx and the payloads received
    #: (no side channel), so a stage's TP ranks, holding identical tensors, encode identical bits
    tp_splittable = False
    #: the half is sized by the run's ``--boundary-keep-ratio`` (its constructor takes ``keep_ratio``)
    claims_budget = True
    #: the ``name/key=value`` parameters a spec may set, with their types, in the constructor's order
    PARAMS: Dict[str, type] = {}

    @abc.abstractmethod
    def wire_shape(self, shape, ctx: BoundaryContext, dtype: torch.dtype, role: str) -> Tuple[int, ...]:
        """Payload shape for the next message of this boundary as seen by ``role``
        ("send" or "recv"); both roles answer the same for the same message."""

    @abc.abstractmethod
    def encode(self, t: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Sender: dense [s, b, d] -> payload (t's dtype, no grad)."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Receiver: payload -> dense [s, b, d] in payload's dtype."""

    @abc.abstractmethod
    def nbytes(self, shape, elem: int, first_of_step: bool) -> int:
        """Documented wire bytes of one message (padding to whole elements included);
        ``first_of_step``: the first message of its (boundary, step), which carries any
        per-step basis."""

    def precompute(self, ctx: BoundaryContext, shape, device="cpu") -> bool:
        """Derive ahead of the crossing whatever ``ctx`` and the dense ``shape`` (s, b, d)
        alone determine (``BoundaryCodec.precompute``; called by :meth:`PairCodec.precompute`
        off the critical path). Default: nothing, returns False (halves whose work depends on
        the data, e.g. ``pcaq``, ``lrq``, ``rpq``). Must be thread-safe and give the same bits
        as deriving on demand."""
        return False

    def step_nbytes(self, shape, elem: int, messages: int, keys: int) -> int:
        """Documented wire bytes of one step's ``messages`` messages of ``shape`` (s, b, d) in
        this direction, ``keys`` of them distinct micro-batches (the rest are later crossings of
        those; halves that code a later crossing differently, ``rpq``, override this).
        ``elem``: the wire dtype's element size in bytes. Default: the first message with any
        per-step basis (``nbytes(first_of_step=True)``), the other ``messages - 1`` without;
        0 when ``messages <= 0``."""
        messages = int(messages)
        if messages <= 0:
            return 0
        return self.nbytes(shape, elem, True) + (messages - 1) * self.nbytes(shape, elem, False)

    def decode_sent(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Sender: what the receiver will decode from the payload it has just encoded
        (``codec/error_persistence``), from the sender's own state and without changing the
        receiver-side state (a stage can be sender and receiver of different boundaries)."""
        return self.decode(payload, ctx, shape)

    def roundtrip(self, t: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Single-process reference of decode(encode(t)), with the same state updates as
        the two ends of a pipeline (no grad)."""
        with torch.no_grad():
            payload = self.encode(t.detach(), ctx)
            return self.decode(payload, ctx, tuple(t.shape))

    def state_dict(self) -> dict:
        """State that outlives a step, for checkpoints (``PairCodec.state_dict``); default ``{}``."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Default: only ``{}`` is accepted.

        Raises:
            ValueError: a non-empty state for a half without any.
        """
        if state:
            raise ValueError(f"{self.name} half keeps no state; unexpected state keys {sorted(state)}")

    def reset(self) -> None:
        """Forget any per-step state (both roles)."""


@register_half("dense")
class DenseHalf(DirectionCodec):
    """Identity: payload = the tensor, bytes s * b * d * element_size."""

    self_adjoint_linear = True
    replica_invariant = True
    tp_splittable = True
    claims_budget = False

    def wire_shape(self, shape, ctx, dtype, role):
        return _check_shape(shape)

    def encode(self, t, ctx):
        return t.detach().contiguous()

    def decode(self, payload, ctx, shape):
        return payload.view(_check_shape(shape))

    def nbytes(self, shape, elem, first_of_step):
        s, b, d = _check_shape(shape)
        return s * b * d * elem


@register_half("mask")
class MaskHalf(DirectionCodec):
    """The exact-k PRF mask of :class:`MaskCodec` (same indices in both directions, so
    ``mask:mask`` is bit-identical to ``mask``): payload [s, b, k], k = ceil(keep_ratio * d),
    decoded as (d/k) * scatter; unbiased (E = identity) and self-adjoint.
    Bytes s * b * k * element_size."""

    self_adjoint_linear = True
    replica_invariant = True  # PRF indices keyed by the global sample id
    tp_splittable = True

    def __init__(self, keep_ratio: float = 0.05):
        self.mask = MaskCodec(keep_ratio=keep_ratio)
        self.keep_ratio = self.mask.keep_ratio

    def wire_shape(self, shape, ctx, dtype, role):
        return self.mask.payload_shape(shape)

    def encode(self, t, ctx):
        return self.mask.encode_forward(t, ctx)

    def decode(self, payload, ctx, shape):
        return self.mask.decode_forward(payload, ctx, shape)

    def nbytes(self, shape, elem, first_of_step):
        s, b, d = _check_shape(shape)
        return s * b * self.mask.k(d) * elem

    def precompute(self, ctx, shape, device="cpu") -> bool:
        """The PRF indices of ``ctx`` for dense ``shape`` (s, b, d), into the mask's plan
        (:meth:`MaskCodec.precompute`; ValueError on a bad shape or sample_ids). Returns True."""
        return self.mask.precompute(ctx, shape, device)

    @property
    def derivations(self) -> dict:
        """The mask's index derivation counters ({"precomputed": n, "on_demand": m})."""
        return self.mask.derivations

    def reset(self):
        self.mask.clear_cache()
