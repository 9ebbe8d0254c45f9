"""Optimizer pre-step hooks: the sign-guided correction slot, then gradient clipping.

Order inside ``optimizer.step()`` (DESIGN.md section 2 step 7 and section 4):
gradients are complete (tied-embedding and DP all-reduce done by the trainer),
then ``SignCorrectionHook`` (G = alpha G_comp + beta |G_comp| * sign(M); the
identity while no sign has arrived), then ``GradClipHook`` (global L2 norm over
every pipeline stage). Hooks run in registration order.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_cegrpo.compat.placement import compute_device, like

__all__ = ["SignCorrectionHook", "GradClipHook"]


class SignCorrectionHook:
    """G <- alpha * G + beta * |G| * sign(M), per parameter, in place.

    Source: status 2026-07-31 section 1.3 (alpha 0.25, beta 0.75); the
    2026-07-04 report's signed_ema uses 0.25 / 0.50. ``sign(M)`` maps 0 to +1
    (DESIGN.md section 4). Cold-M guard: while ``signs`` is None (no sign has
    arrived) gradients pass unchanged. Zero-M guard (``anchor/memory.py``): a
    tensor whose sign entry is None (the anchor's M is 0 on the whole tensor, so
    its signs carry no direction) keeps its gradient unchanged, bit for bit; a
    list of only None entries is stored as None (no correction at all,
    ``anchor/correction_applied`` 0). The anchor circuit (a separate component)
    feeds ``set_signs``.

    ``last_agreement`` (``anchor/sign_agreement``): the fraction of corrected,
    counted coordinates with ``g != 0`` where ``sign(g) == sign(M)``; a zero
    gradient has no sign to agree with, so those coordinates are left out (a
    step whose gradient is exactly 0 reports no agreement instead of 1.0).

    Ablation (issue 11, ``magnitude="mean"``): ``|G|`` is replaced by one constant per
    parameter tensor, ``mean(|G|)`` over its coordinates, so the fast gradient no longer
    sets per-coordinate magnitudes in the beta term; with alpha 0, beta 1 every corrected
    coordinate is ``mean(|G|) * sign(M)``.

    Args:
        params: the stage's parameters, in the order the signs are given.
        alpha, beta: blend weights.
        magnitude: ``"grad"`` (``|G|``, the seeds' blend) or ``"mean"`` (the ablation).
        counted: the parameters counted in ``last_agreement`` (default: all); a tied weight
            held by two stages is counted on one of them, so the pooled agreement counts
            each model parameter once.
    Raises:
        ValueError: an unknown ``magnitude``.
    """

    MAGNITUDES = ("grad", "mean")

    def __init__(self, params: List[torch.nn.Parameter], alpha: float = 0.25, beta: float = 0.75,
                 magnitude: str = "grad", counted: Optional[List[torch.nn.Parameter]] = None):
        if magnitude not in self.MAGNITUDES:
            raise ValueError(f"magnitude must be one of {self.MAGNITUDES}, got {magnitude!r}")
        self.params = list(params)
        self._counted = {id(p) for p in (self.params if counted is None else counted)}
        self.alpha, self.beta = float(alpha), float(beta)
        self.magnitude = magnitude
        self.signs: Optional[List[torch.Tensor]] = None
        self.num_applied = 0
        self.last_agreement = (0, 0)  # (coordinates g != 0 where sign(G_comp) == sign(M), coordinates g != 0)
        self.dump_path: Optional[str] = None  # --anchor-debug-dir: save G_comp, signs and G here

    def set_signs(self, signs: Optional[List[Optional[torch.Tensor]]]) -> None:
        """signs: one entry per parameter: a tensor of the parameter's shape with values in
        {-1, +1}, or None (no correction for that parameter); or None to clear. A list of only
        None entries clears.

        Raises:
            ValueError: wrong number of entries or a shape that differs from its parameter's.
        """
        if signs is not None:
            if len(signs) != len(self.params):
                raise ValueError(f"got {len(signs)} sign tensors for {len(self.params)} parameters")
            for s, p in zip(signs, self.params):
                if s is not None and s.shape != p.shape:
                    raise ValueError(f"sign shape {tuple(s.shape)} != parameter shape {tuple(p.shape)}")
            if all(s is None for s in signs):
                signs = None
            else:  # on each parameter's device, in its own dtype (compat/placement.py, rule 3)
                signs = [None if s is None else like(s, p, dtype=s.dtype) for s, p in zip(signs, self.params)]
        self.signs = signs

    @torch.no_grad()
    def __call__(self, optimizer, args, kwargs) -> None:
        if self.signs is None:
            return None
        before = [p.grad.detach().clone() if p.grad is not None else None for p in self.params] \
            if self.dump_path else None
        agree = total = 0
        for p, s in zip(self.params, self.signs):
            if p.grad is None or s is None:
                continue
            g = p.grad
            if id(p) in self._counted:
                nonzero = g != 0
                agree += int(((g > 0) == (s > 0)).logical_and_(nonzero).sum())
                total += int(nonzero.sum())
            mag = g.abs() if self.magnitude == "grad" else g.abs().mean()
            g.copy_(self.alpha * g + self.beta * mag * s.to(g.dtype))
        self.last_agreement = (agree, total)
        self.num_applied += 1
        if self.dump_path:
            torch.save({"g_comp": before, "signs": [s.clone() if s is not None else None for s in self.signs],
                        "g": [p.grad.detach().clone() if p.grad is not None else None for p in self.params]},
                       self.dump_path)
        return None


class GradClipHook:
    """Clip by the global L2 norm over all pipeline stages (Megatron's clip_grad_norm_fp32).

    Args:
        params: parameters whose gradients are clipped.
        norm_params: the subset counted in the norm (a tied output weight that
            duplicates the first stage's embedding is excluded so it counts once).
        max_norm: --clip-grad; 0 disables clipping (the norm is still measured).
        group: the process group spanning the pipeline stages (None: local only).
        external_terms: ``fn() -> {id(p): ||g_p||^2}`` (fp64 0-dim tensors), called first in
            every step: terms of ``norm_params`` whose gradient another rank holds (the first
            stage's tied embedding under ``--tied-embedding-sync sparse``,
            ``pipeline/tied_embedding.py``), added at that parameter's place in the sum.
    Attributes:
        last_grad_norm: the pre-clip global norm of the last step (``actor/grad_norm``).
        num_skipped: steps skipped because the global norm was NaN or inf (``actor/skipped_steps``).

    A non-finite global norm (a NaN or inf anywhere in any stage's gradient; the all-reduce
    makes every stage see the same value) skips the step: every gradient is set to None, so
    the optimizer leaves the weights and its moments untouched (torch's and DeepSpeed's Adam
    skip parameters without a gradient), as Megatron skips an iteration whose gradients
    overflowed. ``max_norm > norm`` is False for NaN, so without this a NaN would reach the weights.
    """

    def __init__(self, params, norm_params, max_norm: float, group=None,
                 external_terms: Optional[Callable[[], Dict[int, torch.Tensor]]] = None):
        self.params = list(params)
        self.external_terms = external_terms
        self.norm_params = list(norm_params)
        self.max_norm = float(max_norm)
        self.group = group
        self.last_grad_norm: float = float("nan")
        self.num_skipped = 0

    @torch.no_grad()
    def __call__(self, optimizer, args, kwargs) -> None:
        sq = torch.zeros((), dtype=torch.float64, device=compute_device())  # summed where the gradients are
        external = self.external_terms() if self.external_terms is not None else {}
        for p in self.norm_params:
            if id(p) in external:
                sq += like(external[id(p)], sq)
            elif p.grad is not None:
                sq += p.grad.detach().double().square().sum()
        sq = sq.cpu()  # one device sync; the scalar all-reduce is control plane (gloo: placement.py)
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(sq, group=self.group)
        norm = float(sq.sqrt())
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            for p in self.params:
                p.grad = None
            self.num_skipped += 1
            return None
        if self.max_norm > 0 and norm > self.max_norm:
            coef = self.max_norm / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return None
