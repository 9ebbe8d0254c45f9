"""CheckpointRing (staleness contract, eviction, state) and the replay forecasts."""

import pytest
import torch

from megatron_cegrpo.anchor import (
    CheckpointRing,
    ForecastResult,
    StalenessError,
    available_forecasts,
    get_forecast,
)


def _ck(value, dtype=torch.float32):
    return {"w": torch.full((2, 3), float(value), dtype=dtype), "b": torch.full((3,), -float(value), dtype=dtype)}


def _ring(steps, capacity=4, delay=20, values=None):
    ring = CheckpointRing(capacity=capacity, delay=delay)
    for i, s in enumerate(steps):
        ring.put(s, _ck(s / 20 if values is None else values[i]))
    return ring


# ------------------------------------------------------------------ ring
def test_refuses_checkpoints_fresher_than_t_minus_k():
    ring = _ring([0, 20, 40])
    assert ring.num_no_peek_violations == 0
    # fire at t=40, K=20: step 20 is readable, step 40 is not
    assert torch.equal(ring.read(20, 40)["w"], torch.full((2, 3), 1.0))
    with pytest.raises(StalenessError, match="no-peek"):
        ring.read(40, 40)
    assert ring.num_no_peek_violations == 1
    # StalenessError is a ValueError; a missing fresh step is still a peek attempt
    with pytest.raises(ValueError, match=r"no-peek: fire at t=40 .* asked for step 39"):
        ring.read(39, 40)
    assert ring.num_no_peek_violations == 2
    # the value is not leaked through any other accessor either
    assert [s for s, _ in ring.latest_readable(40, 10)] == [0, 20]
    assert ring.num_no_peek_violations == 2
    # later, the same step becomes readable
    assert torch.equal(ring.read(40, 60)["w"], torch.full((2, 3), 2.0))
    assert ring.num_no_peek_violations == 2


def test_keeps_last_capacity_and_evicts_oldest_first():
    ring = _ring([0, 20, 40], capacity=3)
    assert ring.steps == [0, 20, 40]
    ring.put(60, _ck(3))
    assert ring.steps == [20, 40, 60]
    ring.put(80, _ck(4))
    assert ring.steps == [40, 60, 80]
    with pytest.raises(KeyError, match=r"checkpoint step 0 is not held \(held: \[40, 60, 80\]\)"):
        ring.read(0, 200)
    with pytest.raises(KeyError, match=r"checkpoint step 20 is not held"):
        ring.read(20, 200)
    assert ring.num_no_peek_violations == 0  # missing-but-stale is a KeyError, not a peek
    assert torch.equal(ring.read(40, 200)["w"], torch.full((2, 3), 2.0))
    # strictly increasing, also against evicted steps
    with pytest.raises(ValueError, match="checkpoint steps must be strictly increasing: got 80 after 80"):
        ring.put(80, _ck(9))
    with pytest.raises(ValueError, match="checkpoint steps must be strictly increasing: got 10 after 80"):
        ring.put(10, _ck(9))
    with pytest.raises(ValueError, match=r"checkpoint names/shapes differ from the ones held: missing=\['b'\]"):
        ring.put(100, {"w": torch.zeros(2, 3)})  # names differ from the held ones


def test_available_at_several_t():
    ring = _ring([0, 20, 40, 60])
    assert ring.available(0) == []
    assert ring.available(19) == []
    assert ring.available(20) == [0]
    assert ring.available(39) == [0]
    assert ring.available(40) == [0, 20]
    assert ring.available(80) == [0, 20, 40, 60]
    got = ring.latest_readable(80, 2)
    assert [s for s, _ in got] == [40, 60]
    assert torch.equal(got[1][1]["b"], torch.full((3,), -3.0))
    assert CheckpointRing(capacity=2, delay=0).available(5) == []
    r0 = _ring([0, 5], delay=0)
    assert r0.available(5) == [0, 5]


def test_put_clones_the_callers_tensors():
    ring = CheckpointRing(capacity=2, delay=0)
    live = {"w": torch.zeros(4)}
    ring.put(0, live)
    live["w"].add_(1.0)  # the trainer updates its parameters in place
    assert torch.equal(ring.read(0, 0)["w"], torch.zeros(4))


def test_state_round_trip_weights_only(tmp_path):
    ring = _ring([0, 20, 40, 60, 80], capacity=3)
    with pytest.raises(StalenessError, match=r"no-peek: fire at t=90 .* asked for step 80"):
        ring.read(80, 90)
    path = tmp_path / "ring.pt"
    torch.save(ring.state_dict(), path)
    state = torch.load(path, weights_only=True)

    other = CheckpointRing(capacity=3, delay=20)
    other.load_state_dict(state)
    assert other.steps == [40, 60, 80]
    assert other.num_no_peek_violations == 1
    assert other.available(100) == [40, 60, 80]
    for s in (40, 60, 80):
        for name in ("w", "b"):
            assert torch.equal(other.read(s, 100)[name], ring.read(s, 100)[name])
    with pytest.raises(ValueError, match="checkpoint steps must be strictly increasing: got 60 after 80"):
        other.put(60, _ck(0))  # monotonicity survives the round trip
    with pytest.raises(ValueError, match="ring state has capacity=3, delay=20; this ring has capacity=4, delay=20"):
        CheckpointRing(capacity=4, delay=20).load_state_dict(state)
    with pytest.raises(ValueError, match="ring state has capacity=3, delay=20; this ring has capacity=3, delay=10"):
        CheckpointRing(capacity=3, delay=10).load_state_dict(state)


# -------------------------------------------------------------- forecasts
def _flat(points_by_step, dtype=torch.float32, capacity=4):
    ring = CheckpointRing(capacity=capacity, delay=20)
    for s, v in points_by_step.items():
        ring.put(s, {"p": torch.as_tensor(v, dtype=dtype)})
    return ring


def test_secant_matches_hand_values():
    ring = _flat({0: [0.0, 0.0, 1.0], 20: [1.0, -0.5, 1.0], 40: [9.0, 9.0, 9.0]})
    res = get_forecast("secant")(ring, 40, 20, 20)
    assert isinstance(res, ForecastResult)
    assert res.branch == "forecast" and res.source_steps == [0, 20] and res.batch_step == 40
    # theta(20) + (20/20) (theta(20) - theta(0)); theta(40) is never read
    assert torch.equal(res.weights["p"], torch.tensor([2.0, -1.0, 1.0]))
    assert ring.num_no_peek_violations == 0
    # off-schedule fire: t=50 reads 0 and 20 -> theta(20) + 1.5 (theta(20) - theta(0))
    assert torch.equal(get_forecast("secant")(ring, 50, 20, 20).weights["p"], torch.tensor([2.5, -1.25, 1.0]))
    # t=60 uses the two newest readable, s0=20, s1=40: theta(40) + 1 * (theta(40) - theta(20))
    assert torch.equal(get_forecast("secant")(ring, 60, 20, 20).weights["p"], torch.tensor([17.0, 18.5, 17.0]))
    # actual spacing: s0=0, s1=30, t=50 -> theta(30) + (20/30) (theta(30) - theta(0)) = 3 + 2 = 5
    uneven = _flat({0: [0.0, 1.0], 30: [3.0, 1.0]})
    res = get_forecast("secant")(uneven, 50, 20, 20)
    assert res.source_steps == [0, 30]
    assert torch.allclose(res.weights["p"], torch.tensor([5.0, 1.0]), rtol=0, atol=1e-6)


def test_secant_bf16_inputs_fp32_output_and_ring_untouched():
    ring = _flat({0: [1.0, 2.0], 20: [1.5, 2.5]}, dtype=torch.bfloat16)
    res = get_forecast("secant")(ring, 40, 20, 20)
    assert res.weights["p"].dtype == torch.float32
    assert torch.equal(res.weights["p"], torch.tensor([2.0, 3.0]))
    assert torch.equal(ring.read(20, 40)["p"], torch.tensor([1.5, 2.5], dtype=torch.bfloat16))
    # fp32 ring: result must not alias the ring (matching branch included)
    ring32 = _flat({0: [1.0], 20: [3.0]})
    for name in ("secant", "lsq", "matching"):
        out = get_forecast(name, **({"n_points": 2} if name == "lsq" else {}))(ring32, 40, 20, 20)
        out.weights["p"].add_(100.0)
    assert torch.equal(ring32.read(0, 40)["p"], torch.tensor([1.0]))
    assert torch.equal(ring32.read(20, 40)["p"], torch.tensor([3.0]))


def test_lsq_exact_on_a_line_and_hand_value_on_noisy_points():
    xs = [0, 20, 40, 60]
    line = {x: [0.25 + x / 16, -x / 8] for x in xs}
    ring = _flat(line)
    res = get_forecast("lsq")(ring, 80, 20, 20)  # default n_points=4
    assert res.branch == "forecast" and res.source_steps == xs and res.batch_step == 80
    assert torch.equal(res.weights["p"], torch.tensor([0.25 + 80 / 16, -10.0]))
    # noisy: y = 0, 1, 1, 3 at x = 0, 20, 40, 60; ybar = 1.25, slope = 90/2000,
    # value at 80 = 1.25 + 50 * 0.045 = 3.5
    noisy = _flat({0: [0.0], 20: [1.0], 40: [1.0], 60: [3.0]})
    assert torch.allclose(get_forecast("lsq")(noisy, 80, 20, 20).weights["p"], torch.tensor([3.5]), rtol=0, atol=1e-6)
    # n_points=3 uses 20, 40, 60: ybar = 5/3, slope = 40/800, at 80: 5/3 + 40 * 0.05 = 11/3
    r3 = get_forecast("lsq", n_points=3)(noisy, 80, 20, 20)
    assert r3.source_steps == [20, 40, 60]
    assert torch.allclose(r3.weights["p"], torch.tensor([11 / 3]), rtol=0, atol=1e-6)
    # with two points lsq is the secant
    r2 = get_forecast("lsq", n_points=2)(noisy, 80, 20, 20)
    assert torch.allclose(r2.weights["p"], get_forecast("secant")(noisy, 80, 20, 20).weights["p"], rtol=0, atol=1e-6)


def test_fallback_matching_and_none():
    empty = _flat({})
    for name in available_forecasts():
        assert get_forecast(name)(empty, 40, 20, 20) is None
    one = _flat({0: [0.5], 20: [7.0]})
    assert get_forecast("secant")(one, 19, 20, 20) is None  # nothing readable yet
    for name in ("secant", "lsq"):
        res = get_forecast(name)(one, 20, 20, 20)  # only step 0 readable
        assert res.branch == "fallback" and res.source_steps == [0] and res.batch_step == 0
        assert torch.equal(res.weights["p"], torch.tensor([0.5]))
    three = _flat({0: [0.0], 20: [1.0], 40: [2.0], 60: [9.0]}, capacity=5)
    res = get_forecast("lsq")(three, 60, 20, 20)  # 3 readable < n_points=4
    assert res.branch == "fallback" and res.source_steps == [40] and res.batch_step == 40
    # a full ring that can never hold n_points readable ones warns (puts at write time,
    # capacity 4 < n_points + K/c = 5)
    full = _flat({20: [1.0], 40: [2.0], 60: [3.0], 80: [4.0]})
    with pytest.warns(UserWarning, match="capacity"):
        assert get_forecast("lsq")(full, 80, 20, 20).branch == "fallback"
    # matching replays the batch theta(s1) generated
    res = get_forecast("matching")(three, 70, 20, 20)
    assert res.branch == "matching" and res.source_steps == [40] and res.batch_step == 40
    assert torch.equal(res.weights["p"], torch.tensor([2.0]))
    assert three.num_no_peek_violations == 0


def test_registry_errors():
    with pytest.raises(ValueError, match="lsq, matching, secant"):
        get_forecast("quadratic")
    with pytest.raises(ValueError, match=r"'secant' does not take options \['n_points'\]; it takes \['damping'\]"):
        get_forecast("secant", n_points=4)
    ring = _flat({0: [0.0]})
    with pytest.raises(ValueError, match="forecast K=10 differs from the ring's delay 20"):
        get_forecast("secant")(ring, 40, 10, 20)  # K disagrees with the ring's delay
    with pytest.raises(ValueError, match="lsq n_points=5 exceeds the ring capacity 4"):
        get_forecast("lsq", n_points=5)(ring, 40, 20, 20)  # can never have 5 points in a 4-ring
    with pytest.raises(ValueError, match="lsq n_points must be an int >= 2, got 1"):
        get_forecast("lsq", n_points=1)(ring, 40, 20, 20)
