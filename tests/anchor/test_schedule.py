"""The anchor's schedule at start-up: K a positive multiple of c, and a ring that holds what
the forecast needs at every fire (otherwise the anchor silently never fires)."""

import pytest
import torch

from megatron_cegrpo.anchor import CheckpointRing, get_forecast
from megatron_cegrpo.anchor.transport import is_fire_step, is_ship_step
from megatron_cegrpo.anchor.worker import ring_capacity
from megatron_cegrpo.arguments import build_config, parse_args


def cfg(*argv):
    return build_config(parse_args(["--anchor-ranks", "1", *argv]))


@pytest.mark.parametrize("c, K", [(4, 6), (4, 2), (20, 30), (3, 0)])
def test_delay_must_be_a_positive_multiple_of_the_interval(c, K):
    with pytest.raises(ValueError, match=rf"--anchor-delay \(K={K}\) must be a positive multiple of "
                                         rf"--anchor-interval \(c={c}\)"):
        cfg("--anchor-interval", str(c), "--anchor-delay", str(K)).validate()


def test_delay_is_not_checked_without_an_anchor():
    flags = ["--anchor-interval", "4", "--anchor-delay", "6"]
    assert build_config(parse_args(["--anchor-ranks", "0", *flags])).validate().anchor.anchor_delay == 6
    with pytest.raises(ValueError, match=r"--anchor-delay \(K=6\) must be a positive multiple"):
        cfg(*flags).validate()  # the same flags with an anchor rank


@pytest.mark.parametrize("flag, value", [("--anchor-timeout-minutes", "-1"), ("--anchor-timeout-minutes", "nan"),
                                         ("--distributed-timeout-minutes", "0"),
                                         ("--distributed-timeout-minutes", "inf")])
def test_timeouts_must_be_finite(flag, value):
    with pytest.raises(ValueError, match=flag):
        cfg(flag, value).validate()


@pytest.mark.parametrize("forecast, replay, c, K, expected", [
    ("secant", "forecast", 20, 20, 5),     # the seeds' defaults: as in earlier versions
    ("secant", "forecast", 2, 2, 5),
    ("secant", "forecast", 20, 100, 7),    # K/c = 5 unreadable + 2 points
    ("lsq", "forecast", 4, 40, 14),        # 10 + 4 points
    ("secant", "matching", 5, 50, 11),     # 10 + 1
])
def test_ring_capacity(forecast, replay, c, K, expected):
    a = cfg("--anchor-forecast", forecast, "--anchor-replay", replay, "--anchor-interval", str(c),
            "--anchor-delay", str(K)).validate().anchor
    assert ring_capacity(a) == expected


@pytest.mark.parametrize("forecast, c, K", [("secant", 2, 10), ("lsq", 3, 12), ("secant", 20, 100)])
def test_every_fire_after_warm_up_forecasts(forecast, c, K):
    """Follow the shipping schedule with the sized ring: from the first fire where enough
    checkpoints are old enough, every fire takes the forecast branch at staleness K."""
    a = cfg("--anchor-forecast", forecast, "--anchor-interval", str(c), "--anchor-delay", str(K)).validate().anchor
    ring = CheckpointRing(capacity=ring_capacity(a), delay=K)
    fc = get_forecast(forecast, **({"n_points": a.anchor_forecast_points} if forecast == "lsq" else {}))
    need = 2 if forecast == "secant" else a.anchor_forecast_points
    branches = {}
    end = K + (need + 4) * c
    for t in range(1, end + 1):
        if is_ship_step(t, c):
            ring.put(t - 1, {"w": torch.full((2,), float(t - 1))})
        if is_fire_step(t, c):
            res = fc(ring, t, K, c)
            branches[t] = (res.branch, res.source_steps) if res is not None else None
    first = K + (need - 1) * c  # theta(0 .. (need-1)c) all readable at t - K
    # every fire, exactly: c, 2c, ... (a schedule that never fired passed the check of the forecasting
    # fires alone); nothing readable before K; then the newest readable checkpoint, theta(t - K), alone;
    # from `first` on the forecast over theta(t - K - (need - 1) c), ..., theta(t - K): staleness K
    want = {t: None if t < K else ("fallback", [t - K]) if t < first
            else ("forecast", [t - K - (need - 1 - i) * c for i in range(need)]) for t in range(c, end + 1, c)}
    assert branches == want
    assert sum(t >= first for t in branches) == 6
    assert ring.num_no_peek_violations == 0
