"""The anchor at TP x PP x DP (issue 14): TP = 2 x PP = 2 x DP = 2 + 1 anchor rank (9 real gloo ranks)
trains like the recorded TP = 1 x PP = 2 + 1 anchor rank run.

``@slow`` (one 9-rank launch: 800 s on the 2-core machine beside the study, niced); the default suite's fast checks
are ``tests/anchor/test_tp_split.py``, ``tests/anchor/test_dp_fanout.py``, ``tests/anchor/test_tp_dp.py``
(the composition on 4 gloo processes) and ``test_tp2_pp2_x_dp_with_an_anchor_rank_validates`` in
``test_tensor_parallel_train.py`` (the layout passes the start-up checks).

``tp_anchor_worker.py`` unchanged (tiny-llama, mask codec, KL, 3 iterations of 8 sequences, the anchor
firing every iteration: c = K = 1, fire 1 falls back to theta(0), fires 2 and 3 are secant forecasts),
launched with 9 ranks, so DP = 2 is inferred: each replica runs 4 of the 8 rows (2 micro-batches of 2),
the same global batch as the record ``reference/tp_anchor_tp1_pp2.json`` (shared with
``test_tensor_parallel_anchor.py``). Rank order (megatron-core's, TP fastest): rank r is TP rank
``r % 2``, replica ``(r // 2) % 2``, stage ``r // 4``; rank 8 is the anchor.

Who sends what (``anchor/relay.py``): (replica 0, TP rank 0) of each stage alone talks to the anchor
(the TP = 1 stage's shipments and signs: every anchor-link byte equals the record's); it broadcasts the
whole-stage signs to TP rank 0 of replica 1 over their DP group (``anchor/bytes_dp_fanout``), and each
replica's TP rank 0 sends its TP rank 1 that rank's shard (``anchor/bytes_tp_fanout``).

Tolerances: those of ``test_tensor_parallel_anchor.py`` (the TP = 2 record comparison; its docstring
gives the reasons: fp32 reduction order amplified by Adam where a gradient is tiny, so sign(M) may
flip where M is within that noise of 0), which already cover DP's extra reduction order (the DP = 2
partial gradient sums, bounded by ``1e-5`` in ``test_tensor_data_parallel.py``). No new tolerance.
Asserted exactly: ``anchor/sign_dev_across_dp`` = 0 on every step, every rank's applied signs =
its TP slice of the anchor's whole sign(M) (bit for bit, both replicas), the replicas' weights
bit-identical, the fan-out bytes from the parameter counts.
"""

import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from distributed_util import PARITY_REWARD, run_ranks  # noqa: E402
import test_tensor_parallel_anchor as tpa  # noqa: E402
import test_tensor_parallel_train as tpt  # noqa: E402

TP, PP, DP = 2, 2, 2
WORLD = TP * PP * DP + 1
#: equal to the TP = 1 record except the driver's batch scatter (each replica gets its rows)
EQUAL_KEYS = tuple(k for k in tpa.EQUAL_KEYS if k != "comm/batch_bytes")


def launch(out_dir, run="run", *flags) -> None:
    """``tp_anchor_worker.py`` at TP 2 x PP 2 x DP 2 + 1 anchor into ``out_dir/run``."""
    os.makedirs(os.path.join(out_dir, run, "dump"), exist_ok=True)
    with open(os.path.join(out_dir, "reward.py"), "w") as f:
        f.write(PARITY_REWARD)
    run_ranks([tpa.WORKER, str(out_dir), str(TP), *flags], WORLD, timeout=1500, env={"CEGRPO_TEST_RUN": run})


def load_replicas(out_dir, run="run"):
    """{dp_rank: [(whole params, whole theta_0) per stage]} and the 8 trainer ranks' dumps."""
    from megatron_cegrpo.models.tp_shard import merge_tp_shards

    dumps = [torch.load(os.path.join(out_dir, run, f"rank{r}.pt")) for r in range(TP * PP * DP)]
    for r, d in enumerate(dumps):
        assert (d["tp_rank"], d["dp_rank"], d["pp_rank"]) == (r % TP, (r // TP) % DP, r // (TP * DP)), r
    out = {}
    for dp in range(DP):
        out[dp] = []
        for pp in range(PP):
            shards = sorted((d for d in dumps if d["pp_rank"] == pp and d["dp_rank"] == dp), key=lambda d: d["tp_rank"])
            out[dp].append(tuple(merge_tp_shards([d[k] for d in shards]) for k in ("params", "theta0")))
    return out, dumps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2dp2_anchor")
    launch(d)
    return d


pytestmark = pytest.mark.slow


def test_tp2_dp2_anchor_trains_like_the_recorded_tp1_anchor_run(run):
    ref = tpt.read_reference(tpa.REFERENCE)
    m, m1 = tpt.load_metrics(run, "run"), ref["metrics"]
    assert sorted(m) == sorted(m1) == list(tpa.STEPS)
    assert [m[t]["anchor/branch"] for t in tpa.STEPS] == ["fallback", "forecast", "forecast"]
    assert [m[t]["anchor/correction_applied"] for t in tpa.STEPS] == [1, 1, 1]
    worst = {}
    for t in tpa.STEPS:
        assert m[t]["anchor/sign_dev_across_dp"] == 0, t  # every replica applies the identical signs
        for k in tpa.CLOSE_KEYS + ("anchor/sign_agreement",):
            assert (k in m1[t]) == (k in m[t]), (t, k)
            if k in m1[t]:
                a, b = m1[t][k], m[t][k]
                worst[k] = max(worst.get(k, 0.0), abs(a - b) / abs(a) if a else abs(b))
                assert tpa._close(k, a, b), (t, k, a, b)
        for k in EQUAL_KEYS:
            assert m[t].get(k) == m1[t].get(k), (t, k, m1[t].get(k), m[t].get(k))
    replicas, _ = load_replicas(run)
    w_abs = norm_rel = 0.0
    for key, r in ref["weights"].items():
        pp, name = key.split("/", 1)
        params, theta0 = replicas[0][int(pp)]
        flat = params[name].reshape(-1)
        got = torch.tensor([float(flat[i]) for i in r["idx"]], dtype=torch.float64)
        w_abs = max(w_abs, float((got - torch.tensor(r["val"], dtype=torch.float64)).abs().max()))
        norm = float((params[name].double() - theta0[name].double()).norm())
        norm_rel = max(norm_rel, abs(norm - r["delta_norm"]) / max(r["delta_norm"], 1e-30))
        assert math.isclose(norm, r["delta_norm"], rel_tol=tpa.NORM_REL, abs_tol=1e-9), (key, norm, r["delta_norm"])
    print(f"\nTP2 x PP2 x DP2 + anchor vs the TP1 record: weights {w_abs:.3g} abs, ||theta - theta_0|| {norm_rel:.3g} "
          "rel; " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
    assert w_abs <= tpa.W_ABS, w_abs


def test_every_rank_applies_its_slice_of_the_anchors_whole_signs(run):
    """From the dumps: each (replica, TP rank)'s hook applied exactly its TP slice of the anchor's whole
    sign(M) of each fire, bit for bit, and ``0.25 G_comp + 0.75 |G_comp| sign``."""
    from megatron_cegrpo.anchor.worker import global_param_name
    from megatron_cegrpo.models.tp_shard import shard_tensor

    dump = os.path.join(run, "run", "dump")
    metas = [torch.load(os.path.join(dump, f"stage_meta_{o:04d}.pt")) for o in (0, 2)]
    checked = 0
    for t in tpa.STEPS:
        whole = torch.load(os.path.join(dump, f"anchor_fire_{t:05d}.pt"))["signs"]
        for pp, meta in enumerate(metas):
            for dp in range(DP):
                for r in range(TP):
                    hook = torch.load(os.path.join(dump, f"stage{pp}_tp{r:02d}_dp{dp:02d}_step{t:05d}.pt"))
                    assert len(hook["signs"]) == len(meta["params"])
                    for (name, _), s, g0, g in zip(meta["params"], hook["signs"], hook["g_comp"], hook["g"]):
                        w = whole[global_param_name(name, meta["layer_offset"], meta["tied_output"])]
                        assert s is not None and torch.equal(s, shard_tensor(name, w, r, TP).to(s.dtype)), (t, pp, dp, r, name)
                        assert torch.equal(g, 0.25 * g0 + 0.75 * g0.abs() * s), (t, pp, dp, r, name)
                        checked += 1
    assert checked == len(tpa.STEPS) * DP * TP * sum(len(m["params"]) for m in metas)


def test_fanout_bytes_whole_signs_over_dp_and_one_shard_over_tp(run):
    """Per step with new signs (every step here): ``anchor/bytes_dp_fanout`` = per stage one 16-byte
    header and the whole stage's packed signs to the (DP - 1) other TP-rank-0s; ``anchor/bytes_tp_fanout``
    = per stage and replica a header and TP rank 1's packed shard."""
    from megatron_cegrpo.anchor.signs import packed_nbytes

    m = tpt.load_metrics(run, "run")
    _, dumps = load_replicas(run)
    metas = [torch.load(os.path.join(run, "run", "dump", f"stage_meta_{o:04d}.pt")) for o in (0, 2)]
    whole = [sum(int(torch.Size(s).numel()) for _, s in meta["params"]) for meta in metas]
    shard = {d["pp_rank"]: sum(d["params"][n].numel() for n in d["owned"])
             for d in dumps if d["tp_rank"] == 1 and d["dp_rank"] == 0}
    for t in tpa.STEPS:
        assert m[t]["anchor/bytes_dp_fanout"] == sum((DP - 1) * (16 + packed_nbytes(n)) for n in whole), t
        assert m[t]["anchor/bytes_tp_fanout"] == DP * sum((TP - 1) * 16 + packed_nbytes(n) for n in shard.values()), t


def test_replicas_hold_bit_identical_weights_with_the_anchor(run):
    _, dumps = load_replicas(run)
    for r, d in enumerate(dumps):
        if d["dp_rank"] == 0:
            other = dumps[r + TP]
            for n, p in d["params"].items():
                if not (d["pp_rank"] == 0 and n == tpt.CACHE):  # a row cache of the replica's own tokens
                    assert torch.equal(p, other["params"][n]), (r, n)
