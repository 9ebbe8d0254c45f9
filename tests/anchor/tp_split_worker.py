"""One rank of ``test_tp_split.py`` (2 gloo processes = one stage's 2 TP ranks, torch only): the relay
the layout gives TP = 2 x DP = 1 (``anchor/relay.py``'s ``build_relay``): TP rank 0 holds whole-stage
signs and sends TP rank 1 its shard over the TP hop (new, unchanged, partial, cleared + anchor lost).
Writes OUT/rank<r>.pt: the hook's signs after each step, the whole signs, the bytes sent."""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.relay import build_relay
from megatron_cegrpo.optim.hooks import SignCorrectionHook
from toy_stage import NAMES, WHOLE, shard_params, whole_signs  # noqa: E402  (this script's folder)

OUT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1])
whole = whole_signs()
params = shard_params(rank)
hook = SignCorrectionHook(params)
ctx = SimpleNamespace(tp_size=2, tp_rank=rank, tp_group=group, dp_rank=0, dp_group=None)
split = build_relay(ctx, hook, NAMES, WHOLE)
assert (split.upstream is None) == (rank == 0) and len(split.downstream) == (1 - rank)
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
    out["sent"] = split.take_bytes()["anchor/bytes_tp_fanout"]
else:
    for _ in range(4):
        out["codes"].append(split.receive())
        snap()
torch.save(out, os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
