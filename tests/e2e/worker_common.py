"""What the e2e worker scripts (``dp_worker.py``, ``tied_sync_worker.py``) share: one run of
``train.py``'s flags inside an already initialized world, the anchor rank included."""

import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.initialize import set_seed


def train_or_anchor(argv, ctx, seed: int):
    """Build and validate the config of ``argv``, seed as train.py does, and run it on this rank:
    the anchor loop on the anchor rank (returns None once the stages committed their last
    checkpoint), else a :class:`GRPOTrainer` trained to ``--train-iters`` (returned)."""
    from megatron_cegrpo.anchor.runner import run_anchor
    from megatron_cegrpo.training import GRPOTrainer

    cfg = build_config(parse_args(argv))
    cfg.validate(world_size=dist.get_world_size())
    set_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    if ctx.is_anchor:
        run_anchor(cfg, ctx)
        dist.barrier()  # the stages commit the last checkpoint after the anchor's part of it
        return None
    trainer = GRPOTrainer(cfg, ctx)
    trainer.train()
    return trainer
