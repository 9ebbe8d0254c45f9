"""Lagged warm bases (``lag=1``): the basis a message carries was built off the critical path,
on a background thread, from the previous message at that boundary (issue 10 item 6)."""

import pytest
import torch

from megatron_cegrpo.compression import BoundaryContext, build_codec
from megatron_cegrpo.compression.subspace import top_basis, warm_basis

SHAPE = (32, 2, 48)  # N = 64 tokens, d = 48


def _ctx(step, ids=(0, 1), boundary=0):
    return BoundaryContext(seed=1, boundary=boundary, step=step, sample_ids=torch.tensor(list(ids)))


def _data(seed, rank=12):
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(7)
    s, b, d = SHAPE
    basis = torch.linalg.qr(torch.randn(d, d, generator=gb)).Q[:rank]
    return (torch.randn(s, b, rank, generator=g) * torch.logspace(1, -1, rank)) @ basis \
        + 0.01 * torch.randn(s, b, d, generator=g)


def _same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _basis_of(payload, half, shape=SHAPE):
    """The fp16 basis rows [r, d] and fp32 variances a subspace-half payload carries (layout:
    subspace.py module docstring: outlier indices, outlier rows, basis, variances, ...)."""
    s, b, d = shape
    raw = payload.contiguous().view(torch.uint8)
    k, r = half.outlier_count(shape), half.basis_rows(shape, payload.element_size())
    off = 4 * k + 2 * k * d
    v = raw[off:off + 2 * r * d].clone().view(torch.float16).view(r, d)
    lam = raw[off + 2 * r * d:off + 2 * r * d + 4 * r].clone().view(torch.float32)
    return v, lam


@pytest.mark.parametrize("spec", ["lrq/rank=6/warm=1/lag=1", "pcaq/rank=10/outliers=1/warm=1/lag=1"])
def test_each_basis_is_the_warm_iteration_on_the_previous_message(spec):
    """Message 1 carries top_basis of its own data (cold start); message n + 1 carries, up to
    the row order (sorted by message n + 1's own variances, which are sent), the fp16 rows of
    one warm iteration on message n's data (outlier rows zeroed) from message n's basis; the
    variances sent are those of message n + 1's coefficients; a separate receiver decodes bit
    for bit what the sender's decode_sent gives; the bytes are those of lag=0."""
    half = build_codec(f"dense:{spec}", 0.25).bwd
    plain = build_codec(f"dense:{spec.replace('/lag=1', '')}", 0.25).bwd
    recv = build_codec(f"dense:{spec}", 0.25).bwd
    xs = [_data(s) for s in range(4)]
    nxt = None  # the basis the background job left for the next message (its rows unsorted)
    for n, t in enumerate(xs):
        ctx = _ctx(n)
        p = half.encode(t, ctx)
        assert p.shape == plain.encode(t, ctx).shape
        assert torch.equal(recv.decode(p, ctx, SHAPE), half.decode_sent(p, ctx, SHAPE))
        v, lam = _basis_of(p, half)
        r = v.shape[0]
        x = t.reshape(-1, 48).float()
        idx = torch.sort(torch.topk(x.norm(dim=-1), half.outlier_count(SHAPE)).indices).values
        xz = x.index_fill(0, idx, 0.0)
        if n == 0:
            v_ref, lam_ref = top_basis(xz, r)
            assert torch.equal(v, v_ref) and torch.equal(lam, lam_ref)
            start = v_ref.float()
        else:
            v_ref = nxt[:r].half()
            order = torch.argsort((xz @ v_ref.float().t()).square().mean(0), descending=True, stable=True)
            assert torch.equal(v, v_ref[order])
            assert torch.allclose(lam, (xz @ v.float().t()).square().mean(0), rtol=1e-6, atol=0)
            assert (lam[:-1] >= lam[1:]).all()
            start = nxt
        nxt = warm_basis(xz, start, max(r, half.rank), 1)[0].float()
    assert half.background_jobs == len(xs) - 1 or half._pending  # the last job may still run
    half._settle()
    assert half.background_jobs == len(xs) and half.background_s > 0


def test_state_resumes_bit_exactly_and_reset_waits_for_the_pending_basis():
    spec = "pcaq/rank=10/warm=1/lag=1:lrq/rank=6/warm=1/lag=1"
    a = build_codec(spec, 0.25)
    for step in range(2):
        a.encode_forward(_data(step), _ctx(step))
        a.encode_backward(1e-3 * _data(50 + step), _ctx(step))
    state = a.state_dict()  # waits for the background jobs: the state is the NEXT basis
    assert not a.fwd._pending and not a.bwd._pending
    assert state["fwd"]["warm_basis"][0].shape == (10, 48) and state["bwd"]["warm_basis"][0].shape == (6, 48)
    b = build_codec(spec, 0.25)
    b.load_state_dict(state)
    x, g = _data(9), 1e-3 * _data(59)
    assert _same(a.encode_forward(x, _ctx(5)), b.encode_forward(x, _ctx(5)))
    assert _same(a.encode_backward(g, _ctx(5)), b.encode_backward(g, _ctx(5)))
    fresh = build_codec(spec, 0.25)
    assert not _same(fresh.encode_forward(x, _ctx(5)), b.encode_forward(x, _ctx(6)))
    a.reset()
    assert not a.fwd._pending and a.fwd._warm_basis == {}
    c = build_codec(spec, 0.25)
    assert _same(a.encode_forward(x, _ctx(7)), c.encode_forward(x, _ctx(7)))  # after reset: a cold start


def test_rpq_lag_round_trip_and_later_crossings():
    """rpq with lag: first crossings carry the lagged basis, later crossings the coded delta;
    the receiver decodes what the sender's decode_sent gives."""
    spec = "rpq/rank=10/passes=2/warm=1/lag=1:lrq/rank=6/warm=1/lag=1"
    s, r = build_codec(spec, 0.25), build_codec(spec, 0.25)
    for step in range(3):
        x = _data(step)
        ctx = _ctx(step)
        for t in (x, x + 1e-3 * _data(70 + step)):
            p = s.encode_forward(t, ctx)
            assert torch.equal(r.decode_forward(p, ctx, SHAPE), s.decode_sent_forward(p, ctx, SHAPE))
    assert s.fwd.background_jobs + len(s.fwd._pending) == 3


@pytest.mark.parametrize("bad, msg", [("pcaq/lag=1:lrq", r"pcaq/lag=1: lag=1 .* needs warm >= 1; fix: pcaq/warm=1/lag=1"),
                                      ("rpq/warm=1/lag=2:lrq", r"rpq/lag=2"),
                                      ("pcaq:lrq/lag=1", r"lrq/lag=1: .* fix: lrq/warm=1/lag=1")])
def test_bad_lag_values_are_rejected_naming_the_flag(bad, msg):
    with pytest.raises(ValueError, match=msg):
        build_codec(bad, 0.05)
