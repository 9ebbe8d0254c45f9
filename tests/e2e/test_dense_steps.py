"""Dense steps (``--dense-step-interval``, issue 31 item 2; training/dense_step.py) in real runs.

Tiny random model, PP=2 through the deepspeed launcher, the parity reward:
- every iteration dense under the mask codec is the dense codec's run, bit for bit: the same
  metrics (bytes included) but ``comm/dense_step``, the same final weights; with a separate
  old-logprob pass, the reference pass and the drift probe, so every pass of an iteration goes dense;
- a dense step every 2nd iteration is billed as real boundary bytes (fwd + bwd = the
  dense-equivalent bytes on those iterations, compressed bytes on the others),
  ``comm/avg_boundary_ratio`` is the cumulative ratio, and a run resumed from a checkpoint taken
  before a dense step continues it bit for bit (metrics and weights);
- with the anchor (c = K = 2), a dense step blends no sign while the anchor's schedule goes on.
"""

import torch

from distributed_util import RESUME_VOLATILE, launch_train, metric_diffs, stage_weights, tiny_args
from distributed_util import PARITY_REWARD as REWARD
from megatron_cegrpo.training.perf import without_wall_clock

ARGS = tiny_args()
NO_ANCHOR = ["--anchor-ranks", "0"]


def _run(tmp_path, name, *extra, ranks=2):
    return launch_train([*ARGS, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", *extra],
                        tmp_path / name, ranks=ranks)


def _same_weights(wa, wb):
    for sa, sb in zip(wa, wb):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _timeless(m):
    return without_wall_clock(m, ("perf/",))


def test_a_dense_step_is_the_dense_codec(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    common = [*NO_ANCHOR, "--train-iters", "2", "--recompute-old-log-prob", "--drift-probe-interval", "1",
              "--save-interval", "2"]
    dense_steps = _run(tmp_path, "dense_steps", *common, "--boundary-codec", "mask", "--dense-step-interval", "1",
                       "--save", str(tmp_path / "dense_steps" / "ckpt"))
    dense = _run(tmp_path, "dense", *common, "--boundary-codec", "dense", "--save", str(tmp_path / "dense" / "ckpt"))
    assert sorted(dense_steps) == sorted(dense) == [1, 2]
    for t in (1, 2):
        a, b = _timeless(dense_steps[t]), _timeless(dense[t])
        # the one difference: this run's iterations are dense steps of a mask-codec run (and so the
        # probe keeps their compression-view gap, 0, out of its slope: docs/training_health.md)
        assert (a.pop("comm/dense_step"), b.pop("comm/dense_step")) == (1, 0)
        assert "probe/view_gap_slope" not in a and b.pop("probe/view_gap_slope", 0.0) == 0.0
        assert not metric_diffs(a, b), metric_diffs(a, b)
        # every pass at full width, billed as such (no codec error to persist)
        assert a["comm/fwd_bytes"] + a["comm/bwd_bytes"] == a["comm/dense_equiv_bytes"] > 0
        assert a["comm/bytes_ratio"] == a["comm/avg_boundary_ratio"] == 1.0
        assert "codec/error_persistence" not in a and a["probe/view_abs_logprob_diff"] == 0.0
    assert dense_steps[2]["actor/grad_norm"] > 0
    _same_weights(stage_weights(tmp_path / "dense_steps" / "ckpt" / "iter_0000002"),
                  stage_weights(tmp_path / "dense" / "ckpt" / "iter_0000002"))


def test_dense_steps_are_billed_and_resume_bit_for_bit(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    common = [*NO_ANCHOR, "--boundary-codec", "mask", "--dense-step-interval", "2", "--train-iters", "4",
              "--save-interval", "1"]
    straight = _run(tmp_path, "straight", *common, "--save", str(tmp_path / "straight" / "ckpt"))
    assert [straight[t]["comm/dense_step"] for t in (1, 2, 3, 4)] == [0, 1, 0, 1]
    wire = dense = 0
    for t in (1, 2, 3, 4):
        m = straight[t]
        sent = m["comm/fwd_bytes"] + m["comm/bwd_bytes"]
        if m["comm/dense_step"]:  # the dense step's boundary bytes are the dense-equivalent bytes
            assert sent == m["comm/dense_equiv_bytes"] and m["comm/bytes_ratio"] == 1.0
            assert "codec/error_persistence" not in m
        else:  # the mask codec's 5 %: 1 value in 16 at tiny-llama's width
            assert 0 < sent < m["comm/dense_equiv_bytes"] / 10
        wire, dense = wire + sent, dense + m["comm/dense_equiv_bytes"]
        assert (m["comm/total_wire_bytes"], m["comm/total_dense_equiv_bytes"]) == (wire, dense)
        assert m["comm/avg_boundary_ratio"] == wire / dense
        # the whole-step ledger counts them as the boundary's real bytes
        assert m["comm/total_bytes"] >= sent
    assert 0.5 < straight[4]["comm/avg_boundary_ratio"] < 0.6  # half the steps dense, the rest at 1/16

    # resumed from iteration 1 (before the first dense step) into a fresh log: the same iterations 2-4
    resumed = _run(tmp_path, "resumed", *common, "--load", str(tmp_path / "straight" / "ckpt" / "iter_0000001"),
                   "--save", str(tmp_path / "resumed" / "ckpt"))
    assert sorted(resumed) == [2, 3, 4]
    for t in (2, 3, 4):
        a, b = _timeless(straight[t]), _timeless(resumed[t])
        for k in RESUME_VOLATILE:
            a.pop(k, None), b.pop(k, None)
        assert a == b, (t, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
    _same_weights(stage_weights(tmp_path / "straight" / "ckpt" / "iter_0000004"),
                  stage_weights(tmp_path / "resumed" / "ckpt" / "iter_0000004"))


def test_a_dense_step_blends_no_sign_and_the_anchor_goes_on(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    m = _run(tmp_path, "anchor", "--boundary-codec", "mask", "--dense-step-interval", "3", "--train-iters", "4",
             "--anchor-ranks", "1", "--anchor-interval", "2", "--anchor-delay", "2", ranks=3)
    assert [m[t]["comm/dense_step"] for t in (1, 2, 3, 4)] == [0, 0, 1, 0]
    assert [m[t]["anchor/fire"] for t in (1, 2, 3, 4)] == [0, 1, 0, 1]
    # fire 2's sign is held from step 2 on (--sign-fold every-step) but not blended into the dense step 3
    assert [m[t]["anchor/correction_applied"] for t in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert "anchor/sign_agreement" not in m[3]
    # the dense step still ships theta(2) and the batch, and fire 4 forecasts from theta(0), theta(2)
    assert m[3]["anchor/bytes_ship"] > 0 and m[3]["anchor/bytes_in"] > m[3]["anchor/bytes_ship"]
    assert m[4]["anchor/branch"] == "forecast" and m[4]["anchor/source_steps"] == [0, 2]
    assert m[3]["comm/fwd_bytes"] + m[3]["comm/bwd_bytes"] == m[3]["comm/dense_equiv_bytes"]
