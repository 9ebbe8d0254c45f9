"""One rank of ``test_tp_dp.py`` (4 gloo processes = one stage at TP 2 x DP 2, megatron's order: rank =
replica x 2 + TP rank; torch only). (replica 0, TP rank 0) holds whole-stage signs as if from the anchor
(new, unchanged, partial, cleared + anchor lost) and leads ``TPDPFanout``; TP rank 0 of replica 1 runs
``TPDPFollowerClient``, the TP ranks 1 ``TPFollowerClient``. Writes OUT/rank<r>.pt: the hook's signs and
``sign_deviation`` over the rank's DP group after each step, the follower's codes, the bytes sent."""

import contextlib
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.dp_fanout import SignFanout, sign_deviation
from megatron_cegrpo.anchor.tp_dp import TPDPFanout, TPDPFollowerClient
from megatron_cegrpo.anchor.tp_split import TPFollowerClient, TPSignSplit
from megatron_cegrpo.optim.hooks import SignCorrectionHook
from toy_stage import NAMES, WHOLE, shard_params, whole_signs  # noqa: E402  (this script's folder)

OUT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
tp_rank, dp_rank = rank % 2, rank // 2
tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # megatron's DP groups: equal TP ranks
tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
whole = whole_signs()
params = shard_params(tp_rank)
hook = SignCorrectionHook(params)
split = TPSignSplit(tp_group, NAMES, hook)
cfg = SimpleNamespace(anchor_interval=1)
timers = SimpleNamespace(phase=lambda name: contextlib.nullcontext())
dp = SignFanout(dp_group, WHOLE) if tp_rank == 0 else None
out = {"held": [], "dev": [], "whole": whole, "shapes": [tuple(p.shape) for p in params]}
steps = [(True, whole), (True, whole), (True, [whole[0], None, *whole[2:]]), (False, None)]

if rank == 0:  # the anchor's client would set the split and lead (AnchorClient.before_optimizer_step)
    fanout = TPDPFanout(dp, split)
elif tp_rank == 0:
    client = TPDPFollowerClient(cfg, split, dp, rank=rank)
else:
    client = TPFollowerClient(cfg, hook, split, rank=rank)
for t, (alive, after) in enumerate(steps, start=1):
    if rank == 0:
        before = split.signs
        if after is not before:
            split.set_signs(after)
        fanout.lead(alive, before, split.signs)
    else:
        client.before_optimizer_step(t, timers)
    out["held"].append(None if hook.signs is None else [s.clone() if s is not None else None for s in hook.signs])
    out["dev"].append(sign_deviation(hook.signs, sum(p.numel() for p in params), dp_group, out["shapes"]))
out["alive"] = True if rank == 0 else client.alive
out["dp_sent"] = dp.take_bytes() if dp is not None else 0
out["tp_sent"] = split.take_bytes()
torch.save(out, os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
