"""The drift probe without a KL term and the drift controller in real runs (issue 31 items 1, 3, 5;
training/drift_probe.py, training/drift_controller.py, docs/training_health.md).

Tiny random model, PP=2 through the deepspeed launcher, the parity reward, the mask codec,
``--kl-coef 0`` (the main job: no reference model), a probe every iteration and a controller with a
band far below any real drift (it wants a dense step after every probe that sees any drift) and a
byte budget of R = 0.42:

- the probe measures the dense-view KL to the base model (0 at iteration 1, where the weights are
  the base's; > 0 after), on its own byte meter and timer;
- the controller takes a dense step after iteration 2, billed as the dense-equivalent boundary
  bytes and counted in ``comm/avg_boundary_ratio``, then refuses the next one when it would push
  the average over R (its decision is the documented formula on the logged byte totals);
- a run resumed from the checkpoint of iteration 2, taken after the controller scheduled the dense
  step 3, takes it and continues bit for bit (metrics and weights);
- the probe (its base model included) and the controller change nothing else: before the first
  dense step the run trains bit for bit as one without them.
"""

import pytest
import torch

from distributed_util import RESUME_VOLATILE, launch_train, metric_diffs, stage_weights, tiny_args
from distributed_util import PARITY_REWARD as REWARD
from megatron_cegrpo.training.perf import without_wall_clock

R = 0.42
ARGS = tiny_args(kl_coef=0, anchor_ranks=0, boundary_codec="mask", save_interval=2)
DRIFT = ["--drift-probe-interval", "1", "--drift-controller", "--drift-target-kl", "1e-12",
         "--drift-max-boundary-ratio", str(R)]


def _run(tmp, name, *extra, iters=4, drift=True):
    out = tmp / name
    return launch_train([*ARGS, "--train-iters", str(iters), *(DRIFT if drift else []),
                         "--custom-reward-function", f"{tmp / 'reward.py'}:parity_reward",
                         "--save", str(out / "ckpt"), *extra], out)


def _timeless(m):
    return without_wall_clock(m, ("perf/",))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drift")
    (tmp / "reward.py").write_text(REWARD)
    return tmp, _run(tmp, "straight")


def test_the_controller_takes_a_dense_step_within_its_budget(straight):
    _, m = straight
    assert sorted(m) == [1, 2, 3, 4]
    # the probe: KL to the base model without a reference (--kl-coef 0), 0 while the weights are the base's
    assert "probe/kl_to_ref" not in m[2] and m[1]["probe/kl_to_base"] == 0.0
    assert all(m[t]["probe/kl_to_base"] > 0 for t in (2, 3, 4))
    assert all(m[t]["probe/bytes"] > 0 and m[t]["timing_s/probe"] > 0 for t in (1, 2, 3, 4))
    assert m[1]["probe/view_abs_logprob_diff"] > 0 and "probe/view_gap_slope" in m[2]
    assert all(m[t]["actor/weight_rel_change/stage_1"] > 0 for t in (2, 3, 4))
    # the controller: logged every iteration, acting on the dense-view KL only
    for t in (1, 2, 3, 4):
        assert m[t]["drift/target"] == 1e-12 and m[t]["drift/measured"] == m[t]["probe/kl_to_base"]
    assert [m[t]["drift/action"] for t in (1, 2)] == [0, 1]  # no drift yet; then a dense step for 3
    assert [m[t]["comm/dense_step"] for t in (1, 2, 3)] == [0, 0, 1]
    assert [m[t]["drift/dense_steps"] for t in (1, 2, 3, 4)] == [0, 0, 1, m[4]["drift/dense_steps"]]
    # its dense step is an ordinary dense step: billed at the dense-equivalent size, no codec error
    sent = m[3]["comm/fwd_bytes"] + m[3]["comm/bwd_bytes"]
    assert sent == m[3]["comm/dense_equiv_bytes"] > 0 and m[3]["comm/bytes_ratio"] == 1.0
    assert "codec/error_persistence" not in m[3] and m[3]["comm/total_bytes"] >= sent
    # each decision is the budget formula on the logged cumulative totals: (W + D/t) / (D + D/t) <= R
    for t in (2, 3, 4):
        w, d = m[t]["comm/total_wire_bytes"], m[t]["comm/total_dense_equiv_bytes"]
        assert m[t]["comm/avg_boundary_ratio"] == w / d <= R
        assert m[t]["drift/action"] == (1 if (w + d / t) <= R * (d + d / t) else -1), t
    assert m[3]["drift/action"] == -1  # a second dense step would pass the budget
    assert m[4]["comm/dense_step"] == 0 and m[4]["drift/dense_steps"] == 1


def test_resume_across_a_controller_action_is_bit_exact(straight):
    tmp, m = straight
    resumed = _run(tmp, "resumed", "--load", str(tmp / "straight" / "ckpt" / "iter_0000002"))
    assert sorted(resumed) == [3, 4] and resumed[3]["comm/dense_step"] == 1  # the step scheduled before the save
    for t in (3, 4):
        a, b = _timeless(m[t]), _timeless(resumed[t])
        for k in RESUME_VOLATILE:  # distributed_util.py says why
            a.pop(k, None), b.pop(k, None)
        assert not metric_diffs(a, b), (t, metric_diffs(a, b))
    for sa, sb in zip(stage_weights(tmp / "straight" / "ckpt" / "iter_0000004"),
                      stage_weights(tmp / "resumed" / "ckpt" / "iter_0000004")):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_probe_and_the_controller_change_nothing_else(straight):
    tmp, m = straight
    plain = _run(tmp, "plain", iters=2, drift=False)  # iterations 1 and 2 of the straight run are compressed
    for t in (1, 2):
        a = {k: v for k, v in _timeless(m[t]).items() if not k.startswith(("probe/", "drift/"))}
        assert not metric_diffs(a, _timeless(plain[t])), (t, metric_diffs(a, _timeless(plain[t])))
    assert not any(k.startswith(("probe/", "drift/")) for k in plain[2])
