"""The anchor's signs at TP 2 x DP 2 (issue 14; one relay, ``anchor/relay.py``) on 4 real gloo
processes (one stage's ranks in megatron's order, TP fastest), each with the relay ``build_relay``
gives its place: (replica 0, TP rank 0) holds whole-stage signs (as the anchor sent them), broadcasts
them to TP rank 0 of replica 1 over the DP group of the TP-rank-0s, and each replica's TP rank 0 sends
its TP rank 1 that rank's shard. Every rank's hook then holds exactly
its TP slice (new, unchanged, partial: no sign for a tensor whose M is all 0, cleared with the anchor
lost), ``sign_deviation`` over each DP group is 0, and the bytes are the headers, the bitmap and the
packed whole signs (DP) / shards (TP). ~10 s."""

import os

import torch

from distributed_util import REPO, run_ranks

from megatron_cegrpo.anchor.signs import packed_nbytes
from megatron_cegrpo.anchor.relay import shard_signs
from toy_stage import NAMES  # the workers' toy stage (this test's folder is on sys.path: rootdir import mode)

WORKER = os.path.join(REPO, "tests", "anchor", "tp_dp_worker.py")


def test_every_rank_of_a_tp2_dp2_stage_holds_its_slice_of_the_whole_signs(tmp_path):
    run_ranks([WORKER, str(tmp_path)], 4, timeout=600)
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    whole = outs[0]["whole"]
    for r, out in enumerate(outs):
        want = shard_signs(NAMES, whole, r % 2, 2)
        new, keep, partial, cleared = out["held"]
        assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(new, want)), r
        assert all(torch.equal(a, b) for a, b in zip(keep, want)), r
        assert partial[1] is None and all(torch.equal(partial[i], want[i]) for i in (0, 2, 3, 4)), r
        assert cleared is None, r
        assert out["dev"] == [0.0, 0.0, 0.0, 0.0], r  # the replicas of each TP rank agree at every step
    assert [o["alive"] for o in outs] == [True, False, False, False]  # the lost anchor reached every rank
    dp, tp = "anchor/bytes_dp_fanout", "anchor/bytes_tp_fanout"  # who receives from and sends on which hop
    assert [o["hops"] for o in outs] == [([dp, tp], None), ([], tp), ([tp], dp), ([], tp)]
    for r in (1, 2, 3):  # checkpoints: a TP rank > 0 writes its own shard signs; replica 1's TP rank 0 none
        want = shard_signs(NAMES, whole, r % 2, 2)
        if r % 2:
            assert all(torch.equal(a.float(), b) and a.dtype == torch.int8
                       for a, b in zip(outs[r]["state1"]["signs"], want)), r
        else:
            assert outs[r]["state1"] == {}, r
        assert all(torch.equal(a, b) for a, b in zip(outs[r]["loaded"], want)), r  # resumed: its slice again
    whole_numel = sum(s.numel() for s in whole)
    shard_numel = sum(torch.Size(s).numel() for s in outs[1]["shapes"])
    # DP (rank 0 -> rank 2): 4 headers, the 1-byte bitmap, the packed whole signs twice (new, partial)
    assert outs[0]["dp_sent"] == 4 * 16 + 1 + 2 * packed_nbytes(whole_numel)
    # TP (each replica's TP rank 0 -> its TP rank 1): the same with the packed shard
    for r in (0, 2):
        assert outs[r]["tp_sent"] == 4 * 16 + 1 + 2 * packed_nbytes(shard_numel), r
    assert outs[1]["tp_sent"] == outs[3]["tp_sent"] == outs[2]["dp_sent"] == 0
