"""End to end with ``--boundary-codec lowrank`` (issue 10 item 3), deepspeed launcher, tiny model, PP=2.

- fast-owned basis, no anchor: trains; the meter's bytes are exactly the coefficients of every
  pass plus one [d, r] basis per iteration (d = 64, r = 2: T = 8 x 12 x 3 = 288 boundary tokens
  per iteration, the old log-probs coming from the update pass, r = floor(0.05 * 64 * 288 / (288 + 64))
  = 2).
- anchor-owned basis, anchor c = K = 1 (a fire every iteration): the anchor's bases reach both
  stages (anchor/bytes_out counts them), and the straight run's iteration 4 equals iteration 4
  resumed from its checkpoint at 3, bit for bit (metrics and weights). (Resuming at iteration 3 was
  not bit-exact with any codec: DeepSpeedCPUAdam's C++ side recomputed beta2^3 with
  ``pow`` after a restart instead of its running product, 1 ulp apart in fp32 for 0.999;
  deepspeed/ops/csrc/includes/cpu_adam.h ``IncrementStep``. The optimizer now replays the
  product on load: optim/factory.replay_cpu_adam_bias_correction.)
- anchor-owned basis under ``--bf16``: the bases travel in the pipeline dtype (bf16) and both
  stages hold the same one.
"""

import json
import os
import subprocess

import torch
from safetensors.torch import load_file

from distributed_util import PARITY_REWARD, REPO, RESUME_VOLATILE, STEP_TOTALS, free_port, launcher, tiny_args
from megatron_cegrpo.training.perf import without_wall_clock
from megatron_cegrpo.compression.lowrank import initial_basis

D, R = 64, 2
ARGS = tiny_args(boundary_codec="lowrank", boundary_keep_ratio=0.05)


def _train(tmp_path, name, anchors, *extra):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    cmd = [launcher("deepspeed"), "--num_gpus", str(2 + anchors), "--master_port", str(free_port()),
           "megatron_cegrpo/train.py", *ARGS, "--anchor-ranks", str(anchors), "--log-dir", str(tmp_path / name),
           "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", *extra]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-8000:]
    return {m["step"]: m for m in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "step" in m and "comm/fwd_bytes" in m}


def test_lowrank_fast_owned_basis_trains_and_meters_exact_bytes(tmp_path):
    metrics = _train(tmp_path, "fast", 0, "--train-iters", "2")
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        tokens = m["comm/dense_equiv_bytes"] // (4 * D)  # boundary token crossings, all passes
        assert m["comm/basis_bytes"] == D * R * 4
        assert m["comm/fwd_bytes"] + m["comm/bwd_bytes"] == tokens * R * 4 + D * R * 4
        assert m["comm/bwd_bytes"] == tokens // 3 * R * 4  # one of the 3 crossings is backward
        assert m["comm/bytes_ratio"] <= 0.05
        assert m["mismatch/abs_logprob_diff_mean"] > 0
    assert metrics[2]["actor/weight_rel_change/stage_0"] > 0


def _weights(ckpt):
    return [load_file(os.path.join(ckpt, "iter_0000004", f"stage_{r:02d}", "model.safetensors")) for r in range(2)]


def test_lowrank_anchor_owned_basis_resumes_bit_exactly(tmp_path):
    anchor = ["--anchor-interval", "1", "--anchor-delay", "1", "--lowrank-q-owner", "anchor"]
    straight = _train(tmp_path, "straight", 1, *anchor, "--train-iters", "4", "--save", str(tmp_path / "ck1"),
                      "--save-interval", "3")
    # every fire sends sign(M) and one [d, r] basis to each stage: more bytes than the signs alone
    for t in (1, 2, 3, 4):
        assert straight[t]["anchor/fire"] == 1 and straight[t]["anchor/bytes_out"] >= 2 * (8 + D * R * 4)
        assert "comm/basis_bytes" not in straight[t]  # the pipeline ships no basis
    # resume from the straight run's checkpoint at 3 (a committed iter_ directory) to 4
    resumed = _train(tmp_path, "resumed", 1, *anchor, "--train-iters", "4",
                     "--load", str(tmp_path / "ck1" / "iter_0000003"), "--save", str(tmp_path / "ck2"))
    assert sorted(resumed) == [4]
    a = without_wall_clock(straight[4])
    b = without_wall_clock(resumed[4])
    # the resumed stages describe their parameters to the anchor again (a few kB); the straight
    # run's step 4 also counts the anchor's answer to the save at 3 (tens of bytes)
    assert b.pop("anchor/bytes_in") > a.pop("anchor/bytes_in")
    out_a, out_b = a.pop("anchor/bytes_out"), b.pop("anchor/bytes_out")
    assert 0 < out_a - out_b < 2048, (out_a, out_b)
    # the first shipment after a restart is the straight run's delta (the mirrors agreed at start-up,
    # as test_resume); the whole-step totals carry the hello's bytes
    for k in (*STEP_TOTALS, *RESUME_VOLATILE):
        a.pop(k, None), b.pop(k, None)
    assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    for wa, wb in zip(_weights(tmp_path / "ck1"), _weights(tmp_path / "ck2")):
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # both stages hold the anchor's basis of fire 3 (serving iteration 4) and, pending, fire 4's
    codecs = [torch.load(tmp_path / "ck1" / "iter_0000004" / f"stage_{r:02d}" / "trainer_state.pt",
                         weights_only=True)["codec"]["fwd"] for r in range(2)]  # the forward half owns the bases
    (q0, from0), (q1, from1) = codecs[0]["bases"][0], codecs[1]["bases"][0]
    assert torch.equal(q0, q1) and from0 == from1 == 4 and q0.shape == (D, R)
    assert not torch.equal(q0, initial_basis(1234, 0, D, R))  # the run seed's basis was replaced
    assert torch.equal(codecs[0]["pending"][0][0], codecs[1]["pending"][0][0])
    assert codecs[0]["pending"][0][1] == 5


def test_lowrank_anchor_owned_basis_travels_in_the_pipeline_dtype_under_bf16(tmp_path):
    """--bf16: the anchor's replica keeps fp32 parameters but the stages take the basis in the
    pipeline dtype (bf16); the anchor built it in its parameters' dtype and the stages' receive
    of the first basis failed ("512 vs 256" bytes, gloo) until the basis took the pipeline's."""
    anchor = ["--anchor-interval", "1", "--anchor-delay", "1", "--lowrank-q-owner", "anchor", "--bf16"]
    run = _train(tmp_path, "bf16", 1, *anchor, "--train-iters", "2", "--save", str(tmp_path / "ck"),
                 "--save-interval", "2")
    for t in (1, 2):
        assert run[t]["anchor/fire"] == 1 and run[t]["anchor/bytes_out"] >= 2 * (8 + D * R * 2)
    codecs = [torch.load(tmp_path / "ck" / "iter_0000002" / f"stage_{r:02d}" / "trainer_state.pt",
                         weights_only=True)["codec"]["fwd"] for r in range(2)]
    (q0, from0), (q1, from1) = codecs[0]["bases"][0], codecs[1]["bases"][0]
    assert q0.dtype == q1.dtype == torch.bfloat16 and torch.equal(q0, q1) and from0 == from1 == 2
    assert not torch.equal(q0, initial_basis(1234, 0, D, R, torch.bfloat16))
