"""The damped secant (``--anchor-forecast-damping``) and ``anchor/forecast_error`` (issue 31 item 4)."""

import math

import pytest
import torch

from megatron_cegrpo.anchor import CheckpointRing, forecast_error, get_forecast
from megatron_cegrpo.anchor.worker import AnchorWorker


def _ring(points, capacity=4, delay=20):
    ring = CheckpointRing(capacity=capacity, delay=delay)
    for s, tensors in points.items():
        ring.put(s, tensors)
    return ring


def _random_ring(seed=0):
    g = torch.Generator().manual_seed(seed)
    pts = {s: {"w": torch.randn(5, 7, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}
           for s in (0, 20, 40)}
    return _ring(pts, capacity=4, delay=20)


def test_damping_one_is_the_plain_secant_bit_for_bit():
    ring = _random_ring()
    for t in (40, 50, 60):
        plain = get_forecast("secant")(ring, t, 20, 20)
        damped = get_forecast("secant", damping=1.0)(ring, t, 20, 20)
        assert (plain.branch, plain.source_steps, plain.batch_step) == (damped.branch, damped.source_steps,
                                                                       damped.batch_step)
        for k in plain.weights:
            assert torch.equal(plain.weights[k], damped.weights[k]), (t, k)


@pytest.mark.parametrize("d", [0.0, 0.25, 0.53, 2.0])
def test_damping_scales_the_step_exactly(d):
    # theta(s1) + D h (theta(s1) - theta(s0)), h = (t - s1) / (s1 - s0); values exact in fp32
    ring = _ring({0: {"p": torch.tensor([0.0, 4.0, 1.0])}, 20: {"p": torch.tensor([2.0, 0.0, 1.0])}})
    for t, h in ((40, 1.0), (50, 1.5)):
        res = get_forecast("secant", damping=d)(ring, t, 20, 20)
        assert res.branch == "forecast" and res.source_steps == [0, 20] and res.batch_step == t
        want = torch.tensor([2.0 + d * h * 2.0, 0.0 - d * h * 4.0, 1.0])
        torch.testing.assert_close(res.weights["p"], want, rtol=0, atol=1e-6)
    # the step from theta(s1) is D times the undamped one, on random weights too
    ring = _random_ring(1)
    base = ring.read(20, 40)
    plain = get_forecast("secant")(ring, 40, 20, 20).weights
    damped = get_forecast("secant", damping=d)(ring, 40, 20, 20).weights
    for k in plain:
        torch.testing.assert_close(damped[k] - base[k].float(), d * (plain[k] - base[k].float()), rtol=1e-5,
                                   atol=1e-6)


def test_damping_leaves_the_fallback_alone_and_is_checked():
    ring = _ring({0: {"p": torch.tensor([1.0, 2.0])}})
    res = get_forecast("secant", damping=0.5)(ring, 20, 20, 20)
    assert res.branch == "fallback" and torch.equal(res.weights["p"], torch.tensor([1.0, 2.0]))
    for bad in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="secant damping must be a finite number >= 0"):
            get_forecast("secant", damping=bad)(ring, 20, 20, 20)
    with pytest.raises(ValueError, match="does not take options"):
        get_forecast("lsq", damping=0.5)


def test_forecast_error_hand_values():
    truth = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0])}
    stale = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([0.0])}  # ||stale - truth|| = sqrt(2)
    assert forecast_error(stale, stale, truth) == 1.0  # not forecasting at all
    assert forecast_error(truth, stale, truth) == 0.0
    over = {"a": torch.tensor([2.0, 2.0]), "b": torch.tensor([1.0])}  # sqrt(1 + 1 + 1) / sqrt(2)
    assert forecast_error(over, stale, truth) == pytest.approx(math.sqrt(1.5), rel=1e-15)
    assert forecast_error(over, truth, truth) is None  # nothing moved: no scale
    with pytest.raises(ValueError, match="the same parameters"):
        forecast_error({"a": truth["a"]}, stale, truth)


def test_forecast_error_on_a_synthetic_trajectory():
    """Weights on a curved path theta(s) = a s + b s^2 (per element): the secant from theta(t-K-c),
    theta(t-K) to t overshoots or undershoots by the curvature, which the ratio reports exactly;
    damping D moves it as the closed form says, and on a straight path the plain secant is exact."""
    K = c = 20
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)

    def theta(s, curve=1.0):
        return {"p": (a * s + curve * 1e-3 * b * s * s).float()}

    for curve in (0.0, 1.0):
        ring = _ring({s: theta(s, curve) for s in (0, 20)}, delay=K)
        t = 40
        for d in (1.0, 0.53):
            res = get_forecast("secant", damping=d)(ring, t, K, c)
            err = forecast_error(res.weights, ring.read(20, t), theta(t, curve))
            # closed form: F - T = (d - 1) (T(20) - T(0)) - curvature term; S - T = T(20) - T(40)
            th = {s: a * s + curve * 1e-3 * b * s * s for s in (0, 20, 40)}
            f = th[20] + d * (th[20] - th[0])
            want = float((f - th[40]).norm() / (th[20] - th[40]).norm())
            assert err == pytest.approx(want, rel=1e-5), (curve, d)
            if curve == 0.0 and d == 1.0:
                assert err < 1e-6  # a straight path: the secant lands on the truth


def test_the_worker_scores_each_forecast_when_its_true_weights_arrive():
    """``AnchorWorker._score_forecast`` on the schedule c = 2, K = 4: the fire at s is scored when
    theta(s) arrives (before it enters the ring), with the forecast that fire made, and the
    ratio waits (checkpointed) for the fire at s + K."""
    from types import SimpleNamespace

    c, K, d = 2, 4, 0.5
    w = AnchorWorker.__new__(AnchorWorker)
    w.a = SimpleNamespace(anchor_interval=c, anchor_delay=K, anchor_replay="forecast")
    w.ring = CheckpointRing(capacity=4, delay=K)
    w.forecast = get_forecast("secant", damping=d)
    w.forecast_errors = {}
    g = torch.Generator().manual_seed(5)
    traj = {0: torch.zeros(6)}
    for s in range(1, 13):
        traj[s] = traj[s - 1] + 0.1 + 0.05 * torch.randn(6, generator=g)  # a drifting random walk
    expected = {}
    for s in range(0, 13, c):  # shipments theta(0), theta(2), ... (at iterations 1, 3, ...)
        if s >= c and len(w.ring.available(s)) >= 2:  # the fire at s forecast from s - K - c, s - K
            fire = get_forecast("secant", damping=d)(w.ring, s, K, c)
            assert fire.branch == "forecast" and fire.source_steps == [s - K - c, s - K]
            num = (fire.weights["p"].double() - traj[s].double()).norm()
            den = (traj[s - K].double() - traj[s].double()).norm()
            expected[s] = float(num / den)
        w._score_forecast(s, {"p": traj[s]})
        w.ring.put(s, {"p": traj[s]})
    assert sorted(w.forecast_errors) == sorted(expected) == [6, 8, 10, 12]
    for s in expected:
        assert w.forecast_errors[s] == pytest.approx(expected[s], rel=1e-12)
    assert w.ring.num_no_peek_violations == 0
