"""The toy stage the TP sign-split workers (``tp_split_worker.py``, ``tp_dp_worker.py``) share: whole
(TP = 1) shapes of one layer's kinds of parameters, whole-stage anchor signs, a TP rank's shards.

Kinds: column-parallel qkv (dim 0), row-parallel proj (dim 1), GLU fc1 (gate|up halves), the
vocab-parallel embedding (dim 0), a replicated norm; odd sizes, so that shards pack partial bytes."""

import torch

from megatron_cegrpo.models.tp_shard import shard_tensor

NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
         "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
         "decoder.layers.0.input_layernorm.weight"]
WHOLE = [(10, 3), (6, 3), (3, 6), (8, 3), (3,)]


def whole_signs(seed: int = 0):
    """±1 fp32 tensors of the WHOLE shapes (as the anchor would send for the whole stage)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.where(torch.rand(s, generator=gen) < 0.5, -1.0, 1.0) for s in WHOLE]


def shard_params(tp_rank: int, tp_size: int = 2):
    """Zero parameters of TP rank ``tp_rank``'s shard of every WHOLE shape."""
    return [torch.nn.Parameter(shard_tensor(n, torch.zeros(s), tp_rank, tp_size).clone()) for n, s in zip(NAMES, WHOLE)]
