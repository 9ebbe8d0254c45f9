"""One rank of ``test_tp_split.py`` (2 gloo processes = one stage's 2 TP ranks, torch only): TP rank 0
holds whole-stage signs and sends TP rank 1 its shard (new, unchanged, partial, cleared + anchor lost).
Writes OUT/rank<r>.pt: the hook's signs after each step, the whole signs, the bytes sent."""

import os
import sys

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.tp_split import TPSignSplit
from megatron_cegrpo.optim.hooks import SignCorrectionHook
from toy_stage import NAMES, WHOLE, shard_params, whole_signs  # noqa: E402  (this script's folder)

OUT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1])
whole = whole_signs()
params = shard_params(rank)
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
