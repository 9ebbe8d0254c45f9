"""The old log-probs taken from the update pass (``TrainConfig.old_log_prob_from_update``: one
optimizer step over the whole batch) give the same run, bit for bit, as the separate forward pass
(``--recompute-old-log-prob``): every metric but the timers and the boundary bytes (one forward
crossing less), and the final weights.

Tiny random model, PP=2, mask codec, no KL term (the main job's objective), the drift probe on
every iteration (its compressed-view numbers read the old log-probs after the update there)."""

import json
import os
import subprocess

import torch
from safetensors.torch import load_file

from distributed_util import REPO, free_port, metric_diffs, tiny_args
from distributed_util import PARITY_REWARD as REWARD, launcher
from megatron_cegrpo.training.perf import without_wall_clock

ARGS = tiny_args(kl_coef=0, boundary_codec="mask", anchor_ranks=0, drift_probe_interval=1, train_iters=3)


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    cmd = [launcher("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "megatron_cegrpo/train.py",
           *ARGS, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", "--log-dir", str(out),
           "--save", str(out / "ckpt"), "--save-interval", "3", *extra]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:]
    recs = [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()]
    weights = [load_file(str(out / "ckpt" / "iter_0000003" / f"stage_{r:02d}" / "model.safetensors")) for r in (0, 1)]
    return recs, weights


def test_update_pass_old_log_probs_equal_the_separate_pass(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    fused, w_fused = _run(tmp_path, "fused")
    separate, w_sep = _run(tmp_path, "separate", "--recompute-old-log-prob")
    assert [r["step"] for r in fused] == [r["step"] for r in separate] == [1, 2, 3]
    for a, b in zip(fused, separate):
        assert "timing_s/old_log_prob" in b and "timing_s/old_log_prob" not in a
        ka = set(without_wall_clock(a, ("comm/",)))
        kb = set(without_wall_clock(b, ("comm/",)))
        assert ka == kb
        diffs = metric_diffs({k: a[k] for k in ka}, {k: b[k] for k in kb})
        assert not diffs, (a["step"], diffs)
        assert a["actor/ppo_kl"] == 0.0 and a["actor/pg_clipfrac"] == 0.0
        assert "mismatch/abs_logprob_diff_mean" in a and "probe/view_abs_logprob_diff" in a
        # the boundary is crossed forward once per micro-batch instead of twice (no old-logprob pass)
        assert 2 * a["comm/fwd_bytes"] == b["comm/fwd_bytes"] > 0
        assert a["comm/bwd_bytes"] == b["comm/bwd_bytes"] > 0
    for x, y in zip(w_fused, w_sep):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
