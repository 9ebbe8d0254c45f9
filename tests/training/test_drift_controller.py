"""The drift controller's decisions (training/drift_controller.py; issue 31 items 3 and 5) on
synthetic drift: a step, a ramp, noise, a closed loop where dense steps pull the drift back, and
its byte budget; the probe's window slope; DenseSteps taking the controller's schedule."""

import math
import random
from types import SimpleNamespace

import pytest

from megatron_cegrpo.training.dense_step import DenseSteps
from megatron_cegrpo.training.drift_controller import ACTIONS, DriftController
from megatron_cegrpo.training.drift_probe import window_slope

HIGH, LOW = 0.01, 0.005
D = 1000  # dense-equivalent boundary bytes of one iteration
R_C = 1 / 16  # the mask codec's wire ratio at 5 % (tiny-llama's width)


def _run(ctl, drift, iters, probe=1, d=D, r_c=R_C, interval=0):
    """Iterations 1..iters as the trainer drives the controller: a dense step (scheduled, or on the
    interval) bills d wire bytes, a compressed one r_c d; at each probe iteration the controller
    reads ``drift(t, history)``. Returns per-iteration records."""
    wire = dense = 0.0
    out = []
    for t in range(1, iters + 1):
        is_dense = ctl.is_dense(t) or bool(interval and t % interval == 0)
        wire, dense = wire + (d if is_dense else r_c * d), dense + d
        ctl.end_iteration(t)
        rec = {"t": t, "dense": is_dense, "ratio": wire / dense, "action": None}
        if t % probe == 0:
            rec["measured"] = drift(t, out)
            rec["action"] = ctl.observe(t, rec["measured"], wire, dense,
                                        next_dense=bool(interval and (t + 1) % interval == 0))
        rec["metrics"] = ctl.metrics()
        out.append(rec)
    return out


def test_a_step_in_drift_turns_it_on_until_the_drift_is_below_low():
    ctl = DriftController(HIGH, LOW, max_ratio=1.0)
    level = {t: (0.2 * HIGH if t <= 5 else 3 * HIGH if t <= 10 else 0.7 * HIGH if t <= 15 else 0.3 * HIGH)
             for t in range(1, 21)}
    recs = _run(ctl, lambda t, _: level[t], 20)
    actions = [r["action"] for r in recs]
    assert actions[:5] == [0] * 5  # below the band: nothing
    assert actions[5:10] == [1] * 5  # above HIGH: a dense step after each probe
    assert actions[10:15] == [1] * 5  # inside the band: still on (hysteresis), until below LOW
    assert actions[15:] == [0] * 5
    # each scheduled step is the next iteration, and counted once it has run
    assert [r["t"] for r in recs if r["dense"]] == list(range(7, 17))
    assert recs[-1]["metrics"]["drift/dense_steps"] == 10
    assert recs[6]["metrics"]["drift/dense_steps"] == 1 and recs[5]["metrics"]["drift/dense_steps"] == 0


def test_a_ramp_acts_first_at_the_probe_that_crosses_high():
    ctl = DriftController(HIGH, LOW, max_ratio=1.0)
    recs = _run(ctl, lambda t, _: 0.001 * t, 30, probe=3)  # crosses HIGH = 0.01 after t = 10
    acted = [r["t"] for r in recs if r["action"] == ACTIONS["dense"]]
    assert acted[0] == 12 and acted == list(range(12, 31, 3))  # every probe from there on
    assert [r["t"] for r in recs if r["dense"]] == [13, 16, 19, 22, 25, 28]  # one per probe, the iteration after
    assert all(r["action"] is None for r in recs if r["t"] % 3)  # decisions only at probes
    assert recs[11]["metrics"]["drift/measured"] == pytest.approx(0.012)
    assert "drift/measured" not in recs[12]["metrics"] and recs[12]["metrics"]["drift/action"] == 0


def test_noise_inside_the_band_never_toggles_it():
    rnd = random.Random(0)
    mid, sd = (HIGH + LOW) / 2, (HIGH - LOW) / 8  # +-4 sd stays inside the band
    quiet = DriftController(HIGH, LOW, max_ratio=1.0)
    assert {r["action"] for r in _run(quiet, lambda t, _: rnd.gauss(mid, sd), 200)} == {0}
    # noise around HIGH: once on, it stays on until the drift is below LOW (one switch, no chattering)
    on = DriftController(HIGH, LOW, max_ratio=1.0)
    recs = _run(on, lambda t, _: HIGH + rnd.gauss(0, (HIGH - LOW) / 8), 200)
    actives = [r["metrics"]["drift/active"] for r in recs]
    assert sum(1 for a, b in zip(actives, actives[1:]) if a != b) <= 1 and actives[-1] == 1


def test_nan_holds_and_a_scheduled_interval_step_is_not_doubled():
    ctl = DriftController(HIGH, LOW, max_ratio=1.0)
    assert ctl.observe(1, math.nan, 100, 1000) == 0 and not ctl.active and ctl.scheduled is None
    recs = _run(DriftController(HIGH, LOW, max_ratio=1.0), lambda t, _: 2 * HIGH, 8, interval=4)
    assert [r["action"] for r in recs] == [1, 1, 0, 1, 1, 1, 0, 1]  # t + 1 = 4, 8 are dense anyway
    assert [r["t"] for r in recs if r["dense"]] == list(range(2, 9))
    assert recs[-1]["metrics"]["drift/dense_steps"] == 5  # its own: 2, 3, 5, 6, 7


def _toy_drift(up, down):
    """A drift that grows by ``up`` per compressed iteration and falls by ``down`` per dense one."""
    def drift(t, hist):
        return sum(-down if r["dense"] else up for r in hist) + (up if t == 1 else 0)
    return drift


def test_closed_loop_stays_in_its_band_with_enough_budget():
    ctl = DriftController(HIGH, LOW, max_ratio=1.0)
    recs = _run(ctl, _toy_drift(0.001, 0.002), 300)
    later = [r["measured"] for r in recs[50:]]
    # within two steps of the band: a probe sees the weights before its own iteration's update, and
    # its decision acts one iteration later
    assert LOW - 2 * 0.002 - 1e-9 <= min(later) and max(later) <= HIGH + 2 * 0.001 + 1e-9
    assert min(later) < LOW and max(later) > HIGH
    assert 0.2 < sum(r["dense"] for r in recs) / 300 < 0.5  # a third of the steps dense: up / (up + down)


def test_budget_caps_the_average_boundary_ratio_and_the_drift_leaves_its_band():
    R = 0.2
    ctl = DriftController(HIGH, LOW, max_ratio=R)
    recs = _run(ctl, _toy_drift(0.001, 0.002), 300)
    assert max(r["ratio"] for r in recs) <= R + 1e-12  # the budget holds after every iteration
    assert recs[-1]["ratio"] > R - 0.01  # and is used
    assert ACTIONS["over_budget"] in {r["action"] for r in recs}
    assert recs[-1]["measured"] > 2 * HIGH  # the budget cannot hold this drift: it leaves the band
    # the dense fraction f the budget allows: f + (1 - f) r_c <= R
    f = sum(r["dense"] for r in recs) / 300
    assert f == pytest.approx((R - R_C) / (1 - R_C), abs=0.01)


def test_a_budget_below_the_codec_ratio_never_takes_a_dense_step():
    ctl = DriftController(HIGH, LOW, max_ratio=0.05)  # below 1/16
    recs = _run(ctl, lambda t, _: 2 * HIGH, 20)
    assert {r["action"] for r in recs} == {ACTIONS["over_budget"]} and not any(r["dense"] for r in recs)


def test_fits_budget_is_the_average_after_one_mean_sized_dense_step():
    ctl = DriftController(HIGH, max_ratio=0.1)
    assert ctl.low == HIGH / 2
    # t = 9 iterations of 1000 dense-equivalent bytes at 1/16: (562.5 + 1000) / 10000 = 0.156 > 0.1
    assert not ctl.fits_budget(9, 9 * 62.5, 9000)
    # after 29: (1812.5 + 1000) / 30000 = 0.094 <= 0.1
    assert ctl.fits_budget(29, 29 * 62.5, 29000)
    assert not ctl.fits_budget(0, 0, 0) and not ctl.fits_budget(3, 0, 0)


def test_state_round_trip_continues_identically():
    drift = _toy_drift(0.001, 0.002)
    a = DriftController(HIGH, LOW, max_ratio=0.3)
    straight = _run(a, drift, 60)
    b = DriftController(HIGH, LOW, max_ratio=0.3)
    first = _run(b, drift, 30)
    c = DriftController(HIGH, LOW, max_ratio=0.3)
    c.load_state_dict(b.state_dict())
    # continue from t = 31 with the byte totals and history of the first 30
    wire = sum(D if r["dense"] else R_C * D for r in first)
    hist, out = list(first), []
    for t in range(31, 61):
        is_dense = c.is_dense(t)
        wire += D if is_dense else R_C * D
        c.end_iteration(t)
        rec = {"t": t, "dense": is_dense}
        rec["action"] = c.observe(t, drift(t, hist), wire, t * D)
        hist.append(rec)
        out.append((rec["dense"], rec["action"], c.metrics()))
    assert out == [(r["dense"], r["action"], r["metrics"]) for r in straight[30:]]


@pytest.mark.parametrize("high, low, ratio", [(0, None, 0.1), (0.01, 0.02, 0.1), (0.01, None, 0), (0.01, None, 1.5)])
def test_bad_band_or_budget_is_refused(high, low, ratio):
    with pytest.raises(ValueError, match="drift controller"):
        DriftController(high, low, ratio)


def test_window_slope_is_least_squares():
    assert window_slope([(1, 0.0), (2, 0.5), (3, 1.0)]) == pytest.approx(0.5)
    assert window_slope([(2, 1.0), (4, 1.0), (6, 1.0)]) == 0.0
    assert window_slope([(1, 0.0), (2, 1.0), (3, 1.0), (4, 2.0)]) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="a slope needs two points or more, got 1"):
        window_slope([(1, 0.0)])
    with pytest.raises(ValueError, match="a slope needs points at two iterations or more"):
        window_slope([(2, 0.0), (2, 1.0)])


def test_dense_steps_take_the_controllers_schedule():
    ctl = DriftController(HIGH, LOW, max_ratio=1.0)
    steps = DenseSteps(5, SimpleNamespace(comm=object()), ctl)
    assert ctl.observe(2, 2 * HIGH, 100, 2000) == ACTIONS["dense"]
    assert [t for t in range(1, 11) if steps.is_dense(t)] == [3, 5, 10]
    assert steps.on_interval(5) and not steps.on_interval(3)
    assert not DenseSteps(5, SimpleNamespace(comm=None), ctl).is_dense(3)  # PP = 1: nothing is ever dense
