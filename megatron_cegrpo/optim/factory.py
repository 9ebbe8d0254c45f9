"""DeepSpeed optimizer factory and the LR schedule.

DeepSpeedCPUAdam on CPU (JIT-built once, then cached by torch extensions),
FusedAdam when CUDA is present; both are ``torch.optim.Optimizer`` subclasses,
so ``register_step_pre_hook`` works on them (the gradient-correction slot and
clipping live there: ``optim/hooks.py``).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from megatron_cegrpo.arguments import OptimConfig

__all__ = ["build_optimizer", "build_lr_scheduler"]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or Adam, from the DeepSpeed config's optimizer.type) from DeepSpeed's ops.

    Args:
        params: the stage's trainable parameters (fp32 on CPU).
        cfg: lr, betas, eps, weight decay.
    Returns:
        ``deepspeed.ops.adam.DeepSpeedCPUAdam`` without CUDA, ``FusedAdam`` with it.
    """
    adamw = cfg.optimizer != "adam"
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay)
    params = list(params)
    if torch.cuda.is_available():
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=adamw, **kwargs)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=adamw, **kwargs)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig):
    """Megatron-style schedule: linear warmup over ``lr_warmup_iters``, then
    constant / linear / cosine decay to ``min_lr`` at ``train_iters``.

    Returns a ``torch.optim.lr_scheduler.LambdaLR`` (checkpointable via state_dict).
    """
    warm, total = cfg.lr_warmup_iters, cfg.train_iters
    floor = cfg.min_lr / cfg.lr

    def factor(it: int) -> float:
        if warm > 0 and it < warm:
            return (it + 1) / warm
        if cfg.lr_decay_style == "constant" or total <= warm:
            return 1.0
        frac = min(1.0, (it - warm) / max(1, total - warm))
        if cfg.lr_decay_style == "linear":
            return floor + (1.0 - floor) * (1.0 - frac)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
