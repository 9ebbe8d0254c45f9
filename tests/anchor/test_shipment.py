"""Anchor shipments (issue 12 item 4): fp32 keyframe, then bf16 deltas against a mirror both ends keep."""

import pytest
import torch

from megatron_cegrpo.anchor.forecast import secant_forecast
from megatron_cegrpo.anchor.ring import CheckpointRing
from megatron_cegrpo.anchor.shipment import ShipmentDecoder, ShipmentEncoder, shipment_nbytes

N = 10_000


def _trajectory(steps, seed=0, lr=1e-5):
    """theta(0), theta(c), ...: O(1) weights that move by ~lr a step along a drifting direction."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(N, generator=g)
    out = [theta.clone()]
    for _ in range(steps):
        theta = theta - lr * (1 + torch.randn(N, generator=g))
        out.append(theta.clone())
    return out


def _nbytes(t):
    return t.numel() * t.element_size()


def test_keyframe_then_half_size_deltas_and_identical_mirrors():
    enc, dec = ShipmentEncoder("bf16-delta"), ShipmentDecoder("bf16-delta", N)
    traj = _trajectory(6)
    for i, theta in enumerate(traj):
        payload = enc.encode(theta)
        assert payload.dtype == (torch.float32 if i == 0 else torch.bfloat16)
        assert _nbytes(payload) == shipment_nbytes(N, "bf16-delta", keyframe=i == 0) == (4 if i == 0 else 2) * N
        assert dec.buffer().dtype == payload.dtype
        got = dec.decode(payload)
        assert torch.equal(got, enc.mirror)  # both ends hold the same fp32 values, bit for bit
        if i == 0:
            assert torch.equal(got, theta)  # the keyframe is exact
        else:
            # closed loop: the error is bf16's rounding of one shipment's movement (plus fp32's own
            # rounding of the weight), not bf16's rounding of the weight
            move = (theta - traj[i - 1]).abs()
            err = (got - theta).abs()
            assert bool((err <= move * 2.0 ** -8 + theta.abs() * 2.0 ** -22).all())
            assert float(err.max()) < 1e-6 < float((theta.bfloat16().float() - theta).abs().max())


def test_secant_on_reconstructions_tracks_the_exact_secant():
    """The forecast differences checkpoints: with deltas it stays within ~0.5 % of the exact secant's
    extrapolation; plain bf16 weights would erase it (their rounding exceeds the movement)."""
    traj = _trajectory(2, lr=1e-4)
    enc, dec = ShipmentEncoder("bf16-delta"), ShipmentDecoder("bf16-delta", N)
    exact, delta = CheckpointRing(4, 4), CheckpointRing(4, 4)
    for s, theta in zip((0, 4, 8), traj):
        exact.put(s, {"w": theta})
        delta.put(s, {"w": dec.decode(enc.encode(theta)).clone()})
    t = 12
    want = secant_forecast(exact, t, 4, 4).weights["w"]
    got = secant_forecast(delta, t, 4, 4).weights["w"]
    step = (want - traj[1]).norm()  # the forecast's displacement from theta(4)
    assert float((got - want).norm() / step) < 5e-3
    plain = 2 * traj[1].bfloat16().float() - traj[0].bfloat16().float()
    assert float((plain - want).norm() / step) > 0.5


def test_resume_continues_bit_identically():
    traj = _trajectory(5)
    straight_enc, straight_dec = ShipmentEncoder("bf16-delta"), ShipmentDecoder("bf16-delta", N)
    held = [straight_dec.decode(straight_enc.encode(th)).clone() for th in traj]
    enc = ShipmentEncoder("bf16-delta")
    for th in traj[:3]:
        enc.encode(th)
    state = enc.state_dict()
    resumed, dec = ShipmentEncoder("bf16-delta"), ShipmentDecoder("bf16-delta", N)  # new processes
    resumed.load_state_dict(state)
    first = resumed.encode(traj[3])
    assert first.dtype == torch.float32 and _nbytes(first) == 4 * N  # a keyframe after a restart
    assert torch.equal(dec.decode(first), held[3])  # ... of the values the uninterrupted anchor holds
    second = resumed.encode(traj[4])
    assert second.dtype == torch.bfloat16
    assert torch.equal(dec.decode(second), held[4])


def test_fp32_mode_is_the_weights_and_mismatches_are_refused():
    enc, dec = ShipmentEncoder("fp32"), ShipmentDecoder("fp32", N)
    for theta in _trajectory(2):
        payload = enc.encode(theta)
        assert payload.dtype == torch.float32 and torch.equal(dec.decode(payload), theta)
    assert enc.state_dict()["mirror"] is None
    dec = ShipmentDecoder("bf16-delta", N)
    dec.decode(torch.zeros(N))
    with pytest.raises(ValueError, match="expected 10000 torch.bfloat16"):
        dec.decode(torch.zeros(N))  # a keyframe where a delta is due
    with pytest.raises(ValueError, match="unknown anchor shipment mode"):
        ShipmentEncoder("fp16")
    with pytest.raises(ValueError, match="flat fp32"):
        ShipmentEncoder("bf16-delta").encode(torch.zeros(N, dtype=torch.float64))
