"""One direction of a stage boundary, and the one registry of codecs.

A :class:`DirectionCodec` turns a dense boundary tensor ``[s, b, d]`` into a wire payload on
the sending stage and back on the receiving one, for ONE direction (activations forward or
activation-gradients backward). :class:`~megatron_cegrpo.compression.codecs.BoundaryCodec` joins
two of them (issue 10 item 4: independent forward and backward codecs; issue 34: every codec,
``dense`` and ``mask`` included, is such a pair). ``--boundary-codec NAME`` is NAME in both
directions (:meth:`DirectionCodec.own_backward`), ``FWD:BWD`` two halves (``spec.py``).

Registered: ``dense`` (identity, here), ``mask`` (the exact-k PRF mask, ``mask.py``),
``lowrank`` (``lowrank.py``; its two directions share one basis: ``coupled``), ``pcaq`` and
``lrq`` (``subspace.py``), ``rpq`` (``repeat.py``). Payloads are in the dense tensor's dtype
(the pipeline dtype megatron-core's p2p buffers use); halves whose payload is a byte string
view it as that dtype (``wire.py``).

Sender and receiver state are kept apart (a stage can be both, for different boundaries, and
the single-process reference :meth:`DirectionCodec.roundtrip` plays both).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional, Tuple, Type

import torch

from .codecs import BoundaryContext, _check_shape, register_into

__all__ = ["DirectionCodec", "DenseHalf", "register_half", "get_half", "available_halves"]

_HALVES: Dict[str, Type["DirectionCodec"]] = {}


def register_half(name: str) -> Callable[[Type["DirectionCodec"]], Type["DirectionCodec"]]:
    """Class decorator registering a :class:`DirectionCodec` under ``name`` (a spec half).

    Raises:
        ValueError: ``cls`` is not a DirectionCodec, or ``name`` already registered to another class.
    """

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, DirectionCodec)):
            raise ValueError(f"register_half({name!r}) expects a DirectionCodec subclass, got {cls!r}")
        return register_into(_HALVES, "codec", name, cls)

    return deco


def available_halves() -> List[str]:
    """Sorted names of the registered codecs (each usable alone or on either side of ``FWD:BWD``,
    but for ``coupled`` ones, which only go alone)."""
    return sorted(_HALVES)


def half_class(name: str) -> Type["DirectionCodec"]:
    """The class registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid names.
    """
    cls = _HALVES.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; valid names: {', '.join(available_halves())}")
    return cls


def half_params(name: str, params: Dict[str, str]) -> Dict[str, object]:
    """A spec half's ``key=value`` params converted to the types its class declares (``PARAMS``).

    Raises:
        ValueError: unknown name, unknown parameter or a value that is not a number.
    """
    cls = half_class(name)
    kwargs: Dict[str, object] = {}
    for key, raw in params.items():
        kind = cls.PARAMS.get(key)
        if kind is None:
            raise ValueError(f"{name} takes no parameter {key!r} (its parameters: {', '.join(cls.PARAMS) or 'none'})")
        try:
            kwargs[key] = kind(raw)
        except ValueError:
            raise ValueError(f"{name}/{key}={raw!r} is not a number") from None
    return kwargs


def get_half(name: str, keep_ratio: float, params: Dict[str, str], options: Optional[Dict] = None) -> "DirectionCodec":
    """Instantiate half ``name`` with the run's keep ratio (when it ``claims_budget``), the spec's
    ``key=value`` params (:func:`half_params`) and those of the run-level ``options``
    (``TrainConfig.boundary_codec_options``) it declares in ``RUN_OPTIONS``.

    Raises:
        ValueError: unknown name, unknown parameter or a value of the wrong type/range.
    """
    cls = half_class(name)
    kwargs = half_params(name, params)
    kwargs.update({k: v for k, v in (options or {}).items() if k in cls.RUN_OPTIONS})
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
    #: the run-level options (``TrainConfig.boundary_codec_options``: ``q_owner``, ``anchor_interval``,
    #: ``tokens_per_iteration``) its constructor takes; ``get_half`` passes only these
    RUN_OPTIONS: Tuple[str, ...] = ()
    #: the two directions are one map seen from both ends and share state (``lowrank``'s basis):
    #: the half only goes alone (``--boundary-codec lowrank``), its backward from :meth:`own_backward`
    coupled = False
    #: :meth:`precompute` has context-only work to do ahead of a crossing (``mask``'s PRF indices)
    precomputes = False

    #: the half is a whole codec named alone (``--boundary-codec NAME``: ``dense``, ``mask``,
    #: ``lowrank``), its backward :meth:`own_backward`; the others only go in a ``FWD:BWD`` pair
    alone = False

    def own_backward(self) -> Optional["DirectionCodec"]:
        """The backward half when this half is named alone (``alone``): this very instance for
        ``dense`` and ``mask`` (one index cache serves both directions), a view sharing the basis for
        ``lowrank``; None for the halves that only go in a pair."""
        return None

    def forward_roundtrip(self, t: torch.Tensor, ctx: BoundaryContext):
        """``(roundtrip(t), held)``: the single-process forward map and what its backward needs from
        this very call (None but for a coupled half: ``lowrank``'s basis of that step)."""
        return self.roundtrip(t, ctx), None

    def backward_roundtrip(self, g: torch.Tensor, ctx: BoundaryContext, held) -> torch.Tensor:
        """The single-process backward map of a gradient ``g`` (``roundtrip``), given what the forward
        held (:meth:`forward_roundtrip`; ignored here)."""
        return self.roundtrip(g, ctx)

    def summary(self, d: int) -> str:
        """What the start-up line adds after the codec's name at width ``d`` ("" by default)."""
        return ""

    def check_width(self, d: int) -> None:
        """Raise ValueError (naming the flag) when the budget cannot code width ``d``; the default
        codes any width."""

    @property
    def derivations(self) -> dict:
        """Context-derivation counters ({"precomputed": n, "on_demand": m}; ``mask``); {} here."""
        return {}

    # -- basis traffic: a forward half whose two ends share a basis the sender refreshes ----
    def basis_to_send(self, ctx: BoundaryContext) -> Optional[torch.Tensor]:
        """Sender, after ``encode``: a tensor to ship to the receiver before this payload
        (metered as basis bytes), or None (the default)."""
        return None

    def basis_to_receive(self, ctx: BoundaryContext, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Receiver, before ``decode``: an empty buffer for the tensor the sender ships with this
        payload, or None (the default)."""
        return None

    def accept_basis(self, ctx: BoundaryContext, basis: torch.Tensor) -> None:
        """Receiver: the tensor announced by :meth:`basis_to_receive` has arrived."""

    def stage_basis(self, boundary: int, q: torch.Tensor, first_step: int) -> None:
        """A basis sent by the anchor. Raises ValueError: this half takes none (only an
        anchor-owned ``lowrank`` does)."""
        raise ValueError(f"the {self.name} codec takes no anchor-sent basis (only --boundary-codec lowrank "
                         f"with --lowrank-q-owner anchor does)")

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
        alone determine (called by :meth:`BoundaryCodec.precompute`
        off the critical path). Default: nothing, returns False (halves whose work depends on
        the data, e.g. ``pcaq``, ``lrq``, ``rpq``). Must be thread-safe and give the same bits
        as deriving on demand; a half that overrides it sets ``precomputes``."""
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
        """State that outlives a step, for checkpoints (``BoundaryCodec.state_dict``); default ``{}``."""
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
    alone = True

    def own_backward(self) -> "DirectionCodec":
        """This instance (the identity is its own adjoint)."""
        return self

    def wire_shape(self, shape, ctx, dtype, role):
        return _check_shape(shape)

    def encode(self, t, ctx):
        return t.detach().contiguous()

    def decode(self, payload, ctx, shape):
        return payload.view(_check_shape(shape))

    def nbytes(self, shape, elem, first_of_step):
        s, b, d = _check_shape(shape)
        return s * b * d * elem
