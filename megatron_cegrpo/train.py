"""Entry point: ``deepspeed --num_gpus 2 megatron_cegrpo/train.py <flags>`` (or torchrun, or
``python -m megatron_cegrpo.train`` for PP=1). ``--help`` lists the flags."""

import os
import sys

# Run as a script (the deepspeed launcher's way), this folder is sys.path[0]: drop it so
# package-internal module names never shadow top-level ones.
_here = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
    sys.path.pop(0)


def _quiet_known_warnings() -> None:
    """megatron-core warns at import that the optional fused kernels are absent (always true
    on CPU); keep the console for the trainer's own messages."""
    import warnings

    for msg in (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                r"full scope is deprecated"):
        warnings.filterwarnings("ignore", message=msg)


def main(argv=None):
    if argv is None:
        from megatron_cegrpo.supervisor import should_supervise, supervise

        if should_supervise():
            sys.exit(supervise())
    _quiet_known_warnings()
    from megatron_cegrpo.arguments import build_config, parse_args

    args = parse_args(argv)
    cfg = build_config(args)
    cfg.validate()  # flag-level checks before any process group exists

    from megatron_cegrpo.initialize import initialize_distributed, shutdown_distributed

    ctx = initialize_distributed(cfg.parallel.pipeline_model_parallel_size, cfg.optim.seed,
                                 cfg.parallel.num_threads, anchor_ranks=cfg.anchor.anchor_ranks,
                                 timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    try:
        cfg.validate(world_size=ctx.world_size)
        if ctx.is_anchor:
            from megatron_cegrpo.anchor.runner import run_anchor

            run_anchor(cfg, ctx)
        else:
            from megatron_cegrpo.training import GRPOTrainer

            trainer = GRPOTrainer(cfg, ctx)
            trainer.train()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
