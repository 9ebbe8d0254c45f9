"""``--tied-embedding-sync sparse`` trains bit for bit like the dense all-reduce (issue 12, item 2).

Real gloo ranks (``tied_sync_worker.py``), tiny-llama (tied embeddings, V = 49152, d = 64),
AdamW with weight decay 0.1, mask codec, 3 iterations, checkpoints at 2 and 3:

- PP = 2 with the anchor (c = K = 2: a fire at 2 folds sign(M) into W's gradient), and a
  sparse run stopped after its checkpoint at 1 and resumed to 3 (see the worker on why 1);
- PP = 3 (1 + 2 + 1 layers; the embedding group is {first, last}, the middle stage holds no W)
  with two optimizer steps per iteration (``--global-batch-size 4``), so the first stage
  fetches its rows again between the steps.

Checked: every logged metric except the byte counters they are meant to change (losses,
grad norms, KL, weight change, sign agreement ...) equal to the bit; every stage's final
parameters and the driver's sampler weights equal; the metered bytes equal the bytes the
exchange passed to ``torch.distributed.send``, and the row messages equal
``2 x rows x d x 4`` bytes per step plus the 8- and 16-byte terms and the full syncs at the saves.
"""

import json
import os

import pytest
import torch

from distributed_util import PARITY_REWARD, REPO, STEP_TOTALS, metric_diffs, run_ranks
from megatron_cegrpo.training.perf import without_wall_clock

WORKER = os.path.join(REPO, "tests", "e2e", "tied_sync_worker.py")
DS_WD = {"gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}}
W_BYTES = 49152 * 64 * 4  # tiny-llama's tied embedding, fp32
#: the keys the sparse exchange changes on purpose: its own bytes, the anchor's (the first stage
#: no longer ships its stale copy of W, nor receives its signs), the ledger's totals of them (per
#: iteration and over the run) and the share of the driver's own stage whose bf16 value changed (its
#: stale copy of W is not part of it); the resumed run's run totals add its restart's start-up bytes
BYTE_KEYS = ("comm/embd_sync_bytes", "comm/embd_full_sync_bytes", "anchor/bytes_in", "anchor/bytes_out",
             "anchor/received_bytes_total", "anchor/bytes_ship", "anchor/bytes_ship_fp32", *STEP_TOTALS,
             "comm/run_total_bytes",
             "comm/run_total_dense_bytes", "comm/run_total_ratio", "sync/local_changed_frac")


def _launch(tmp_path, pp, anchors, resume, *extra):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    (tmp_path / "ds_wd.json").write_text(json.dumps(DS_WD))
    run_ranks([WORKER, str(tmp_path), str(pp), str(anchors), "1" if resume else "0", *extra], pp + anchors,
              timeout=900)
    return {run: _load(tmp_path / run, pp) for run in ("allreduce", "sparse") + (("resumed",) if resume else ())}


def _load(run_dir, pp):
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics = {m["step"]: without_wall_clock(m) for m in metrics}
    return metrics, [torch.load(run_dir / f"rank{r}.pt") for r in range(pp)]


def _same_training(a, b):
    (ma, ra), (mb, rb) = a, b
    assert sorted(ma) == sorted(mb) == [1, 2, 3]
    for t in ma:
        x = {k: v for k, v in ma[t].items() if k not in BYTE_KEYS}
        y = {k: v for k, v in mb[t].items() if k not in BYTE_KEYS}
        assert not metric_diffs(x, y), (t, metric_diffs(x, y))
    for r, (sa, sb) in enumerate(zip(ra, rb)):
        assert sa["params"].keys() == sb["params"].keys()
        for k in sa["params"]:
            assert torch.equal(sa["params"][k], sb["params"][k]), (r, k)
    for k, v in ra[0]["sampler"].items():
        assert torch.equal(v, rb[0]["sampler"][k]), k


def _check_bytes(run, steps_per_iter):
    metrics, ranks = run
    sent = sum(m["comm/embd_sync_bytes"] for m in metrics.values())
    assert sent == sum(r["sent"] for r in ranks)  # the meter counts what went to send(), byte for byte
    for t, m in metrics.items():
        saves = 1 if t in (2, 3) else 0
        assert m["comm/embd_full_sync_bytes"] == saves * W_BYTES
        rows = m["comm/embd_sync_bytes"] - m["comm/embd_full_sync_bytes"] - 8 * steps_per_iter - 16
        # rows fetched (last -> first) and gradient rows (first -> last): whole rows of d = 64 fp32
        assert rows > 0 and rows % (64 * 4) == 0
        assert rows < 0.05 * m["comm/embd_sync_dense_bytes"]
        assert m["comm/embd_sync_dense_bytes"] == 2 * W_BYTES * steps_per_iter


def test_sparse_equals_allreduce_pp2_with_anchor_and_resume(tmp_path):
    runs = _launch(tmp_path, 2, 1, True, "--anchor-interval", "2", "--anchor-delay", "2")
    _same_training(runs["allreduce"], runs["sparse"])
    _same_training(runs["sparse"], runs["resumed"])
    _check_bytes(runs["sparse"], 1)
    a, s = runs["allreduce"][0], runs["sparse"][0]
    assert a[2]["anchor/correction_applied"] == 1 and a[2]["anchor/fire"] == 1
    for t in a:  # today's meter: the dense all-reduce, W bytes per member rank and step
        assert a[t]["comm/embd_sync_bytes"] == a[t]["comm/embd_sync_dense_bytes"] == 2 * W_BYTES
    # the first stage ships no copy of W to the anchor (shipment at 3, an int4 delta, --anchor-ship:
    # per block of 256 values a 4-byte scale and 128 bytes; theta(0) at 1 is not sent at all)
    assert a[3]["anchor/bytes_in"] - s[3]["anchor/bytes_in"] == W_BYTES // 4 // 256 * (4 + 128)
    assert a[2]["anchor/bytes_out"] - s[2]["anchor/bytes_out"] == W_BYTES // 4 // 8  # its signs: 1 bit each


@pytest.mark.slow  # `make test-slow`: the PP = 2 test covers the exchange; this adds a middle stage
@pytest.mark.parametrize("pp", [3])
def test_sparse_equals_allreduce_pp3_two_steps_per_iteration(tmp_path, pp):
    runs = _launch(tmp_path, pp, 0, False, "--decoder-first-pipeline-num-layers", "1",
                   "--decoder-last-pipeline-num-layers", "1", "--global-batch-size", "4")
    _same_training(runs["allreduce"], runs["sparse"])
    _check_bytes(runs["sparse"], 2)
    assert all(m["actor/num_optimizer_steps"] == 2 for m in runs["sparse"][0].values())
