"""The whole-step byte ledger (issue 12 item 1): totals are the sums of the parts, exactly."""

import pickle

import pytest

from distributed_util import run_ranks
from megatron_cegrpo.pipeline.broadcast import broadcast_nbytes
from megatron_cegrpo.training.ledger import RunLedger, whole_step_ledger

PARTS = {"comm/fwd_bytes": 290, "comm/bwd_bytes": 290, "comm/dense_equiv_bytes": 11520,
         "comm/batch_bytes": 1000, "comm/embd_sync_bytes": 3000, "comm/embd_sync_dense_bytes": 64000,
         "sync/bytes": 5000, "sync/dense_fp32_bytes": 40000,
         "anchor/bytes_in": 20700, "anchor/bytes_out": 1300, "anchor/bytes_ship": 20000,
         "anchor/bytes_ship_fp32": 40000,
         # not parts of the ledger: the cumulative boundary counter, a ratio
         "comm/total_wire_bytes": 10 ** 9, "comm/bytes_ratio": 0.05}


def test_totals_are_the_sums_of_the_parts():
    out = whole_step_ledger(PARTS)
    sent = 290 + 290 + 1000 + 3000 + 5000 + 20700 + 1300
    dense = 11520 + 1000 + 64000 + 40000 + (20700 + 1300 - 20000 + 40000)
    assert out == {"comm/total_bytes": sent, "comm/total_dense_bytes": dense,
                   "comm/total_ratio": sent / dense}


def test_bytes_per_response_token():
    out = whole_step_ledger({**PARTS, "batch/response_tokens": 58})
    assert out["comm/boundary_bytes_per_response_token"] == (290 + 290) / 58
    assert out["comm/total_bytes_per_response_token"] == out["comm/total_bytes"] / 58
    assert "comm/boundary_bytes_per_response_token" not in whole_step_ledger({**PARTS, "batch/response_tokens": 0})


def test_missing_parts_count_zero_and_negative_bytes_are_refused():
    assert whole_step_ledger({}) == {"comm/total_bytes": 0, "comm/total_dense_bytes": 0, "comm/total_ratio": 0.0}
    only = whole_step_ledger({"comm/fwd_bytes": 5, "comm/dense_equiv_bytes": 100})
    assert only["comm/total_bytes"] == 5 and only["comm/total_ratio"] == 0.05
    with pytest.raises(ValueError, match="negative"):
        whole_step_ledger({"sync/bytes": -1})


def test_the_run_ledger_sums_every_iteration_and_resumes_from_its_state():
    steps = [whole_step_ledger(PARTS), whole_step_ledger({"comm/fwd_bytes": 7, "comm/dense_equiv_bytes": 70}),
             whole_step_ledger({})]
    run = RunLedger()
    assert run.totals() == {"comm/run_total_bytes": 0, "comm/run_total_dense_bytes": 0, "comm/run_total_ratio": 0.0}
    first = run.add(steps[0])
    assert first["comm/run_total_ratio"] == steps[0]["comm/total_ratio"]  # one iteration: its own ratio
    resumed = RunLedger()
    resumed.load_state_dict(pickle.loads(pickle.dumps(run.state_dict())))
    for ledger in (run, resumed):
        ledger.add(steps[1])
        out = ledger.add(steps[2])
    sent = steps[0]["comm/total_bytes"] + 7
    dense = steps[0]["comm/total_dense_bytes"] + 70
    assert run.totals() == resumed.totals() == out == {
        "comm/run_total_bytes": sent, "comm/run_total_dense_bytes": dense, "comm/run_total_ratio": sent / dense}
    assert run.iterations == 3 and "3 iterations" in run.describe() and f"{sent / dense:.4f}" in run.describe()
    fresh = RunLedger()
    assert fresh.step(PARTS) == {**steps[0], "comm/run_total_bytes": steps[0]["comm/total_bytes"],
                                 "comm/run_total_dense_bytes": steps[0]["comm/total_dense_bytes"],
                                 "comm/run_total_ratio": steps[0]["comm/total_ratio"]}
    old = RunLedger()
    old.load_state_dict(None)  # a checkpoint from before the run ledger: the totals start there
    assert old.state_dict() == {"bytes": 0, "dense_bytes": 0, "iterations": 0}


WORKER = r'''
import os, sys
import torch, torch.distributed as dist
from megatron_cegrpo.pipeline.broadcast import broadcast_metered, dumps
dist.init_process_group("gloo")
obj = {"tokens": torch.arange(300).view(3, 100), "adv": torch.randn(3, generator=torch.Generator().manual_seed(1))}
got, n = broadcast_metered(obj if dist.get_rank() == 0 else None, dist.group.WORLD)
assert torch.equal(got["tokens"], obj["tokens"]) and torch.equal(got["adv"], obj["adv"])
print("BYTES", n, len(dumps(obj)))
dist.destroy_process_group()
'''


def test_broadcast_bytes_are_the_wire_bytes_sent(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    outs = run_ranks([str(script)], 3, timeout=120)
    for out in outs:
        line = [x for x in out.splitlines() if x.startswith("BYTES")][0]
        n, payload = map(int, line.split()[1:])
        assert n == broadcast_nbytes(payload, 3) == 2 * (8 + payload)


SCATTER_WORKER = r'''
import torch, torch.distributed as dist
from megatron_cegrpo.pipeline.broadcast import dumps, scatter_metered
dist.init_process_group("gloo")
shards = [{"rows": torch.arange(4) + 4 * r} for r in range(2)]
replica_of = lambda g: (g // 2) % 2  # TP = 2 x DP = 2, one stage: ranks 0, 1 replica 0; 2, 3 replica 1
got, n = scatter_metered(shards if dist.get_rank() == 0 else None, replica_of, dist.group.WORLD,
                         counted=lambda g: g % 2 == 0)
assert torch.equal(got["rows"], shards[replica_of(dist.get_rank())]["rows"])
print("BYTES", n, len(dumps(shards[1])))
dist.destroy_process_group()
'''


def test_scatter_counts_only_the_counted_members(tmp_path):
    """At TP x DP the driver's sends to TP rank 0 of the other replicas count (rank 2 here), not
    those to its own TP peer (rank 1) or rank 3; every member still gets its replica's rows."""
    script = tmp_path / "w.py"
    script.write_text(SCATTER_WORKER)
    outs = run_ranks([str(script)], 4, timeout=120)
    n0, shard = map(int, [x for x in outs[0].splitlines() if x.startswith("BYTES")][0].split()[1:])
    assert n0 == 8 + shard
