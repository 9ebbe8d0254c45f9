"""One rank of ``test_tp_split.py`` (2 gloo processes = one stage's 2 TP ranks, torch only): TP rank 0
holds whole-stage signs and sends TP rank 1 its shard (new, unchanged, partial, cleared + anchor lost).
Writes OUT/rank<r>.pt: the hook's signs after each step, the whole signs, the bytes sent."""

import os
import sys

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.tp_split import TPSignSplit
from megatron_cegrpo.models.tp_shard import shard_tensor
from megatron_cegrpo.optim.hooks import SignCorrectionHook

OUT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1])
# whole (TP = 1) shapes: column-parallel qkv (dim 0), row-parallel proj (dim 1), GLU fc1 (gate|up halves),
# the vocab-parallel embedding (dim 0), a replicated norm; 7 + ... coordinates: partial bytes
NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
         "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
         "decoder.layers.0.input_layernorm.weight"]
WHOLE = [(10, 3), (6, 3), (3, 6), (8, 3), (3,)]
gen = torch.Generator().manual_seed(0)
whole = [torch.where(torch.rand(s, generator=gen) < 0.5, -1.0, 1.0) for s in WHOLE]
params = [torch.nn.Parameter(shard_tensor(n, torch.zeros(s), rank, 2).clone()) for n, s in zip(NAMES, WHOLE)]
hook = SignCorrectionHook(params)
split = TPSignSplit(group, NAMES, hook)
out = {"held": [], "codes": [], "whole": whole, "shapes": [tuple(p.shape) for p in params]}


def snap():
    out["held"].append(None if hook.signs is None else [s.clone() if s is not None else None for s in hook.signs])


if rank == 0:
    steps = [(True, whole), (True, whole), (True, [whole[0], None, *whole[2:]]), (False, None)]
    for alive, after in steps:  # new, unchanged, partial (no sign for tensor 1), cleared + anchor lost
        before = split.signs
        if after is not before:
            split.set_signs(after)
        split.lead(alive, before, split.signs)
        snap()
    out["sent"] = split.take_bytes()
else:
    for _ in range(4):
        alive, code, signs = split.follow()
        out["codes"].append((alive, code))
        if code in (1, 3):
            hook.set_signs(signs)
        elif code == 2:
            hook.set_signs(None)
        snap()
torch.save(out, os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
