"""End to end: the real launchers (deepspeed, torchrun) run GRPO on a tiny random model, PP=2.

The tiny model's random responses never solve a math problem, so the reward here is a
custom reward function (``--custom-reward-function``) that scores the response length's
parity: groups get mixed rewards, advantages are non-zero and every stage must move.
"""

import json
import math
import os
import subprocess
import sys


from distributed_util import PARITY_REWARD, REPO, free_port, launcher, load_tool, tiny_args
from megatron_cegrpo.training.weight_trace import read_trace


REWARD = PARITY_REWARD

COMMON = tiny_args(kl_coef=None, train_iters=3, drift_probe_interval=2, anchor_ranks=0)


RUNS = {}  # run dirs of this module's training runs, for the plotting test at the end


def _run(cmd, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-8000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    RUNS[cmd[cmd.index("--boundary-codec") + 1]] = tmp_path / "run"
    return [json.loads(x) for x in lines], p.stdout


def _common_checks(metrics):
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                  "mismatch/abs_logprob_diff_mean", "critic/score/mean", "response_length/mean"):
            assert isinstance(m[k], float) and math.isfinite(m[k]), (k, m[k])
        assert 0.0 <= m["critic/score/mean"] <= 1.0
        for phase in ("gen", "reward", "ref", "update", "sync"):
            assert m[f"timing_s/{phase}"] >= 0.0
        # one optimizer step per iteration: the old log-probs come from the update pass, no pass of their own
        assert "timing_s/old_log_prob" not in m and m["actor/ppo_kl"] == 0.0
    # mixed parity rewards -> non-zero gradients -> both stages moved
    assert max(m["actor/grad_norm"] for m in metrics) > 0
    last = metrics[-1]
    assert last["actor/weight_rel_change/stage_0"] > 0
    assert last["actor/weight_rel_change/stage_1"] > 0


def test_deepspeed_launcher_mask_codec(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    cmd = [launcher("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "megatron_cegrpo/train.py", *COMMON, "--boundary-codec", "mask", "--boundary-keep-ratio", "0.05",
           "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
           "--log-dir", str(tmp_path / "run"), "--log-weight-sample", "500"]
    metrics, out = _run(cmd, tmp_path)
    _common_checks(metrics)
    # --log-weight-sample: each stage's 500 coordinates at the start and after every iteration
    for stage in (0, 1):
        meta = json.loads((tmp_path / "run" / "weight_trace" / f"stage{stage}_tp0.json").read_text())
        assert meta["coordinates"] == 500 and sum(p["count"] for p in meta["sampled"]) == 500
        trace = read_trace(str(tmp_path / "run" / "weight_trace" / f"stage{stage}_tp0.bin"), 500)
        assert sorted(trace) == [0, 1, 2, 3]
        assert all((trace[t] != trace[t - 1]).any() for t in (1, 2, 3))  # every stage moved every step
    assert load_tool("forecast_report").main([str(tmp_path / "run"), "--cadence", "1:1"]) == 0
    for m in metrics:
        # tiny-llama: d = 64, k = ceil(0.05 * 64) = 4; measured by the meter, fwd + bwd
        assert m["comm/bytes_ratio"] == 4 / 64
        assert m["comm/fwd_bytes"] > 0 and m["comm/bwd_bytes"] > 0
        assert m["comm/fwd_bytes"] + m["comm/bwd_bytes"] == m["comm/dense_equiv_bytes"] * 4 / 64
    assert "iter    3/3" in out
    # drift probe (step 2 only): the compression view differs from the dense view
    assert "probe/view_abs_logprob_diff" not in metrics[0]
    assert metrics[1]["probe/view_abs_logprob_diff"] > 1e-3
    # dense trainer vs the dense sampler, which holds the trainer's weights rounded to bf16 (the
    # default --rollout-dtype bf16): bf16's rounding only (5e-4 here; a stale sampler is > 1e-1)
    assert metrics[1]["probe/abs_logprob_diff_mean"] < 3e-3
    assert metrics[1]["comm/bytes_ratio"] == 4 / 64  # probe traffic is billed separately


def test_torchrun_dense_codec_has_no_mismatch(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "megatron_cegrpo/train.py", *COMMON,
           "--boundary-codec", "dense", "--tied-embedding-sync", "allreduce", "--rollout-dtype", "fp32",
           "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
           "--log-dir", str(tmp_path / "run")]
    cmd += ["--eval-interval", "3", "--eval-datasets", "mawps,gsm8k/test", "--eval-limit", "2",
            "--eval-max-new-tokens", "4"]
    metrics, _ = _run(cmd, tmp_path)
    evals = [m for m in metrics if "val/mawps/acc" in m]
    assert [m["step"] for m in evals] == [0, 3]  # before training and at --eval-interval
    assert all(m["val/mawps/num_rows"] == 2 and m["val/gsm8k/test/num_rows"] == 2 for m in evals)
    metrics = [m for m in metrics if m["step"] > 0]
    _common_checks(metrics)
    for m in metrics:
        assert m["comm/bytes_ratio"] == 1.0
        # dense everywhere (the tied embedding all-reduced) and no anchor: the whole step is its own
        # dense-everything reference
        assert m["comm/total_bytes"] == m["comm/total_dense_bytes"] > m["comm/dense_equiv_bytes"] > 0
        assert m["comm/total_ratio"] == 1.0
        # the dense pipeline and the sampler hold the same weights: log-probs agree
        assert m["mismatch/abs_logprob_diff_mean"] < 1e-4, m["mismatch/abs_logprob_diff_mean"]
    assert metrics[0]["actor/kl_loss"] == 0.0  # reference == policy before the first step
    # drift probe with the dense codec: both views are the same computation
    assert metrics[1]["probe/view_abs_logprob_diff"] == 0.0
    assert metrics[1]["probe/kl_to_ref"] == metrics[1]["probe/kl_to_ref_compressed"]


def test_plot_runs_on_the_two_real_runs(tmp_path):
    """tools/plot_runs.py on the metrics of the two launches above (mask and dense)."""
    import pytest
    from PIL import Image

    if set(RUNS) != {"mask", "dense"}:
        pytest.skip("needs the two training runs of this module (run the whole file)")
    out = tmp_path / "figs"
    p = subprocess.run([sys.executable, "tools/plot_runs.py", str(RUNS["mask"]), str(RUNS["dense"]),
                        "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:]
    for name in ("reward.png", "entropy.png", "kl_to_ref.png", "mismatch.png"):
        path = out / name
        assert path.stat().st_size > 5000, name
        with Image.open(path) as im:
            assert im.size[0] > 300 and im.size[1] > 200
