"""The anchor circuit in real processes: 2 pipeline stages + 1 anchor rank (gloo), tiny model.

c = K = 2 over 6 iterations: fires at 2 (fallback: only theta(0) is old enough), 4 and 6
(secant forecasts). Checks, from the run's dumps and metrics:
- G_anc equals an independent single-process dense gradient (HF model, loss written out)
  at the same forecast weights and batch;
- on every fire step each stage's optimizer consumed G = 0.25 G_comp + 0.75 |G_comp| sign(M)
  with exactly the anchor's sign(M) for that stage's parameters;
- no-peek violations 0, staleness K, the replayed-sequence count, bytes per fire = 1 bit a parameter;
- ``anchor/forecast_error`` of fire 4, logged at fire 6, against the dumped forecasts;
- the shipments (theta(0) not sent: the anchor's own copy has the stages' digests; then int4
  deltas, ``--anchor-ship int4-delta``, the default) and the whole-step ledger (every part's bytes,
  totals = sums of the parts) byte for byte.
"""

import contextlib
import glob
import json
import os
import subprocess

import torch

from distributed_util import PARITY_REWARD as REWARD
from distributed_util import REPO, free_port, run_single, tiny_args
from distributed_util import launcher as _launcher

from megatron_cegrpo.anchor.shipment import shipment_nbytes
from megatron_cegrpo.anchor.worker import global_param_name

KL = 0.01


# iteration 1's 8 responses (2 prompts x 4) all score 0, then the parity reward: the fire at 2
# replays batch 1 (fallback), whose advantages are all 0, so G_anc = 0 and M = 0 (zero-M issue)
LATE_REWARD = REWARD + '''
_CALLS = [0]


def late_parity_reward(response, ground_truth):
    _CALLS[0] += 1
    return 0.0 if _CALLS[0] <= 8 else parity_reward(response, ground_truth)
'''


def _run(tmp_path, *extra, reward="parity_reward"):
    (tmp_path / "reward.py").write_text(LATE_REWARD)
    dump = tmp_path / "dump"
    dump.mkdir()
    cmd = [_launcher("deepspeed"), "--num_gpus", "3", "--master_port", str(free_port()),
           "megatron_cegrpo/train.py",
           *tiny_args(temperature=None, kl_coef=KL, train_iters=6, boundary_codec="mask", anchor_ranks=1,
                      anchor_interval=2, anchor_delay=2),
           "--custom-reward-function", f"{tmp_path / 'reward.py'}:{reward}", "--log-dir", str(tmp_path / "run"),
           "--anchor-debug-dir", str(dump), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-8000:]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return metrics, dump


def test_anchor_gradient_signs_and_correction(tmp_path):
    metrics, dump = _run(tmp_path)
    fires = [m for m in metrics if m["anchor/fire"]]
    assert [m["step"] for m in fires] == [2, 4, 6]
    assert [m["anchor/branch"] for m in fires] == ["fallback", "forecast", "forecast"]
    assert [m["anchor/source_steps"] for m in fires] == [[0], [0, 2], [2, 4]]
    for m in fires:
        assert m["anchor/staleness"] == 2  # = K
        assert m["anchor/no_peek_violations"] == 0
        # the anchor replays each fire's batch once: 2 prompts x 4 responses per fire so far
        assert m["anchor/num_replayed_sequences"] == 8 * (m["step"] // 2)
        assert m["anchor/alive"] == 1
        assert 0.0 < m["anchor/sign_agreement"] < 1.0 and m["anchor/m_norm"] > 0
        assert m["timing_s/anchor_wait"] >= 0
    # every step after the first sign folds the held sign (--sign-fold every-step)
    assert [m["anchor/correction_applied"] for m in metrics] == [0, 1, 1, 1, 1, 1]

    metas = [torch.load(f, weights_only=True) for f in sorted(glob.glob(str(dump / "stage_meta_*.pt")))]
    numel = sum(int(torch.Size(s).numel()) for meta in metas for _, s in meta["params"])
    header = 8 * len(metas)
    for m in fires:
        # sign(M) for each stage, packed 8 a byte, plus an 8-byte header per stage and the stats object
        assert numel // 8 + header <= m["anchor/bytes_out"] <= (numel + 7) // 8 + len(metas) + header + 4096

    _check_ledger(metrics, metas)
    _check_forecast_error(fires, dump)

    for t in (2, 4, 6):
        a = torch.load(dump / f"anchor_fire_{t:05d}.pt", weights_only=True)
        # G_anc against an independent dense gradient at the same weights and batch
        out = tmp_path / f"ref_{t}.pt"
        run_single([os.path.join(REPO, "tests", "anchor", "anchor_reference.py"),
                    str(dump / f"anchor_fire_{t:05d}.pt"), str(out), str(KL)])
        ref = torch.load(out, weights_only=True)
        assert set(ref) == set(a["grads"])
        for k in ref:
            torch.testing.assert_close(a["grads"][k], ref[k], rtol=1e-4, atol=1e-6, msg=lambda s: f"{k}: {s}")
        # the optimizer consumed the formula with the anchor's signs, on every stage
        for r, meta in enumerate(metas):
            d = torch.load(dump / f"stage{r}_step{t:05d}.pt", weights_only=True)
            for (name, _), g_comp, sign, g in zip(meta["params"], d["g_comp"], d["signs"], d["g"]):
                gname = global_param_name(name, meta["layer_offset"], meta["tied_output"])
                assert torch.equal(sign, a["signs"][gname]), name
                torch.testing.assert_close(g, 0.25 * g_comp + 0.75 * g_comp.abs() * sign, rtol=0, atol=0)


def _check_forecast_error(fires, dump):
    """``anchor/forecast_error`` (issue 31 item 4): fire 4's forecast, scored when theta(4) arrived,
    logged at fire 6 = 4 + K. The true weights come back from the dumped forecasts (h = 1 at
    c = K = 2): fire 2 replays theta(0), fire 4 theta(2) + (theta(2) - theta(0)), fire 6
    theta(4) + (theta(4) - theta(2))."""
    assert [("anchor/forecast_error" in m) for m in fires] == [False, False, True]
    assert fires[2]["anchor/forecast_error_step"] == 4
    f = {t: torch.load(dump / f"anchor_fire_{t:05d}.pt", weights_only=True)["weights"] for t in (2, 4, 6)}
    num = den = 0.0
    for k, theta0 in f[2].items():
        theta2 = (f[4][k].double() + theta0.double()) / 2
        theta4 = (f[6][k].double() + theta2) / 2
        num += float((f[4][k].double() - theta4).square().sum())
        den += float((theta2 - theta4).square().sum())
    assert abs(fires[2]["anchor/forecast_error"] - (num / den) ** 0.5) < 1e-2 * (num / den) ** 0.5


def _numel(meta):
    return sum(int(torch.Size(s).numel()) for _, s in meta["params"])


def _check_ledger(metrics, metas):
    """Shipments and the whole-step ledger, exactly (issue 12 items 1 and 4)."""
    numel = sum(_numel(meta) for meta in metas)
    # W's shape from whichever stage ships it (the first stage's embedding or the last stage's tied copy)
    embd = next(s for meta in metas for n, s in meta["params"]
                if n in ("embedding.word_embeddings.weight", "output_layer.weight"))
    for m in metrics:
        ship = (m["step"] - 1) % 2 == 0  # theta(0), theta(2), theta(4) at steps 1, 3, 5
        # theta(0) is not sent (the start-up digests agreed), int4 deltas after it: a scale per block
        # of 256 values and half a byte a value, per stage; the dense reference ships fp32 every time
        coded = sum(shipment_nbytes(_numel(meta), "int4-delta", keyframe=False) for meta in metas)
        assert m["anchor/bytes_ship"] == (coded if ship and m["step"] > 1 else 0)
        assert m["anchor/bytes_ship_fp32"] == (4 * numel if ship else 0)
        # the tied embedding's dense fp32 gradient, both ways, each optimizer step; the sampler's fp32
        # copy of stage 1 (stage 0 is the driver's own)
        assert m["comm/embd_sync_dense_bytes"] == 2 * 4 * embd[0] * embd[1] * m["actor/num_optimizer_steps"]
        assert m["sync/dense_fp32_bytes"] == 4 * _numel(metas[1])
        assert m["comm/batch_bytes"] > 0
        sent = (m["comm/fwd_bytes"] + m["comm/bwd_bytes"] + m["comm/batch_bytes"] + m["comm/embd_sync_bytes"]
                + m["sync/bytes"] + m["anchor/bytes_in"] + m["anchor/bytes_out"])
        dense = (m["comm/dense_equiv_bytes"] + m["comm/batch_bytes"] + m["comm/embd_sync_dense_bytes"]
                 + m["sync/dense_fp32_bytes"] + m["anchor/bytes_in"] + m["anchor/bytes_out"] - m["anchor/bytes_ship"]
                 + m["anchor/bytes_ship_fp32"])
        assert m["comm/total_bytes"] == sent and m["comm/total_dense_bytes"] == dense
        assert m["comm/total_ratio"] == sent / dense < 1


@contextlib.contextmanager
def _threads(n):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def test_fire_only_fold_and_next_step_apply(tmp_path):
    # (with the constant-magnitude ablation of the blend, --sign-blend-magnitude mean; and batch 1
    # without a reward, so that the fire at 2 has M = 0: the zero-M issue)
    metrics, dump = _run(tmp_path, "--sign-fold", "fire-only", "--anchor-apply", "next-step",
                         "--sign-blend-magnitude", "mean", reward="late_parity_reward")
    assert metrics[0]["critic/score/mean"] == 0.0
    # the anchor's statistics of fire t reach the driver with its signs, at step t + 1
    fires = [m for m in metrics if "anchor/replay_batch" in m]
    assert [(m["step"], m["anchor/replay_batch"]) for m in fires][:2] == [(3, 1), (5, 4)]
    # fire 2 replayed the reward-free batch: M is 0 everywhere, so no sign is sent and step 3 (which
    # takes fire 2's signs) applies no correction: its gradients are the raw ones (the hook is not
    # entered, no dump); before the fix sign(0) = +1 everywhere was folded there
    assert fires[0]["anchor/m_norm"] == 0.0 and fires[0]["anchor/m_zero_frac"] == 1.0
    assert all(0.0 <= m["anchor/m_zero_frac"] < 1.0 and m["anchor/m_norm"] > 0 for m in fires[1:])
    metas = [torch.load(f, weights_only=True) for f in sorted(glob.glob(str(dump / "stage_meta_*.pt")))]
    # fire 2's answer (received at step 3): an 8-byte header and a 1-byte all-0 "informative"
    # bitmap per stage and the statistics, no signs (1 bit a parameter would be numel / 8 bytes)
    numel = sum(_numel(meta) for meta in metas)
    assert len(metas) * (8 + 1) < metrics[2]["anchor/bytes_out"] <= len(metas) * (8 + 1) + 4096 < numel // 8
    # the sign of fire t is taken at step t + 1 and folded only there (fire 4's at 5)
    assert [m["anchor/correction_applied"] for m in metrics] == [0, 0, 0, 0, 1, 0]
    assert [m["anchor/fire"] for m in metrics] == [0, 1, 0, 1, 0, 1]
    assert all(m["anchor/no_peek_violations"] == 0 for m in metrics if "anchor/no_peek_violations" in m)
    steps = sorted(os.path.basename(f) for f in glob.glob(str(dump / "stage0_step*.pt")))
    assert steps == ["stage0_step00005.pt"]
    for f in glob.glob(str(dump / "stage*_step*.pt")):
        d = torch.load(f, weights_only=True)
        for g_comp, sign, g in zip(d["g_comp"], d["signs"], d["g"]):
            # the ranks ran with --num-threads 1: a mean over millions of entries rounds by its thread count
            with _threads(1):
                torch.testing.assert_close(g, 0.25 * g_comp + 0.75 * g_comp.abs().mean() * sign, rtol=0, atol=0)
