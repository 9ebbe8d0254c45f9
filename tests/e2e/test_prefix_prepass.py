"""``pcaq/every=2/prefix=1/prepass=1:lrq`` in real runs (tiny random model, PP=2, the deepspeed
launcher, the parity reward): it trains and bills under half the dense bytes with the prepass phase
timed (``timing_s/boundary_prepass``), and a run resumed inside a basis window continues bit for bit (the
window's basis comes from the checkpoint; the prepass' Gram is never needed across iterations).
The codec's bytes and the prepass' basis are pinned by tests/compression/test_prefix.py and the gloo
pipeline equivalence (tests/pipeline/test_pipeline_equivalence.py)."""

import torch

from distributed_util import RESUME_VOLATILE, launch_train, stage_weights, tiny_args
from distributed_util import PARITY_REWARD as REWARD
from megatron_cegrpo.training.perf import without_wall_clock

SPEC = "pcaq/every=2/prefix=1/prepass=1:lrq"
COMMON = ["--anchor-ranks", "0", "--kl-coef", "0", "--boundary-codec", SPEC, "--boundary-keep-ratio", "0.25",
          "--train-iters", "3", "--save-interval", "1"]


def _run(tmp_path, name, *extra):
    return launch_train([*tiny_args(), "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
                         *COMMON, *extra], tmp_path / name)


def test_prefix_prepass_runs_bills_and_resumes_bit_for_bit(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    straight = _run(tmp_path, "straight", "--save", str(tmp_path / "straight" / "ckpt"))
    assert sorted(straight) == [1, 2, 3]
    # the phase is timed every compressed iteration (the tied rows' refresh always; the forward on
    # the window's first step: iterations 1 and 2 here, 3 reuses 2's basis; which steps ran it is
    # pinned by tests/compression/test_prefix.py and the gloo pipeline test)
    assert all("timing_s/boundary_prepass" in straight[t] for t in (1, 2, 3))
    for t in (1, 2, 3):
        assert 0 < straight[t]["comm/fwd_bytes"] + straight[t]["comm/bwd_bytes"] < straight[t]["comm/dense_equiv_bytes"] / 2

    resumed = _run(tmp_path, "resumed", "--load", str(tmp_path / "straight" / "ckpt" / "iter_0000002"),
                   "--save", str(tmp_path / "resumed" / "ckpt"))
    assert sorted(resumed) == [3]
    a, b = without_wall_clock(straight[3], ("perf/",)), without_wall_clock(resumed[3], ("perf/",))
    for k in RESUME_VOLATILE:
        a.pop(k, None), b.pop(k, None)
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    for sa, sb in zip(stage_weights(tmp_path / "straight" / "ckpt" / "iter_0000003"),
                      stage_weights(tmp_path / "resumed" / "ckpt" / "iter_0000003")):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
