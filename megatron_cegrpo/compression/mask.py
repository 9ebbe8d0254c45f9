"""``mask``: the exact-k PRF mask, scaled by d/k, the project's boundary compression.

Source: DESIGN.md section 3; system status 2026-07-31 section 1.2 ("keep exactly k of d
coordinates per token, scale by d/k, mask derived at both ends from PRF(seed, layer, step,
sample, position, channel)"). ``--boundary-codec mask`` is this half in both directions (one
instance: the backward uses the forward's indices, the exact chain rule).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, Optional

import torch

from .codecs import BoundaryContext, _check_shape
from .halves import DirectionCodec, register_half
from .prf import exact_k_indices, keep_count

__all__ = ["MaskHalf"]


@register_half("mask")
class MaskHalf(DirectionCodec):
    """Exact-k PRF mask, scaled by d/k (exactly unbiased).

    k = keep_count(d, keep_ratio) = ceil(keep_ratio * d) (e.g. 77 of 1536, 29 of
    576 at the default 0.05). For each token (position p, sample i) the kept
    channels ``idx[p, i, :]`` (LongTensor[s, b, k], ascending) come from
    :func:`~megatron_cegrpo.compression.prf.exact_k_indices` with
    (ctx.seed, ctx.boundary, ctx.step, ctx.sample_ids); both ends derive them,
    no index, seed or mask is ever sent.

    Forward map: f(x) = (d/k) * m ⊙ x, m the 0/1 mask; E_m[f(x)] = x because
    each channel is kept with probability k/d.

    * encode(t):   payload = t.gather(-1, idx), [s, b, k], t's dtype, unscaled (activations
      forward, activation-gradients backward: the same indices in both directions).
    * decode(y):   (d/k) * zeros[s, b, d].scatter(-1, idx, y); backward this is the exact chain
      rule of f (the Jacobian is diagonal (d/k) * m): ``self_adjoint_linear``.

    Bytes on the wire per direction: s * b * k * element_size (ratio k/d).
    Scale d/k is the Python float ``d / k`` (not rounded to 20).

    Index tensors are derived once per (seed, boundary, step, sample ids, s, d, device)
    and kept in two stores: the *plan*, filled by :meth:`precompute` (off the critical
    path: ``pipeline/prefetch.py`` calls it on a background thread for every crossing of
    the iteration as soon as the batch is known) and holding the masks of one step (a
    precompute for a newer step drops the older step's plan); and an LRU of
    ``cache_size`` entries (an attribute, 64; not a spec parameter) for masks derived on demand
    (a crossing nobody announced).
    ``derivations`` counts both kinds ({"precomputed": n, "on_demand": m}): in a
    prefetched pipeline ``on_demand`` stays 0, i.e. no PRF work on the critical path.
    Plan memory: (crossings of one step at this rank) x s x b x k x 8 bytes.

    Raises:
        ValueError: keep_ratio outside (0, 1]; tensors not 3-D; sample_ids length
        differs from b; payload shape mismatch.
    """

    self_adjoint_linear = True
    replica_invariant = True  # indices keyed by the global sample id
    tp_splittable = True  # no state but the PRF indices of ctx
    precomputes = True
    alone = True

    def __init__(self, keep_ratio: float = 0.05):
        keep_count(1, keep_ratio)  # validates the ratio
        self.keep_ratio = float(keep_ratio)
        self.cache_size = 64
        self._cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self._plan: Dict[tuple, torch.Tensor] = {}
        self._plan_step: Optional[int] = None
        self._lock = threading.Lock()  # precompute runs on another thread
        self._derivations = {"precomputed": 0, "on_demand": 0}

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
            self._derivations["on_demand"] += 1
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
            self._derivations["precomputed"] += 1
        return True

    def clear_cache(self) -> None:
        """Drop the plan and the LRU (the derivation counters are kept)."""
        with self._lock:
            self._cache.clear()
            self._plan, self._plan_step = {}, None

    @property
    def derivations(self) -> dict:
        """The index derivation counters ({"precomputed": n, "on_demand": m})."""
        return self._derivations

    def reset(self) -> None:
        """Forget the per-step index plan and the LRU (:meth:`clear_cache`)."""
        self.clear_cache()

    def _dense_indices(self, t: torch.Tensor, ctx: BoundaryContext) -> torch.Tensor:
        if t.dim() != 3:
            raise ValueError(f"boundary tensor must be [s, b, d], got shape {tuple(t.shape)}")
        s, b, d = t.shape
        if ctx.sample_ids.numel() != b:
            raise ValueError(f"ctx.sample_ids has {ctx.sample_ids.numel()} entries but the micro-batch has b={b}")
        return self.indices(ctx, s, d, t.device)

    def _scatter(self, payload: torch.Tensor, ctx: BoundaryContext, shape) -> torch.Tensor:
        s, b, d = _check_shape(shape)
        expected = (s, b, self.k(d))
        if tuple(payload.shape) != expected:
            raise ValueError(f"payload shape {tuple(payload.shape)} != expected {expected} for dense shape {(s, b, d)}")
        if ctx.sample_ids.numel() != b:
            raise ValueError(f"ctx.sample_ids has {ctx.sample_ids.numel()} entries but the micro-batch has b={b}")
        idx = self.indices(ctx, s, d, payload.device)
        # scale the k kept values, then scatter into zeros: the same bits as scaling the dense
        # tensor (0 * (d/k) = 0), with k instead of d multiplications and no second [s, b, d]
        return torch.zeros((s, b, d), dtype=payload.dtype, device=payload.device).scatter_(
            -1, idx, payload * self.scale(d))

    def own_backward(self) -> "DirectionCodec":
        """This instance: the backward uses the forward's indices (the exact chain rule), from one
        index cache."""
        return self

    # -- the half's API -----------------------------------------------------------
    def wire_shape(self, shape, ctx, dtype, role):
        s, b, d = _check_shape(shape)
        return (s, b, self.k(d))

    def nbytes(self, shape, elem, first_of_step):
        s, b, d = _check_shape(shape)
        return s * b * self.k(d) * elem

    def encode(self, t, ctx):
        idx = self._dense_indices(t, ctx)
        return t.detach().gather(-1, idx)

    def decode(self, payload, ctx, shape):
        return self._scatter(payload, ctx, shape)
