"""One rank of ``test_tp_dp.py`` (4 gloo processes = one stage at TP 2 x DP 2, megatron's order: rank =
replica x 2 + TP rank; torch only). Every rank builds the relay its place in the layout gives it
(``anchor/relay.py``'s ``build_relay``): (replica 0, TP rank 0) holds whole-stage signs as if from the
anchor (new, unchanged, partial, cleared + anchor lost) and leads the DP hop, then the TP hop; every
other rank runs ``RelayFollower``. Writes OUT/rank<r>.pt: the hook's signs and ``sign_deviation`` over the
rank's DP group after each step, the follower's checkpoint state after step 1, the bytes sent."""

import contextlib
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.relay import RelayFollower, build_relay, sign_deviation
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
ctx = SimpleNamespace(tp_size=2, tp_rank=tp_rank, tp_group=tp_group, dp_rank=dp_rank, dp_group=dp_group)
relay = build_relay(ctx, hook, NAMES, WHOLE)
cfg = SimpleNamespace(anchor_interval=1, anchor_ship_check=False)
timers = SimpleNamespace(phase=lambda name: contextlib.nullcontext())
out = {"held": [], "dev": [], "whole": whole, "shapes": [tuple(p.shape) for p in params],
       "hops": ([h.metric for h in relay.downstream], relay.upstream.metric if relay.upstream else None)}
steps = [(True, whole), (True, whole), (True, [whole[0], None, *whole[2:]]), (False, None)]

if rank != 0:  # rank 0 stands for the anchor's client (AnchorClient.before_optimizer_step)
    client = RelayFollower(cfg, relay, rank=rank, writes_own_state=tp_rank > 0)
for t, (alive, after) in enumerate(steps, start=1):
    if rank == 0:
        before = relay.signs
        if after is not before:
            relay.set_signs(after)
        relay.lead(alive, before, relay.signs)
    else:
        client.before_optimizer_step(t, timers)
        if t == 1:
            out["state1"] = client.state_dict()
    out["held"].append(None if hook.signs is None else [s.clone() if s is not None else None for s in hook.signs])
    out["dev"].append(sign_deviation(hook.signs, sum(p.numel() for p in params), dp_group, out["shapes"]))
out["alive"] = True if rank == 0 else client.alive
sent = relay.take_bytes()
out["dp_sent"] = sent.get("anchor/bytes_dp_fanout", 0)
out["tp_sent"] = sent.get("anchor/bytes_tp_fanout", 0)
if rank != 0:  # a resume: replica 0's TP rank 0 state (whole signs) at TP rank 0, the own shard elsewhere
    stored = [s.to(torch.int8) for s in whole] if tp_rank == 0 else out["state1"]["signs"]
    client.load_state_dict({"signs": stored})
    out["loaded"] = [s.clone() for s in hook.signs]
torch.save(out, os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
