"""Warm-started bases of the subspace halves (``warm=q``: ``subspace.warm_basis``, issue 10 item 6)."""

import re

import pytest
import torch

from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.compression import BoundaryContext, build_codec
from megatron_cegrpo.compression.subspace import top_basis, warm_basis
from megatron_cegrpo.errors import ConfigError

from distributed_util import plan_of

SHAPE = (32, 2, 48)  # N = 64 tokens, d = 48


def _ctx(step, ids=(0, 1), boundary=0):
    return BoundaryContext(seed=1, boundary=boundary, step=step, sample_ids=torch.tensor(list(ids)))


def _data(seed, shape=SHAPE, rank=12, drift=0.0):
    """Spectrum 10 .. 0.1 on a fixed basis (rotated by ``drift``), plus 1 % noise."""
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(7)
    s, b, d = shape
    basis = torch.linalg.qr(torch.randn(d, d, generator=gb)).Q[:rank]
    basis = basis + drift * torch.randn(rank, d, generator=g)
    return (torch.randn(s, b, rank, generator=g) * torch.logspace(1, -1, rank)) @ basis \
        + 0.01 * torch.randn(s, b, d, generator=g)


def _same(a, b):
    """Bit-identical payloads (raw bytes viewed as floats may hold NaN patterns: compare as int32)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _max_angle(a, b):
    """Largest principal angle (radians) between the row spaces of a and b [r, d]."""
    qa, qb = torch.linalg.qr(a.double().t()).Q, torch.linalg.qr(b.double().t()).Q
    cos = torch.linalg.svdvals(qa.t() @ qb).clamp(max=1.0)
    return float(torch.arccos(cos.min()))


def test_warm_basis_converges_to_the_eigh_basis_on_a_fixed_matrix():
    """From a random start, subspace iteration on a fixed x reaches top_basis's top-6 subspace
    (eigengap lambda_7 / lambda_6 = 0.43): largest principal angle < 1e-3 rad (the fp16 rows'
    rounding), variances within 1e-3, and the angle shrinks with the iterations."""
    x = _data(0).reshape(-1, SHAPE[2])
    v_ref, lam_ref = top_basis(x, 6)
    start = torch.randn(6, SHAPE[2], generator=torch.Generator().manual_seed(3))
    angles = [_max_angle(warm_basis(x, start, 6, it)[0].float(), v_ref.float()) for it in (1, 4, 30)]
    assert angles[0] > 10 * angles[2] and angles[1] > angles[2]
    assert angles[2] < 1e-3
    v, lam = warm_basis(x, start, 6, 30)
    assert torch.allclose(lam, lam_ref, rtol=1e-3)
    assert (lam[:-1] >= lam[1:]).all()  # sorted as top_basis's
    # rows are orthonormal up to fp16 rounding
    assert torch.allclose(v.float() @ v.float().t(), torch.eye(6), atol=2e-3)


def test_one_warm_iteration_from_the_previous_micro_batch_keeps_the_energy():
    """x of a micro-batch whose basis drifted a little from the previous one's: one iteration
    from the previous basis keeps the reconstruction error within 2 % of top_basis's."""
    prev, x = _data(1).reshape(-1, 48), _data(2, drift=0.02).reshape(-1, 48)
    v_prev, _ = top_basis(prev, 12)
    err = lambda v: float((x - x @ v.float().t() @ v.float()).norm() / x.norm())  # noqa: E731
    e_ref, e_warm = err(top_basis(x, 12)[0]), err(warm_basis(x, v_prev, 12, 1)[0])
    assert e_ref <= e_warm <= 1.02 * e_ref + 1e-4


def test_warm_basis_grows_shrinks_and_handles_fewer_tokens_than_rows():
    x = _data(4).reshape(-1, 48)
    v8, _ = top_basis(x, 8)
    v12, lam12 = warm_basis(x, v8, 12, 2)  # 4 rows from the fixed-seed Gaussian
    assert v12.shape == (12, 48) and v12.dtype == torch.float16 and lam12.shape == (12,)
    assert torch.equal(v12, warm_basis(x, v8, 12, 2)[0])  # deterministic
    v4, _ = warm_basis(x, v12, 4, 1)
    assert _max_angle(v4.float(), top_basis(x, 4)[0].float()) < 0.05
    few = x[:5]  # N = 5 < r = 8: rows beyond 5 are zero, as top_basis's
    v, lam = warm_basis(few, v8, 8, 1)
    assert torch.count_nonzero(v[5:]) == 0 and torch.count_nonzero(lam[5:]) == 0
    with pytest.raises(ValueError, match="v_prev"):
        warm_basis(x, torch.zeros(4, 40), 4, 1)


@pytest.mark.parametrize("spec", ["rpq/rank=10/warm=1:lrq/rank=6/warm=1", "pcaq/rank=10/warm=2:lrq/warm=1"])
def test_round_trip_bytes_as_documented_and_both_ends_bit_identical(spec):
    """warm changes no byte: every payload has the length the warm=0 spec documents (the basis
    is still sent), the receiver (a separate instance, no warm state) decodes bit for bit what
    the sender's decode_sent gives, the first basis is top_basis's (cold start) and the later
    ones are warm (they differ from warm=0's bits but code the data as well)."""
    cold_spec = spec.replace("/warm=1", "").replace("/warm=2", "")
    sender, receiver, cold = build_codec(spec, 0.25), build_codec(spec, 0.25), build_codec(cold_spec, 0.25)
    warm_payloads = 0
    for step in range(4):
        for ids in ((0, 1), (2, 3)):
            x, g = _data(10 * step + ids[0]), 1e-3 * _data(100 + step + ids[0], rank=5)
            ctx = _ctx(step, ids)
            for direction in ("fwd", "bwd"):
                t = x if direction == "fwd" else g
                enc = sender.encode_forward if direction == "fwd" else sender.encode_backward
                cenc = cold.encode_forward if direction == "fwd" else cold.encode_backward
                shape = receiver.wire_shape(direction, SHAPE, ctx, torch.float32, "recv")
                p, pc = enc(t, ctx), cenc(t, ctx)
                assert tuple(p.shape) == shape == tuple(pc.shape)
                if direction == "fwd":
                    y = receiver.decode_forward(p, ctx, SHAPE)
                    assert torch.equal(sender.decode_sent_forward(p, ctx, SHAPE), y)
                    yc = cold.decode_forward(pc, ctx, SHAPE)
                else:
                    y, yc = receiver.decode_backward(p, ctx, SHAPE), cold.decode_backward(pc, ctx, SHAPE)
                    assert torch.equal(sender.decode_backward(p, ctx, SHAPE), y)
                if step == 0 and ids == (0, 1):
                    assert _same(p, pc)  # the cold start is the fresh eigh basis, bit for bit
                else:
                    warm_payloads += int(not _same(p, pc))
                rel = float((y - t).norm() / t.norm())
                assert rel <= 1.05 * float((yc - t).norm() / t.norm()) + 1e-3
    assert warm_payloads > 0
    assert set(sender.state_dict()) == {"fwd", "bwd"} and receiver.state_dict() == {"fwd": {"warm_basis": {}},
                                                                                   "bwd": {"warm_basis": {}}}


def test_default_specs_keep_no_state_and_warm_state_round_trips_through_a_checkpoint():
    """warm=0 halves have no state (checkpoints of existing specs unchanged); a warm pair's
    state restores the sender exactly (same next payload), and a warm=0 run refuses it."""
    assert build_codec("rpq:lrq", 0.05).state_dict() == {} == build_codec("pcaq:lrq", 0.05).state_dict()
    spec = "rpq/rank=10/warm=1:lrq/rank=6/warm=1"
    a = build_codec(spec, 0.25)
    for step in range(2):
        a.encode_forward(_data(step), _ctx(step))
        a.encode_backward(1e-3 * _data(50 + step), _ctx(step))
    state = a.state_dict()
    assert state["fwd"]["warm_basis"][0].shape == (10, 48) and state["bwd"]["warm_basis"][0].shape == (6, 48)
    b = build_codec(spec, 0.25)
    b.load_state_dict(state)
    x = _data(9)
    assert _same(a.encode_forward(x, _ctx(5)), b.encode_forward(x, _ctx(5)))
    fresh = build_codec(spec, 0.25)  # without the state: a fresh eigh, other bits
    assert not _same(fresh.encode_forward(x, _ctx(5)), b.encode_forward(x, _ctx(6)))
    with pytest.raises(ValueError, match=r"rpq half has a warm-started basis.*rpq/warm=1"):
        build_codec("rpq/rank=10:lrq/rank=6/warm=1", 0.25).load_state_dict(state)
    build_codec("rpq:lrq", 0.05).load_state_dict({})  # an old checkpoint's empty state


@pytest.mark.parametrize("bad, msg", [("rpq/warm=5:lrq", r"rpq/warm=5: warm is the number .* fix: rpq/warm=1"),
                                      ("rpq:lrq/warm=-1", r"lrq/warm=-1: .* fix: lrq/warm=1"),
                                      ("pcaq/warm=9:lrq", r"pcaq/warm=9"),
                                      ("rpq/warm=0.5:lrq", r"rpq/warm='0.5' is not a number")])
def test_bad_warm_values_are_rejected_naming_the_flag(bad, msg):
    with pytest.raises(ValueError, match=msg):
        build_codec(bad, 0.05)


def test_parsing_and_replica_invariance():
    c = build_codec("rpq/warm=2:lrq/warm=1", 0.05)
    assert (c.fwd.warm, c.bwd.warm, c.fwd.rank, c.bwd.rank) == (2, 1, 144, 48)
    assert build_codec("rpq:lrq", 0.05).replica_invariant
    assert not c.replica_invariant and not build_codec("rpq:lrq/warm=1", 0.05).replica_invariant


@pytest.mark.parametrize("spec", ["rpq/warm=1:lrq/warm=1", "rpq:lrq/warm=1"])
def test_data_parallel_refuses_a_warm_basis_with_its_one_line_message(spec):
    cfg = build_config(parse_args(["--model", "tiny-llama", "--pipeline-model-parallel-size", "2",
                                   "--rollout-batch-size", "2", "--num-generations", "4", "--micro-batch-size", "2",
                                   "--anchor-ranks", "0", "--boundary-codec", spec]))
    with pytest.raises(ConfigError, match="^" + re.escape(f"--boundary-codec {spec} keeps a basis")) as e:
        plan_of(cfg, 4)  # the run plan's check (plan.check_codec_layout)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--boundary-codec {spec} keeps a basis across micro-batches")
    cfg.validate(world_size=2)
