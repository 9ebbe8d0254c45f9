"""verl's rollout correction (``--rollout-is``, ``--rollout-rs``) in a real training launch (2 ranks, PP =
2, 2 iterations, fp32 sampler):

* with the dense codec the trainer's log-probs are the sampler's to fp32 rounding, so every ratio is
  1 within 1e-5: nothing is rejected, the weights' mean is 1, and every metric of the uncorrected
  run is reproduced within relative 1e-4 / absolute 1e-6 (the timers aside);
* through the 5 % mask the ratios spread (the compressed view's mismatch, 0.16 nats a token on this
  tiny random model): tokens are rejected, the rejected share is at least the share outside the
  weights' truncation band [1/1.2, 1.2] (the rejection's band [1/1.1, 1.1] lies inside it), and the
  run's losses differ from the uncorrected one's."""

import json
import math
import os
import subprocess

from distributed_util import REPO, free_port, tiny_args
from distributed_util import PARITY_REWARD as REWARD, launcher
from megatron_cegrpo.training.perf import without_wall_clock

CORRECT = ("--rollout-is", "token", "--rollout-rs", "token")
RC = "rollout_corr/"
REL, ABS = 1e-4, 1e-6


def _run(tmp_path, name, codec, *extra):
    out = tmp_path / name
    args = tiny_args(kl_coef=0, rollout_dtype="fp32", boundary_codec=codec, anchor_ranks=0, train_iters=2)
    cmd = [launcher("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "megatron_cegrpo/train.py",
           *args, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", "--log-dir", str(out), *extra]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:]
    return [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()]


def test_rollout_correction_is_the_identity_on_a_dense_boundary_and_rejects_through_the_mask(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    plain = _run(tmp_path, "dense", "dense")
    corrected = _run(tmp_path, "dense_rc", "dense", *CORRECT)
    assert [r["step"] for r in plain] == [r["step"] for r in corrected] == [1, 2]
    for a, b in zip(corrected, plain):
        assert not any(k.startswith(RC) for k in b)
        assert a[RC + "rollout_is_masked_fraction"] == 0.0 and a[RC + "rollout_is_veto_fraction"] == 0.0
        assert a[RC + "rollout_is_ratio_fraction_high"] == 0.0 == a[RC + "rollout_is_ratio_fraction_low"]
        assert math.isclose(a[RC + "rollout_is_mean"], 1.0, abs_tol=1e-5)
        keys = set(without_wall_clock(b))
        off = [(k, a[k], b[k]) for k in sorted(keys) if not (
            math.isclose(a[k], b[k], rel_tol=REL, abs_tol=ABS) if isinstance(b[k], (int, float)) else a[k] == b[k])]
        assert off == [], (a["step"], off)

    masked = _run(tmp_path, "mask", "mask")
    masked_rc = _run(tmp_path, "mask_rc", "mask", *CORRECT, "--rollout-is-threshold", "1.2",
                     "--rollout-rs-threshold", "1.1")
    for a, b in zip(masked_rc, masked):
        rejected = a[RC + "rollout_is_masked_fraction"]
        outside = a[RC + "rollout_is_ratio_fraction_high"] + a[RC + "rollout_is_ratio_fraction_low"]
        assert 0.0 < outside <= rejected < 1.0, a
        assert a[RC + "rollout_is_mean"] != 1.0 and a["mismatch/abs_logprob_diff_mean"] > 1e-3
        # the same samples at step 1 (the sampler has the same weights), a different loss
        assert a["critic/score/mean"] == b["critic/score/mean"] or a["step"] > 1
        assert a["actor/pg_loss"] != b["actor/pg_loss"]
