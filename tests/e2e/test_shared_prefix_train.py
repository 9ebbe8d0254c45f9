"""``--shared-prefix`` in a real training launch (2 ranks, PP = 2, dense codec, a KL term so the
reference pass runs too, 2 iterations): every logged metric equals the unshared run's within the
fp32 tolerance of the passes (relative 1e-4, absolute 1e-6: the mismatch means, sampler minus trainer
log-probs averaged over the tokens, sit near 0 and differed by 1.1e-7 nats at step 2; the timers,
boundary bytes and update FLOPs aside), and the boundary bytes and update FLOPs of each iteration
are smaller (each prompt crosses, and is computed, once per group of 4).

With an anchor rank (3 ranks, c = K = 1) the anchor's dense replay (a PP = 1 replica,
``anchor/replay.py``) runs shared too: the rollout batch it receives carries the prompt and
response lengths, and its momentum's norm at the first fire, before any sign reaches the trainer,
equals the unshared run's within the same tolerance."""

import json
import math
import os
import subprocess

from distributed_util import REPO, free_port, tiny_args
from distributed_util import PARITY_REWARD as REWARD, launcher
from megatron_cegrpo.training.perf import without_wall_clock

ARGS = tiny_args(kl_coef=0.05, rollout_dtype="fp32", boundary_codec="dense", anchor_ranks=0, train_iters=2)
REL, ABS = 1e-4, 1e-6


def _run(tmp_path, name, *extra, args=ARGS, ranks=2):
    out = tmp_path / name
    cmd = [launcher("deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), "megatron_cegrpo/train.py",
           *args, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", "--log-dir", str(out), *extra]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:]
    return [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()]


def test_shared_prefix_launch_equals_unshared(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    plain = _run(tmp_path, "plain")
    shared = _run(tmp_path, "shared", "--shared-prefix")
    assert [r["step"] for r in plain] == [r["step"] for r in shared] == [1, 2]
    for a, b in zip(shared, plain):
        keys = set(without_wall_clock(b, ("comm/", "perf/update_flops")))
        assert keys == set(without_wall_clock(a, ("comm/", "perf/update_flops")))
        # the update pass's FLOPs at the packed shape it computed (tests/pipeline/test_shared_prefix_pp1.py)
        assert 0 < a["perf/update_flops"] < b["perf/update_flops"]
        assert b["actor/kl_loss"] != 0.0 or b["step"] == 1
        off = [(k, a[k], b[k]) for k in sorted(keys) if not (
            math.isclose(a[k], b[k], rel_tol=REL, abs_tol=ABS) if isinstance(b[k], (int, float)) else a[k] == b[k])]
        assert off == [], (a["step"], off)
        assert 0 < a["comm/fwd_bytes"] < b["comm/fwd_bytes"] and 0 < a["comm/bwd_bytes"] < b["comm/bwd_bytes"]
        print(f"step {a['step']}: fwd bytes shared/unshared {a['comm/fwd_bytes'] / b['comm/fwd_bytes']:.4f}, "
              f"bwd {a['comm/bwd_bytes'] / b['comm/bwd_bytes']:.4f}")


def test_shared_prefix_anchor_replay_in_a_launch(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    args = tiny_args(kl_coef=0.05, rollout_dtype="fp32", boundary_codec="dense", anchor_ranks=1, anchor_interval=1,
                     anchor_delay=1, train_iters=2)
    plain = _run(tmp_path, "plain", args=args, ranks=3)
    shared = _run(tmp_path, "shared", "--shared-prefix", args=args, ranks=3)
    fires_p = [r for r in plain if "anchor/m_norm" in r]
    fires_s = [r for r in shared if "anchor/m_norm" in r]
    assert [r["step"] for r in fires_s] == [r["step"] for r in fires_p] and fires_p, plain
    first_p, first_s = fires_p[0], fires_s[0]
    assert first_s["anchor/num_replayed_sequences"] == first_p["anchor/num_replayed_sequences"] > 0
    # the lengths went with the batch: 2 x 8 bytes a row more, everything else the same
    assert first_s["anchor/received_bytes_total"] > first_p["anchor/received_bytes_total"]
    assert first_p["anchor/m_norm"] > 0
    assert math.isclose(first_s["anchor/m_norm"], first_p["anchor/m_norm"], rel_tol=REL, abs_tol=ABS), (
        first_s["anchor/m_norm"], first_p["anchor/m_norm"])
