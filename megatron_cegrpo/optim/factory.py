"""DeepSpeed optimizer factory and the LR schedule.

DeepSpeedCPUAdam on CPU (JIT-built once, then cached by torch extensions),
FusedAdam when CUDA is present; both are ``torch.optim.Optimizer`` subclasses,
so ``register_step_pre_hook`` works on them (the gradient-correction slot and
clipping live there: ``optim/hooks.py``).

Resume bit for bit: DeepSpeedCPUAdam's C++ side (``deepspeed/ops/csrc/includes/cpu_adam.h``,
``Adam_Optimizer::IncrementStep``) keeps beta^t for the bias correction as a float running
product while the step count goes up by one, and recomputes it as ``pow(beta, t)`` when it does
not, as on the first step after a restart. The two differ in fp32 (0.999^3: 0.9970031 vs 0.997003,
and again at t = 6), so a run resumed there took other steps than the straight run.
:func:`replay_cpu_adam_bias_correction` (run on every ``load_state_dict``) brings a loaded
optimizer's C++ side to the straight run's state.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from megatron_cegrpo.arguments import OptimConfig

__all__ = ["build_optimizer", "build_lr_scheduler", "replay_cpu_adam_bias_correction"]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or Adam, from the DeepSpeed config's optimizer.type) from DeepSpeed's ops.

    Args:
        params: the stage's trainable parameters (fp32 on CPU).
        cfg: lr, betas, eps, weight decay.
    Returns:
        ``deepspeed.ops.adam.DeepSpeedCPUAdam`` without CUDA (with
        :func:`replay_cpu_adam_bias_correction` as a ``load_state_dict`` post-hook), ``FusedAdam``
        with it (whose kernel takes beta^t from the step count alone: nothing to replay); where
        FusedAdam's JIT build fails (no nvcc, or one that does not match torch's CUDA), torch's
        fused ``AdamW`` / ``Adam`` with a warning line.
    """
    adamw = cfg.optimizer != "adam"
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay)
    params = list(params)
    if torch.cuda.is_available():
        try:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(params, adam_w_mode=adamw, **kwargs)
        except Exception as e:  # its JIT build needs nvcc matching torch's CUDA; torch's fused kernel does not
            print(f"[cegrpo] warning: DeepSpeed's FusedAdam is unavailable ({type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}); using torch.optim.{'AdamW' if adamw else 'Adam'}"
                  f"(fused=True), the same update", flush=True)
            return (torch.optim.AdamW if adamw else torch.optim.Adam)(params, fused=True, **kwargs)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(params, adamw_mode=adamw, **kwargs)
    opt.register_load_state_dict_post_hook(replay_cpu_adam_bias_correction)
    return opt


def replay_cpu_adam_bias_correction(optimizer) -> int:
    """Give a DeepSpeedCPUAdam that has just loaded a state dict the C++ bias-correction state
    of the run that saved it, so that its next steps are those of that run, bit for bit.

    In a straight run the C++ ``Adam_Optimizer`` reaches step t by t calls with steps 1, 2, ...,
    t, and holds beta1^t, beta2^t as float32 running products (``_betta1_t *= _betta1``). A
    fresh one (a resumed process) would compute ``pow(beta, t + 1)`` at its first step instead
    (``IncrementStep``: a step that is not the last one + 1). This replays steps 1 .. t through
    ``adam_update`` on a one-element scratch tensor, which runs the same ``IncrementStep``:
    the product is the straight run's, and step t + 1 continues it. The optimizer's parameters,
    moments and step counts are not touched. Cost: t calls on one element (3 s for t = 10^5 on
    this project's 2-core machine).

    Args:
        optimizer: a ``deepspeed.ops.adam.DeepSpeedCPUAdam`` whose state was just loaded; t is
            the largest ``state["step"]`` of its parameters (the trainer steps every parameter
            with state at every optimizer step, so they agree; a parameter never stepped has no
            state). Its first parameter group's betas and hyper-parameters drive the replay.
    Returns:
        t, the steps replayed (0 for an optimizer that has not stepped).
    """
    steps = [int(st["step"]) for st in optimizer.state.values() if "step" in st]
    t = max(steps, default=0)
    if t == 0:
        return 0
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    scratch = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    for step in range(1, t + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], *scratch)
    return t


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
