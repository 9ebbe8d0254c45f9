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


@pytest.mark.parametrize("mode,q", [("int8-delta", 127), ("int4-delta", 7)])
def test_integer_deltas_keep_identical_mirrors_and_their_error_is_one_payloads_rounding(mode, q):
    """N = 10000 is not a multiple of the block: the last block is padded. Sizes are exact; the
    two mirrors equal bit for bit; the error after each shipment is at most half a code step of
    that shipment's delta in its block (closed loop: it does not grow with the shipments)."""
    from megatron_cegrpo.anchor.shipment import BLOCK

    enc, dec = ShipmentEncoder(mode), ShipmentDecoder(mode, N)
    traj = _trajectory(8)
    blocks = -(-N // BLOCK)
    assert shipment_nbytes(N, mode, False) == blocks * 4 + (blocks * BLOCK if q == 127 else blocks * BLOCK // 2)
    errs = []
    for i, theta in enumerate(traj):
        prev = None if enc.mirror is None else enc.mirror.clone()
        payload = enc.encode(theta)
        assert _nbytes(payload) == shipment_nbytes(N, mode, keyframe=i == 0)
        assert payload.dtype == (torch.float32 if i == 0 else torch.uint8) == dec.buffer().dtype
        got = dec.decode(payload)
        assert torch.equal(got, enc.mirror)
        if i == 0:
            assert torch.equal(got, theta)
            continue
        delta = torch.zeros(blocks * BLOCK)
        delta[:N] = theta - prev
        half_step = (delta.view(blocks, BLOCK).abs().amax(1) / q / 2).repeat_interleave(BLOCK)[:N]
        err = (got - theta).abs()
        assert bool((err <= half_step * 1.001 + theta.abs() * 2.0 ** -22).all())
        errs.append(float(err.max()))
    assert max(errs[-3:]) < 2 * max(errs[:3])  # no accumulation over the run


@pytest.mark.parametrize("mode", ["bf16-delta", "int8-delta", "int4-delta"])
def test_no_keyframe_when_the_anchor_holds_the_weights(mode):
    """New run: the digests agree, theta(0) is not sent at all, the next shipment is a delta;
    a different base on the anchor's side: the fp32 keyframe, as before."""
    traj = _trajectory(3)
    enc, dec = ShipmentEncoder(mode), ShipmentDecoder(mode, N)
    digest = enc.start(traj[0].clone())
    assert dec.agree(digest, traj[0].clone(), new_run=True)
    enc.agreed(True)
    assert enc.encode(traj[0]) is None and torch.equal(dec.skip(), traj[0])  # nothing crosses
    payload = enc.encode(traj[1])
    assert _nbytes(payload) == shipment_nbytes(N, mode, keyframe=False)
    assert torch.equal(dec.decode(payload), enc.mirror)
    # another base file on the anchor: refused, keyframe first
    enc, dec = ShipmentEncoder(mode), ShipmentDecoder(mode, N)
    digest = enc.start(traj[0].clone())
    assert not dec.agree(digest, traj[0] + 1e-3, new_run=True)
    enc.agreed(False)
    first = enc.encode(traj[0])
    assert first.dtype == torch.float32 and torch.equal(first, traj[0]) and torch.equal(dec.decode(first), traj[0])
    with pytest.raises(RuntimeError, match="theta\\(0\\) changed"):
        moved = ShipmentEncoder(mode)
        moved.agreed(dec.agree(moved.start(traj[0].clone()), traj[0], new_run=True))
        moved.encode(traj[1])  # the skipped shipment must be the agreed theta(0)


@pytest.mark.parametrize("mode", ["bf16-delta", "int4-delta"])
def test_resume_agrees_on_the_restored_mirror_and_sends_only_the_delta(mode):
    """After a restart the stage's checkpointed mirror and the anchor's newest ring entry are the
    same values: no keyframe, and the values equal the uninterrupted run's bit for bit."""
    traj = _trajectory(5)
    s_enc, s_dec = ShipmentEncoder(mode), ShipmentDecoder(mode, N)
    held = [s_dec.decode(s_enc.encode(th)).clone() for th in traj]
    enc = ShipmentEncoder(mode)
    for th in traj[:3]:
        enc.encode(th)
    resumed, dec = ShipmentEncoder(mode), ShipmentDecoder(mode, N)
    resumed.load_state_dict(enc.state_dict())
    assert dec.agree(resumed.start(traj[3].clone()), held[2].clone(), new_run=False)
    resumed.agreed(True)
    payload = resumed.encode(traj[3])
    assert _nbytes(payload) == shipment_nbytes(N, mode, keyframe=False)
    assert torch.equal(dec.decode(payload), held[3]) and not dec.skip_next
    assert torch.equal(dec.decode(resumed.encode(traj[4])), held[4])


@pytest.mark.parametrize("mode,bound", [("int8-delta", 0.02), ("int4-delta", 0.25)])
def test_secant_on_integer_coded_reconstructions(mode, bound):
    """The forecast's error against the exact secant, relative to its displacement (measured here:
    see docs/anchor.md); bf16 deltas' is < 0.005 (test above)."""
    traj = _trajectory(2, lr=1e-4)
    enc, dec = ShipmentEncoder(mode), ShipmentDecoder(mode, N)
    exact, coded = CheckpointRing(4, 4), CheckpointRing(4, 4)
    for s, theta in zip((0, 4, 8), traj):
        exact.put(s, {"w": theta})
        coded.put(s, {"w": dec.decode(enc.encode(theta)).clone()})
    want = secant_forecast(exact, 12, 4, 4).weights["w"]
    got = secant_forecast(coded, 12, 4, 4).weights["w"]
    rel = float((got - want).norm() / (want - traj[1]).norm())
    print(f"{mode}: secant error / displacement = {rel:.4f}")
    assert rel < bound


def test_ship_sign_agreement_against_an_exact_replay():
    """``anchor/ship_sign_agreement``: sign(M) after the shipped weights' gradient against the sign M
    would have from the exact weights' gradient, from the same M before the update."""
    from megatron_cegrpo.anchor.memory import AnchorMemory
    from megatron_cegrpo.anchor.worker import sign_agreement_with

    g = torch.Generator().manual_seed(3)
    prev = {"a": torch.randn(6, generator=g), "b": torch.randn(4, generator=g)}
    shipped = {"a": torch.randn(6, generator=g), "b": torch.randn(4, generator=g)}
    exact = {"a": shipped["a"].clone(), "b": -10 * shipped["b"]}  # b's gradient points elsewhere
    mem = AnchorMemory([("a", (6,)), ("b", (4,))], decay=0.25)
    mem.update(prev)
    mem.update(shipped)
    assert sign_agreement_with(mem, shipped, shipped) == 1.0
    want = {n: 0.25 * (0.75 * prev[n]) + 0.75 * exact[n] for n in prev}  # M before the update: 0.75 prev
    agree = sum(int((torch.sign(mem.tensor(n)) == torch.sign(want[n])).sum()) for n in prev)
    assert sign_agreement_with(mem, shipped, exact) == agree / 10 < 1.0
