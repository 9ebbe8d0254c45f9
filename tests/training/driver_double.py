"""A ``training.driver.Driver`` without its model, sampler engine or data files (``Driver.__new__``):
the generation loop's tests give it a fake engine, prompts ``i + 1`` and a reward function."""

from types import SimpleNamespace

import torch

from megatron_cegrpo.data import PromptSampler
from megatron_cegrpo.training.driver import Driver


def bare_driver(cfg, engine, records, reward_fn, *, max_position_embeddings: int = 64) -> Driver:
    """A Driver on ``len(records)`` prompts (prompt i's single token is i + 1) whose sampler is
    ``engine`` and whose every record scores through ``reward_fn(response, ground_truth)``."""
    d = Driver.__new__(Driver)
    d.cfg, d.rollout, d._rollout_metrics, d._reward_metrics = cfg, engine, {}, {}
    d.hf_config = SimpleNamespace(max_position_embeddings=max_position_embeddings)
    d.prompt_ids = [torch.tensor([i + 1]) for i in range(len(records))]
    d.train_records = list(records)
    d.get_reward_fn = lambda _name: reward_fn
    d.sampler = PromptSampler(len(records), cfg.grpo.rollout_batch_size, cfg.optim.seed)
    return d
