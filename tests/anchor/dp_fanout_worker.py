"""One rank of ``test_dp_fanout.py`` (2 gloo processes, torch only): the relay's DP hop
(``anchor/relay.py``'s :class:`Hop` without names: every receiver the same signs) carries the leader's
signs to the follower exactly, and ``sign_deviation`` measures what each rank holds. Writes
OUT/rank<r>.pt."""

import os
import sys

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.relay import CLEARED, KEEP, NEW, PARTIAL, Hop, sign_deviation

OUT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1])
shapes = [(3, 5), (7,)]  # 22 coordinates: the packed signs end in a partial byte
gen = torch.Generator().manual_seed(0)
signs = [torch.where(torch.rand(s, generator=gen) < 0.5, -1.0, 1.0) for s in shapes]
fan = Hop(group, shapes)
out = {"codes": [], "received": []}
if rank == 0:
    fan.send(True, None, signs)  # new signs
    fan.send(True, signs, signs)  # unchanged
    partial = [signs[0], None]  # no sign for tensor 1 (the anchor's M is all 0 there)
    fan.send(True, signs, partial)
    fan.send(False, partial, None)  # cleared, anchor lost
    out["sent"] = fan.take_bytes()
else:
    for _ in range(4):
        alive, code, got = fan.recv()
        out["codes"].append((alive, code))
        out["received"].append(got)
held = [s.clone() for s in signs]
out["dev_same"] = sign_deviation(held, 22, group)
if rank == 1:
    held[1][4] = -held[1][4]  # one coordinate flipped on one replica
out["dev_flip"] = sign_deviation(held, 22, group)
out["dev_none"] = sign_deviation(None if rank == 1 else held, 22, group)
held = [s.clone() for s in signs]
out["dev_partial"] = sign_deviation([held[0], None] if rank == 1 else held, 22, group, shapes)
out["consts"] = (KEEP, NEW, CLEARED, PARTIAL)
out["signs"] = signs
torch.save(out, os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
