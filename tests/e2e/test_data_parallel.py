"""Data parallelism inside a stage (issue 14): PP = 2 x DP = 2 trains like PP = 2 x DP = 1.

Real gloo ranks (``dp_worker.py``), tiny-llama, 2 iterations of 8 sequences (one optimizer step
each), the anchor at c = K = 2 (the fire at 2 folds sign(M) into step 2), once with a 3-rank
world (DP = 1) and once with a 5-rank world (DP = 2: stage-major ranks 0, 1 = stage 0 and 2, 3 =
stage 1, anchor 4); dense and mask codecs; at DP = 2 a trainer resumed from the checkpoint at 1.

Tolerance (fp32 reduction order): at DP = 2 the gradient of a mini-batch is the sum of two
replicas' partial sums instead of one running sum over the micro-batches, so gradients differ
in the last bits (~1e-7 relative). Losses, norms, KL and entropy agree to ``1e-5`` relative +
``1e-6`` absolute, the sampler/trainer mismatch to ``MISMATCH_ATOL`` nats absolute (``distributed_util.py`` says why);
weights after 2 Adam steps at lr 1e-3 to ``1e-5`` absolute (1 % of one Adam step: Adam divides by sqrt(v), so a relative gradient error is not damped;
measured 5.6e-7). The replicas of a stage hold bit-identical weights and signs, and the resume
is bit-exact.

The first stage's ``embedding.word_embeddings.weight`` is left out of the weight comparisons:
under ``--tied-embedding-sync sparse`` it is a row cache (refreshed for the rows a replica's
batch uses), not a trained weight; the trained W is the last stage's ``output_layer.weight``.
"""

import json
import math
import os
import re

import pytest
import torch

from distributed_util import (MISMATCH_ATOL, MISMATCH_KEYS, PARITY_REWARD, REPO, RESUME_VOLATILE, STEP_TOTALS,
                              plan_of, run_ranks)
from megatron_cegrpo.training.perf import without_wall_clock
from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.grpo.batch import replica_rows

WORKER = os.path.join(REPO, "tests", "e2e", "dp_worker.py")
CACHE = "embedding.word_embeddings.weight"  # the first stage's row cache of the tied W
LOSS_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
             "actor/grad_norm", "actor/weight_rel_change", "critic/score/mean", "response_length/mean")
#: boundary bytes: the same tokens cross, split over the replicas
BOUNDARY_KEYS = ("comm/fwd_bytes", "comm/bwd_bytes", "comm/dense_equiv_bytes", "comm/bytes_ratio")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for dp in (1, 2):
        d = tmp_path_factory.mktemp(f"dp{dp}")
        (d / "reward.py").write_text(PARITY_REWARD)
        run_ranks([WORKER, str(d), "2", str(dp)], 2 * dp + 1, timeout=900)
        out[dp] = d
    return out


def _load(d, run, ranks):
    lines = [json.loads(x) for x in (d / run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics = {m["step"]: without_wall_clock(m) for m in lines}
    return metrics, [torch.load(d / run / f"rank{r}.pt") for r in ranks]


def _weights(dump, stage):
    return {n: p for n, p in dump["params"].items() if not (stage == 0 and n == CACHE)}


@pytest.mark.parametrize("codec", ["dense", "mask"])
def test_dp2_equals_dp1_on_the_same_global_batch(runs, codec):
    m1, (s0, s1) = _load(runs[1], codec, [0, 1])
    m2, (r0, r1, r2, r3) = _load(runs[2], codec, [0, 1, 2, 3])
    for step in (1, 2):
        for k in LOSS_KEYS:
            if k in m1[step]:
                a, b = m1[step][k], m2[step][k]
                assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (codec, step, k, a, b)
        for k in MISMATCH_KEYS:
            assert abs(m1[step][k] - m2[step][k]) <= MISMATCH_ATOL, (codec, step, k, m1[step][k], m2[step][k])
        for k in BOUNDARY_KEYS:
            assert m1[step][k] == m2[step][k], (codec, step, k)
        assert m2[step]["comm/embd_sync_dense_bytes"] == 2 * m1[step]["comm/embd_sync_dense_bytes"]
    assert m1[2]["anchor/correction_applied"] == m2[2]["anchor/correction_applied"] == 1
    assert math.isclose(m1[2]["anchor/sign_agreement"], m2[2]["anchor/sign_agreement"], abs_tol=1e-6)
    # every replica of a stage applied the same sign(M) slice, and it is DP = 1's
    assert m2[2]["anchor/sign_dev_across_dp"] == 0.0 and "anchor/sign_dev_across_dp" not in m1[2]
    for ref, replicas, stage in ((s0, (r0, r1), 0), (s1, (r2, r3), 1)):
        w_ref, w_a, w_b = (_weights(x, stage) for x in (ref, *replicas))
        assert w_a.keys() == w_ref.keys()
        for n in w_ref:
            assert torch.equal(w_a[n], w_b[n]), (codec, stage, n)  # replicas bit-identical
            diff = float((w_a[n] - w_ref[n]).abs().max())
            assert diff <= 1e-5, (codec, stage, n, diff)
        assert all(torch.equal(x, y) and torch.equal(x, z)
                   for x, y, z in zip(ref["signs"], replicas[0]["signs"], replicas[1]["signs"]))


def test_dp2_equals_dp1_with_per_microbatch_bases_and_the_fidelity_probe(runs):
    """rpq:lrq builds a basis from each micro-batch's own data (``replica_invariant``): the
    replicas' micro-batches are DP = 1's (``replica_rows``), so the payloads, hence the boundary
    bytes, are DP = 1's exactly; the gradient-fidelity probe sums G_dense over the replicas like
    G_codec, so ``fidelity/*`` agree to the same fp32 tolerance as the losses at step 1.

    Step 2 starts from weights that differ in the last bits (~1e-7, the DP sum's order), and the
    quantizer turns such a difference into a whole rounding step at the rare coefficient that
    sits on a rounding boundary (the mask has no rounding): measured relative differences at
    step 2 up to 6.4e-4 (``codec/error_persistence``), 6.1e-5 (``fidelity/cos/stage_0``), 1.4e-5
    (mismatch); the bound there is 2e-3 relative, and the weights' 1e-3 absolute."""
    m1, (s0, s1) = _load(runs[1], "rpq", [0, 1])
    m2, (r0, r1, r2, r3) = _load(runs[2], "rpq", [0, 1, 2, 3])
    fid = [k for k in m1[1] if k.startswith("fidelity/")]
    assert {"fidelity/cos", "fidelity/cos/stage_0", "fidelity/cos/stage_1", "fidelity/sign_agreement",
            "fidelity/norm_ratio"} <= set(fid)
    for step in (1, 2):
        assert 0.0 < m1[step]["comm/bytes_ratio"] < 0.2  # compressed, not dense
        for k in BOUNDARY_KEYS:
            assert m1[step][k] == m2[step][k], (step, k)
        rel = 1e-5 if step == 1 else 2e-3
        for k in LOSS_KEYS + tuple(fid) + ("codec/error_persistence",):
            if k in m1[step]:
                a, b = m1[step][k], m2[step][k]
                assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-6), (step, k, a, b)
        for k in MISMATCH_KEYS:
            assert abs(m1[step][k] - m2[step][k]) <= MISMATCH_ATOL, (step, k, m1[step][k], m2[step][k])
    assert "codec/error_persistence" in m2[2]
    # weights after 2 Adam steps at lr 1e-3: within 1e-3 = one Adam step (Adam moves a coordinate by
    # ~lr sign(g) whatever |g|, so a near-zero coordinate of step 2's gradient whose sign the rounding
    # flips above moves the other way; measured 2.4e-4; the mask's bound is 1e-5). Step 1's checks
    # (1e-5) and the exact boundary bytes carry the equivalence; a lost replica fails those.
    worst = 0.0
    for ref, replicas, stage in ((s0, (r0, r1), 0), (s1, (r2, r3), 1)):
        w_ref, w_a, w_b = (_weights(x, stage) for x in (ref, *replicas))
        for n in w_ref:
            assert torch.equal(w_a[n], w_b[n]), (stage, n)
            worst = max(worst, float((w_a[n] - w_ref[n]).abs().max()))
    assert worst <= 1e-3, worst


def test_dp2_byte_counters(runs):
    """The gradient all-reduce and the sign fan-out bytes, from the stages' parameter counts."""
    m2, dumps = _load(runs[2], "mask", [0, 1, 2, 3])
    # each rank all-reduces its stage's gradients once per iteration; a 2-member ring sends the
    # whole buffer once; the first stage's tied-W cache has no gradient (sparse exchange)
    reduced = sum(p.numel() * 4 for r, d in enumerate(dumps) for n, p in _weights(d, r // 2).items())
    owned = [sum(p.numel() for p in _weights(dumps[2 * s], s).values()) for s in (0, 1)]
    for step in (1, 2):
        assert m2[step]["comm/dp_grad_allreduce_bytes"] == reduced
    # replica 0 sends replica 1 a 16-byte header every step; at the fire the packed signs too
    assert m2[1]["anchor/bytes_dp_fanout"] == 2 * 16
    assert m2[2]["anchor/bytes_dp_fanout"] == 2 * 16 + sum((n + 7) // 8 for n in owned)


def test_checkpoint_saved_at_dp2_resumes_bit_exactly(runs):
    a, straight = _load(runs[2], "mask", [0, 1, 2, 3])
    b, resumed = _load(runs[2], "resumed", [0, 1, 2, 3])
    assert sorted(b) == [2]
    x, y = dict(a[2]), dict(b[2])
    # as in test_resume: the resumed stages describe their parameters to the anchor again, and the
    # straight run's step 2 carries the anchor's answer to the save at 1 (a few hundred bytes)
    assert y.pop("anchor/bytes_in") > x.pop("anchor/bytes_in")
    out_a, out_b = x.pop("anchor/bytes_out"), y.pop("anchor/bytes_out")
    assert 0 < out_a - out_b < 2048
    for k in (*STEP_TOTALS, *RESUME_VOLATILE):
        x.pop(k), y.pop(k)
    assert x == y, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)}
    for r, (p, q) in enumerate(zip(straight, resumed)):
        wp, wq = _weights(p, r // 2), _weights(q, r // 2)
        assert all(torch.equal(wp[n], wq[n]) for n in wp), r
        assert all(torch.equal(s, t) for s, t in zip(p["signs"], q["signs"])), r


# ----------------------------------------------------------------------------- layout (no launch)

def _cfg(*extra):
    return build_config(parse_args(["--model", "tiny-llama", "--pipeline-model-parallel-size", "2",
                                    "--rollout-batch-size", "2", "--num-generations", "4",
                                    "--micro-batch-size", "2", *extra]))


@pytest.mark.parametrize("world,anchors,dp", [(2, 0, 1), (4, 0, 2), (3, 1, 1), (5, 1, 2), (9, 1, 4)])
def test_data_parallel_size_is_inferred(world, anchors, dp):
    cfg = _cfg("--anchor-ranks", str(anchors)).validate(world_size=world)
    assert cfg.data_parallel_size(world) == dp


@pytest.mark.parametrize("world,anchors,fit", [(4, 1, 3), (3, 0, 2), (6, 1, 5), (1, 0, 2)])
def test_a_world_that_is_not_stages_x_replicas_plus_anchors_stops_with_one_line(world, anchors, fit):
    with pytest.raises(ConfigError, match=rf"^world size {world} minus --anchor-ranks \({anchors}\) leaves") as e:
        _cfg("--anchor-ranks", str(anchors)).validate(world_size=world)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"world size {world} minus --anchor-ranks ({anchors}) leaves {world - anchors} trainer rank")
    assert "not a multiple of --pipeline-model-parallel-size (2)" in msg
    assert f"fix: launch with `deepspeed --num_gpus {fit}` (or `torchrun --nproc-per-node {fit}`)" in msg


def test_replica_rows_split_every_mini_batch_contiguously():
    # 12 rows, mini-batches of 6 (two optimizer steps), 3 replicas: 2 rows of each mini-batch
    assert [replica_rows(12, 6, r, 3).tolist() for r in range(3)] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert replica_rows(8, 8, 0, 1).tolist() == list(range(8))
    with pytest.raises(ValueError, match="12 rows in mini-batches of 6 cannot be shared by 4 replicas"):
        replica_rows(12, 6, 0, 4)


@pytest.mark.parametrize("spec,ok", [("dense", True), ("mask", True), ("rpq:lrq", True), ("rpq/passes=2:lrq", True),
                                     ("mask:lrq", True), ("lrq:lrq", True), ("pcaq:lrq", False),
                                     ("rpq/own=0:lrq", False), ("lowrank", False)])
def test_data_parallel_takes_the_codecs_whose_payloads_depend_on_their_own_micro_batch(spec, ok):
    """``replica_invariant`` codecs run at DP = 2 (with the fidelity probe); a basis kept per step
    (pcaq, rpq/own=0) or per run (lowrank) stops at start-up with one line naming the flag."""
    # keep 0.25: at 0.05 the tiny model's d = 64 leaves e.g. rpq/own=0:lrq over its byte budget (7.06 %), which
    # the run plan refuses too
    cfg = _cfg("--anchor-ranks", "0", "--boundary-codec", spec, "--grad-fidelity-interval", "2",
               "--boundary-keep-ratio", "0.25")
    if ok:
        assert plan_of(cfg, 4).layout.dp == 2
        return
    with pytest.raises(ConfigError, match="^" + re.escape(f"--boundary-codec {spec} keeps a basis")) as e:
        plan_of(cfg, 4)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--boundary-codec {spec} keeps a basis across micro-batches")
    assert "data-parallel replicas (size 2)" in msg and "e.g. rpq:lrq), or launch one replica" in msg
    assert plan_of(cfg, 2).layout.dp == 1  # one replica: accepted
