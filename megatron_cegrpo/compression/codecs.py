"""Boundary codecs: what crosses a pipeline-stage boundary, in both directions.

Source: DESIGN.md section 3; system status 2026-07-31 section 1.2 ("keep exactly
k of d coordinates per token, scale by d/k, mask derived at both ends from
PRF(seed, layer, step, sample, position, channel)").

A codec maps the dense boundary tensor ``[s, b, d]`` to a wire payload and back:

* forward:  sender ``encode_forward(x)`` -> wire -> receiver ``decode_forward``
* backward: receiver ``encode_backward(dL/d x_hat)`` -> wire -> sender
  ``decode_backward`` = dL/dx, the exact chain rule of ``forward_map``.

The payload shape is the same in both directions (``payload_shape``), so the
p2p layer can pre-allocate receive buffers. Pure tensor code: no
torch.distributed.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Type

import torch

from .prf import exact_k_indices, keep_count

__all__ = [
    "BoundaryContext",
    "BoundaryCodec",
    "DenseCodec",
    "MaskCodec",
    "register_codec",
    "get_codec",
    "available_codecs",
    "has_precompute",
]


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


_REGISTRY: Dict[str, Type["BoundaryCodec"]] = {}


def register_codec(name: str) -> Callable[[Type["BoundaryCodec"]], Type["BoundaryCodec"]]:
    """Class decorator registering a :class:`BoundaryCodec` subclass under ``name``.

    Raises:
        ValueError: if ``name`` is already registered to a different class.
    """

    def deco(cls: Type["BoundaryCodec"]) -> Type["BoundaryCodec"]:
        if not (isinstance(cls, type) and issubclass(cls, BoundaryCodec)):
            raise ValueError(f"register_codec({name!r}) expects a BoundaryCodec subclass, got {cls!r}")
        return register_into(_REGISTRY, "codec name", name, cls)

    return deco


def register_into(registry: Dict[str, type], what: str, name: str, cls: type) -> type:
    """Put ``cls`` into ``registry`` under ``name`` and set ``cls.name`` (the codec and
    half-codec registries share this).

    Raises:
        ValueError: ``name`` already registered to another class (message starts with ``what``).
    """
    existing = registry.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"{what} {name!r} already registered to {existing.__name__}")
    registry[name] = cls
    cls.name = name
    return cls


def available_codecs() -> List[str]:
    """Sorted names of the registered codecs."""
    return sorted(_REGISTRY)


def get_codec(name: str, **kwargs) -> "BoundaryCodec":
    """Instantiate the codec registered as ``name`` with ``kwargs``.

    Raises:
        ValueError: unknown name; the message lists the valid names.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown boundary codec {name!r}; valid names: {', '.join(available_codecs())}")
    return cls(**kwargs)


def has_precompute(codec: "BoundaryCodec") -> bool:
    """Whether ``codec`` overrides :meth:`BoundaryCodec.precompute` (has work to do ahead of a
    crossing) and does not say otherwise (``codec.precomputes`` False: a ``PairCodec`` of
    halves without precompute, e.g. ``pcaq:lrq``)."""
    return type(codec).precompute is not BoundaryCodec.precompute and bool(getattr(codec, "precomputes", True))


def _check_shape(shape) -> Tuple[int, int, int]:
    shape = tuple(int(v) for v in shape)
    if len(shape) != 3:
        raise ValueError(f"boundary tensor shape must be [s, b, d], got {shape}")
    return shape  # type: ignore[return-value]


class BoundaryCodec(abc.ABC):
    """Abstract boundary codec. Subclasses implement all abstract methods.

    ``shape`` is always the dense boundary shape ``(s, b, d)``.
    """

    name: str = "abstract"
    #: every payload depends only on its micro-batch's data and keys (seed, boundary, step,
    #: sample ids, positions), not on other micro-batches' traffic: data-parallel replicas that
    #: split a mini-batch into whole micro-batches then send what one replica would (issue 14;
    #: ``plan.check_codec_layout``). False for a basis kept per step or per run.
    replica_invariant = False
    #: the TP ranks of a stage can split this codec's traffic (issue 14, docs/parallelism.md): with
    #: sequence parallelism off they hold bit-identical boundary tensors, and every payload, every
    #: ``basis_to_send`` tensor and all codec state is a deterministic function of those tensors, the
    #: context and what arrived over the boundary (decoded whole on every TP rank), with no side
    #: channel that reaches one TP rank only (an anchor-owned basis does). Each TP rank then encodes
    #: the same bits and sends 1/T of each payload and basis (``pipeline/communicator.py``);
    #: ``plan.check_codec_layout`` refuses the codecs where this is False.
    tp_splittable = False
    #: the codec claims the ``--boundary-keep-ratio`` budget: its constructor takes ``keep_ratio`` and
    #: the start-up byte-budget check applies (``spec.check_codec_budget``). False: ``dense``, the
    #: uncompressed control
    claims_budget = True
    #: the run-level options (``TrainConfig.boundary_codec_options``: ``q_owner``, ``anchor_interval``,
    #: ``tokens_per_iteration``) its constructor takes; ``build_codec`` passes only these
    RUN_OPTIONS: Tuple[str, ...] = ()

    def summary(self, d: int) -> str:
        """What the start-up line adds after the codec's name at width ``d`` (e.g. mask: ``" (k=29 of
        d)"``); "" when there is nothing to add."""
        return ""

    def check_width(self, d: int) -> None:
        """Raise ValueError (naming the flag) when the budget cannot code width ``d`` at all; the
        default codes any width."""

    @abc.abstractmethod
    def payload_shape(self, shape: Tuple[int, int, int]) -> Tuple[int, ...]:
        """Shape of the wire payload for a dense tensor of ``shape`` (both directions)."""

    @abc.abstractmethod
    def encode_forward(self, x: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Sending stage, forward: activations [s, b, d] -> contiguous payload (no grad)."""

    @abc.abstractmethod
    def decode_forward(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Receiving stage, forward: payload -> dense [s, b, d] input of the next stage."""

    def decode_sent_forward(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Sending stage, forward: what the receiver decodes from ``payload`` (just encoded
        here), computed without touching receive-side state (``codec/error_persistence``)."""
        return self.decode_forward(payload, ctx, shape)

    @abc.abstractmethod
    def encode_backward(self, grad: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Receiving stage, backward: dL/d(decoded input) [s, b, d] -> payload."""

    @abc.abstractmethod
    def decode_backward(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        """Sending stage, backward: payload -> dL/d(its output x) [s, b, d]."""

    @abc.abstractmethod
    def forward_map(self, x: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        """Differentiable single-process reference of decode_forward(encode_forward(x))."""

    def precompute(self, ctx: BoundaryContext, shape: Tuple[int, int, int], device="cpu") -> bool:
        """Derive, ahead of the crossing, whatever ``ctx`` alone determines (issue 10 item 6).

        Called off the critical path (``pipeline/prefetch.py``: a background thread started
        when the iteration's batch is known) with the context and dense shape ``(s, b, d)``
        of a crossing that will come; the encode/decode calls of that crossing then find the
        work done. Must be thread-safe against concurrent encode/decode calls and give the
        same bits as deriving on demand. The default does nothing and returns False (codecs
        with no per-context state, e.g. ``dense``).

        Returns:
            True if something was derived (or was already held) for later reuse.
        """
        return False
    # -- basis traffic (codecs whose two ends share a basis the sender refreshes; lowrank) --
    def basis_to_send(self, ctx: BoundaryContext) -> Optional[torch.Tensor]:
        """Sender, after ``encode_forward``: a tensor to ship to the receiver before this payload
        (metered as basis bytes), or None (the default: nothing)."""
        return None

    def basis_to_receive(self, ctx: BoundaryContext, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Receiver, before ``decode_forward``: an empty buffer for the tensor the sender ships
        with this payload, or None (the default: nothing)."""
        return None

    def accept_basis(self, ctx: BoundaryContext, basis: torch.Tensor) -> None:
        """Receiver: the tensor announced by :meth:`basis_to_receive` has arrived."""

    def state_dict(self) -> dict:
        """Checkpointable codec state (empty for stateless codecs)."""
        return {}

    def wire_shape(self, direction: str, shape, ctx: BoundaryContext, dtype: torch.dtype, role: str):
        """Payload shape of the next ``direction`` ("fwd"/"bwd") message of this boundary as
        ``role`` ("send"/"recv") sees it; codecs whose payload varies per direction or per
        message (``PairCodec``) override it. Default: :meth:`payload_shape`."""
        return self.payload_shape(shape)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Stateless codecs accept only ``{}``."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless; unexpected state keys {sorted(state)}")


@register_codec("dense")
class DenseCodec(BoundaryCodec):
    """Identity codec (the byte-matched control).

    Payload: the tensor itself, contiguous, shape [s, b, d], dtype unchanged;
    bytes on the wire per direction = s * b * d * element_size.
    """

    claims_budget = False  # the control: keeps everything

    replica_invariant = True
    tp_splittable = True

    def payload_shape(self, shape):
        return _check_shape(shape)

    def encode_forward(self, x, ctx):
        return x.detach().contiguous()

    def decode_forward(self, payload, ctx, shape):
        return payload.view(_check_shape(shape))

    def encode_backward(self, grad, ctx):
        return grad.detach().contiguous()

    def decode_backward(self, payload, ctx, shape):
        return payload.view(_check_shape(shape))

    def forward_map(self, x, ctx):
        return x


@register_codec("mask")
class MaskCodec(BoundaryCodec):
    """Exact-k PRF mask, scaled by d/k (exactly unbiased).

    k = keep_count(d, keep_ratio) = ceil(keep_ratio * d) (e.g. 77 of 1536, 29 of
    576 at the default 0.05). For each token (position p, sample i) the kept
    channels ``idx[p, i, :]`` (LongTensor[s, b, k], ascending) come from
    :func:`~megatron_cegrpo.compression.prf.exact_k_indices` with
    (ctx.seed, ctx.boundary, ctx.step, ctx.sample_ids); both ends derive them,
    no index, seed or mask is ever sent.

    Forward map: f(x) = (d/k) * m ⊙ x, m the 0/1 mask; E_m[f(x)] = x because
    each channel is kept with probability k/d.

    * encode_forward(x):   payload = x.gather(-1, idx), [s, b, k], x's dtype, unscaled.
    * decode_forward(y):   (d/k) * zeros[s, b, d].scatter(-1, idx, y).
    * encode_backward(g):  payload = g.gather(-1, idx), [s, b, k], raw.
    * decode_backward(y):  (d/k) * zeros[s, b, d].scatter(-1, idx, y)
      = the exact chain rule of f (the Jacobian is diagonal (d/k) * m).

    Bytes on the wire per direction: s * b * k * element_size (ratio k/d).
    Scale d/k is the Python float ``d / k`` (not rounded to 20).

    Index tensors are derived once per (seed, boundary, step, sample ids, s, d, device)
    and kept in two stores: the *plan*, filled by :meth:`precompute` (off the critical
    path: ``pipeline/prefetch.py`` calls it on a background thread for every crossing of
    the iteration as soon as the batch is known) and holding the masks of one step (a
    precompute for a newer step drops the older step's plan); and an LRU of
    ``cache_size`` entries for masks derived on demand (a crossing nobody announced).
    ``derivations`` counts both kinds ({"precomputed": n, "on_demand": m}): in a
    prefetched pipeline ``on_demand`` stays 0, i.e. no PRF work on the critical path.
    Plan memory: (crossings of one step at this rank) x s x b x k x 8 bytes.

    Raises:
        ValueError: keep_ratio outside (0, 1]; tensors not 3-D; sample_ids length
        differs from b; payload shape mismatch.
    """

    replica_invariant = True  # indices keyed by the global sample id
    tp_splittable = True  # no state but the PRF indices of ctx

    def __init__(self, keep_ratio: float = 0.05, cache_size: int = 64):
        keep_count(1, keep_ratio)  # validates the ratio
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size must be a non-negative int, got {cache_size!r}")
        self.keep_ratio = float(keep_ratio)
        self.cache_size = cache_size
        self._cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self._plan: Dict[tuple, torch.Tensor] = {}
        self._plan_step: Optional[int] = None
        self._lock = threading.Lock()  # precompute runs on another thread
        self.derivations = {"precomputed": 0, "on_demand": 0}

    # -- helpers -----------------------------------------------------------
    def summary(self, d: int) -> str:
        return f" (k={self.k(d)} of d)"

    def k(self, d: int) -> int:
        """Number of kept channels for hidden size d."""
        return keep_count(int(d), self.keep_ratio)

    def scale(self, d: int) -> float:
        """d / k as a Python float."""
        return int(d) / self.k(d)

    @staticmethod
    def _key(ctx: BoundaryContext, s: int, d: int, device: torch.device) -> tuple:
        sample_ids = ctx.sample_ids
        if not isinstance(sample_ids, torch.Tensor) or sample_ids.dim() != 1:
            raise ValueError("ctx.sample_ids must be a 1-D LongTensor")
        return (ctx.seed, ctx.boundary, ctx.step, tuple(sample_ids.tolist()), int(s), int(d), str(device))

    def _derive(self, ctx: BoundaryContext, s: int, d: int, device: torch.device) -> torch.Tensor:
        return exact_k_indices(ctx.seed, ctx.boundary, ctx.step, ctx.sample_ids.to(device), int(s), int(d),
                               self.k(d), device=device)

    def indices(self, ctx: BoundaryContext, s: int, d: int, device) -> torch.Tensor:
        """Kept-channel indices LongTensor[s, b, k] on ``device``: from the plan, the LRU, or
        derived now (counted in ``derivations["on_demand"]``)."""
        device = torch.device(device)
        key = self._key(ctx, s, d, device)
        with self._lock:
            idx = self._plan.get(key)
            if idx is None:
                idx = self._cache.get(key)
                if idx is not None:
                    self._cache.move_to_end(key)
        if idx is not None:
            return idx
        idx = self._derive(ctx, s, d, device)
        with self._lock:
            self.derivations["on_demand"] += 1
            if self.cache_size > 0:
                self._cache[key] = idx
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return idx

    def precompute(self, ctx: BoundaryContext, shape, device="cpu") -> bool:
        """Derive the indices of ``ctx`` for a dense ``shape`` (s, b, d) into the plan (see
        the class docstring). Thread-safe; the same bits as :meth:`indices` on demand.

        Raises:
            ValueError: shape not 3-D or ctx.sample_ids length differs from b.
        """
        s, b, d = _check_shape(shape)
        if ctx.sample_ids.numel() != b:
            raise ValueError(f"ctx.sample_ids has {ctx.sample_ids.numel()} entries but the micro-batch has b={b}")
        device = torch.device(device)
        key = self._key(ctx, s, d, device)
        with self._lock:
            if self._plan_step == ctx.step and key in self._plan:
                return True
        idx = self._derive(ctx, s, d, device)
        with self._lock:
            if self._plan_step != ctx.step:
                self._plan, self._plan_step = {}, ctx.step
            self._plan[key] = idx
            self.derivations["precomputed"] += 1
        return True

    def clear_cache(self) -> None:
        """Drop the plan and the LRU (the derivation counters are kept)."""
        with self._lock:
            self._cache.clear()
            self._plan, self._plan_step = {}, None

    def _dense_indices(self, t: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        if t.dim() != 3:
            raise ValueError(f"boundary tensor must be [s, b, d], got shape {tuple(t.shape)}")
        s, b, d = t.shape
        if ctx.sample_ids.numel() != b:
            raise ValueError(f"ctx.sample_ids has {ctx.sample_ids.numel()} entries but the micro-batch has b={b}")
        return self.indices(ctx, s, d, t.device)

    def _scatter(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        s, b, d = _check_shape(shape)
        expected = self.payload_shape((s, b, d))
        if tuple(payload.shape) != expected:
            raise ValueError(f"payload shape {tuple(payload.shape)} != expected {expected} for dense shape {(s, b, d)}")
        if ctx.sample_ids.numel() != b:
            raise ValueError(f"ctx.sample_ids has {ctx.sample_ids.numel()} entries but the micro-batch has b={b}")
        idx = self.indices(ctx, s, d, payload.device)
        # scale the k kept values, then scatter into zeros: the same bits as scaling the dense
        # tensor (0 * (d/k) = 0), with k instead of d multiplications and no second [s, b, d]
        return torch.zeros((s, b, d), dtype=payload.dtype, device=payload.device).scatter_(
            -1, idx, payload * self.scale(d))

    # -- codec API -----------------------------------------------------------
    def payload_shape(self, shape):
        s, b, d = _check_shape(shape)
        return (s, b, self.k(d))

    def encode_forward(self, x, ctx):
        idx = self._dense_indices(x, ctx)
        return x.detach().gather(-1, idx)

    def decode_forward(self, payload, ctx, shape):
        return self._scatter(payload, ctx, shape)

    def encode_backward(self, grad, ctx):
        idx = self._dense_indices(grad, ctx)
        return grad.detach().gather(-1, idx)

    def decode_backward(self, payload, ctx, shape):
        return self._scatter(payload, ctx, shape)

    def forward_map(self, x, ctx):
        idx = self._dense_indices(x, ctx)
        s, b, d = x.shape
        dense = torch.zeros((s, b, d), dtype=x.dtype, device=x.device).scatter(-1, idx, x.gather(-1, idx))
        return dense * self.scale(d)
