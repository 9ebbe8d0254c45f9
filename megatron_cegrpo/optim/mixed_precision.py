"""Mixed precision (``--bf16``): bf16 compute weights over fp32 master weights, in place.

Megatron's ``--bf16`` keeps fp32 master weights and Adam moments beside bf16 model weights
(megatron-core ``Float16OptimizerWithFloat16Params``; DeepSpeed's ``BF16_Optimizer`` does the
same). Neither runs here without their engines and CUDA-only kernels, and the trainer steps
``p.grad`` of its own parameter list directly (the sign blend, clipping, the tied-embedding
sum and the DP all-reduce all read and write it; ``training/stage.py``). So the parameters
stay what every one of those consumers already handles: fp32 tensors holding the master
weights, with fp32 gradients. Only while a pass runs (:func:`compute_precision`, entered by
``pipeline/schedule.py`` and the anchor's replay) does each parameter's storage become a
bf16 copy, rounded to nearest even from its master (FSDP's mixed precision swaps ``p.data``
the same way):

* forward and backward run in bf16 (AMX on Sapphire Rapids; tensor cores on GPUs), the
  activations crossing a stage boundary are bf16 (``TransformerConfig.pipeline_dtype``);
* each bf16 gradient, as soon as autograd has accumulated it (a post-accumulate-grad hook),
  is added into an fp32 buffer and dropped, so micro-batch gradients are summed in fp32
  (Megatron's ``accumulate_allreduce_grads_in_fp32``);
* on exit every parameter holds its fp32 master again and ``p.grad`` the fp32 sum (plus
  whatever fp32 gradient it held on entry).

Why bf16 and not fp16: no loss scaling (bf16 has fp32's exponent range). Why not bf16
parameters stepped in place (``--params-dtype bf16``): bf16 keeps 8 significand bits, so an
Adam step of 1e-5 relative to a weight (lr 1e-5) rounds to no change at all.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch

__all__ = ["MixedPrecision", "attach_mixed_precision", "compute_precision", "mixed_precision_of"]

_ATTR = "_cegrpo_mixed_precision"


class MixedPrecision:
    """The bf16 compute view of one module's fp32 parameters.

    Args:
        module: a module whose parameters are fp32 (the masters). Shared parameters (a tied
            embedding at PP = 1) are handled once.
        compute_dtype: the dtype of the weights while a pass runs (``torch.bfloat16``).
    Raises:
        ValueError: a parameter that is not fp32, or a compute dtype that is not a float type.
    """

    def __init__(self, module: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16):
        if not compute_dtype.is_floating_point:
            raise ValueError(f"compute dtype must be a float type, got {compute_dtype}")
        self.compute_dtype = compute_dtype
        self.params: List[torch.nn.Parameter] = list(dict.fromkeys(module.parameters()))  # unique, in order
        bad = [p.dtype for p in self.params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"mixed precision needs fp32 master parameters; found {bad[0]}: build the model in fp32")
        self.active = False
        self._acc: Dict[torch.nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: move the bf16 gradient into the fp32 buffer."""
        if not self.active or p.grad is None:
            return
        g, p.grad = p.grad, None
        acc = self._acc.get(p)
        if acc is None:
            self._acc[p] = g.to(torch.float32)
        else:
            acc.add_(g)  # fp32 += bf16, computed in fp32

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Run the body with bf16 weights and fp32 gradient accumulation (re-entrant: a nested
        call does nothing). Each parameter's bf16 copy is cast from its master on entry, so the
        body always sees the current masters rounded to bf16."""
        if self.active:
            yield
            return
        masters = []
        for p in self.params:
            masters.append(p.data)
            if p.grad is not None:  # an fp32 gradient from before: the pass adds to it
                self._acc[p], p.grad = p.grad, None
            p.data = p.data.to(self.compute_dtype)
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for p, m in zip(self.params, masters):
                if p.grad is not None:  # a bf16 gradient the hook did not see (set by hand in the body)
                    g, p.grad = p.grad, None
                    acc = self._acc.get(p)
                    self._acc[p] = g.to(torch.float32) if acc is None else acc.add_(g)
                p.data = m
            for p, acc in self._acc.items():
                p.grad = acc
            self._acc = {}


def attach_mixed_precision(module: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> MixedPrecision:
    """Give ``module`` a bf16 compute view (:class:`MixedPrecision`), found again by
    :func:`compute_precision`; returns it."""
    mp = MixedPrecision(module, compute_dtype)
    object.__setattr__(module, _ATTR, mp)  # not a submodule or parameter: invisible to state_dict
    return mp


def mixed_precision_of(module: torch.nn.Module) -> Optional[MixedPrecision]:
    """The module's :class:`MixedPrecision`, or None (fp32 compute, or ``--params-dtype``)."""
    return getattr(module, _ATTR, None)


def compute_precision(*modules: Optional[torch.nn.Module]) -> contextlib.AbstractContextManager:
    """The context every pass runs in: each module's bf16 compute view where it has one
    (:func:`attach_mixed_precision`), nothing otherwise. None entries are skipped."""
    stack = contextlib.ExitStack()
    for m in modules:
        mp = mixed_precision_of(m) if m is not None else None
        if mp is not None:
            stack.enter_context(mp.compute())
    return stack
