"""``pcaq/prefix=1``: the sequences' common prefix (a group's prompt) coded once, its coefficient
bytes given to the other rows; same message bytes, exact copies where the rows are equal."""

import math

import pytest
import torch

from megatron_cegrpo.compression import BoundaryContext, build_codec
from megatron_cegrpo.compression.prefix import common_prefix
from megatron_cegrpo.compression.wire import packed_nbytes

S, B, D, P = 64, 4, 48, 30  # positions, sequences, width, the shared prompt's length
SHAPE = (S, B, D)


def _ctx(step=0):
    return BoundaryContext(seed=1, boundary=0, step=step, sample_ids=torch.arange(B))


def _message(seed, prompt=P, dtype=torch.float32):
    """[S, B, D]: a low-rank signal plus noise; positions < ``prompt`` the same in every sequence,
    position 0 a 150x-norm sink."""
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(7)
    basis = torch.linalg.qr(torch.randn(D, D, generator=gb)).Q[:12]
    x = (torch.randn(S, B, 12, generator=g) * torch.logspace(1, -1, 12)) @ basis + 0.05 * torch.randn(S, B, D, generator=g)
    x[:prompt] = x[:prompt, :1]
    x[0] = 150 * torch.randn(D, generator=g)
    return x.to(dtype)


def test_common_prefix_counts_leading_bit_identical_positions():
    x = _message(0)
    assert common_prefix(x) == P
    x[3, 2, 5] = torch.nextafter(x[3, 2, 5], torch.tensor(float("inf")))  # one ulp apart is not equal
    assert common_prefix(x) == 3
    x[0, 1] += 1
    assert common_prefix(x) == 0
    assert common_prefix(_message(1)[:, :1]) == S  # one sequence: every position is shared


@pytest.mark.parametrize("dtype,e", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_prefix_keeps_the_bytes_copies_the_prompt_and_codes_the_rest_better(dtype, e):
    spec, plain_spec = "pcaq/rank=10/prefix=1:lrq/rank=6", "pcaq/rank=10:lrq/rank=6"
    sender, receiver, plain = build_codec(spec, 0.05), build_codec(spec, 0.05), build_codec(plain_spec, 0.05)
    half = sender.fwd
    # the documented sizes: 4 header bytes; the coefficient bytes of S B rows at B bits shared by N' rows
    bits = half.coef_bits(SHAPE, e)
    r, k = 10, B  # outliers=1 a sequence
    assert bits == min(8 * r, math.floor(8 * (half.budget(SHAPE, e) * (1 - half.share) - 4 * r - k * (2 * D + 4) - 4)
                                         / (S * B)))
    n, bits_p = half.prefix_coef_bits(SHAPE, e, P)
    assert n == P + (S - P) * B
    assert bits_p == min(8 * 10, 8 * packed_nbytes(S * B, bits) // n) and bits_p > bits
    assert half.prefix_coef_bits(SHAPE, e, 0) == (S * B, bits)
    errs = []
    for step in range(3):
        x, ctx = _message(step, dtype=dtype), _ctx(step)
        p = sender.encode_forward(x, ctx)
        assert p.numel() * e == half.nbytes(SHAPE, e, True)
        # within the message's budget less the basis' share, as without the prefix (the header paid from it)
        assert half.nbytes(SHAPE, e, False) <= half.budget(SHAPE, e) * (1 - half.share) + e
        assert abs(plain.fwd.nbytes(SHAPE, e, True) - half.nbytes(SHAPE, e, True)) <= packed_nbytes(S * B, 1) + 4
        y = receiver.decode_forward(p, ctx, SHAPE)
        assert torch.equal(sender.decode_sent_forward(p, ctx, SHAPE), y)
        assert torch.equal(y[:P], y[:P, :1].expand(P, B, D))  # the prompt decoded once, copied bit for bit
        assert torch.equal(y[0], x[0].half().to(dtype).expand(B, D))  # the sink: an fp16 outlier row
        y0 = plain.decode_forward(plain.encode_forward(x, ctx), ctx, SHAPE)
        errs.append(((y[1:] - x[1:]).float().norm() / (y0[1:] - x[1:]).float().norm()).item())
    assert max(errs) < 0.9, errs  # the prompt's bytes went to the rest


def test_prefix_zero_when_sequences_differ_still_decodes_at_the_same_bytes():
    spec = "pcaq/rank=10/prefix=1:lrq/rank=6"
    sender, receiver, plain = build_codec(spec, 0.05), build_codec(spec, 0.05), build_codec("pcaq/rank=10:lrq/rank=6", 0.05)
    x = _message(5, prompt=0)
    x[0] = x[0] + torch.arange(B)[:, None].float()  # even position 0 differs
    ctx = _ctx()
    p = sender.encode_forward(x, ctx)
    y = receiver.decode_forward(p, ctx, SHAPE)
    assert p.numel() * 4 == sender.fwd.nbytes(SHAPE, 4, True)
    y0 = plain.decode_forward(plain.encode_forward(x, ctx), ctx, SHAPE)
    assert ((y - x).norm() / (y0 - x).norm()).item() < 1.05  # the same coding, 4 bytes fewer


def test_prefix_bad_specs_and_corrupt_header():
    with pytest.raises(ValueError, match=r"pcaq/prefix=2"):
        build_codec("pcaq/prefix=2:lrq", 0.05)
    with pytest.raises(ValueError, match=r"not with sink=1"):
        build_codec("pcaq/prefix=1/sink=1/outliers=0:lrq", 0.05)
    with pytest.raises(ValueError, match=r"lrq takes no parameter 'prefix'"):
        build_codec("pcaq:lrq/prefix=1", 0.05)
    for opt in ("prefix", "prepass"):  # a pcaq backward half: gradients differ per sequence, the prepass is a forward
        with pytest.raises(ValueError, match=rf"^pcaq/{opt}=1 is a forward-half option .* fix: pcaq/{opt}=1:pcaq$"):
            build_codec(f"pcaq:pcaq/{opt}=1", 0.05)
    sender, receiver = build_codec("pcaq/rank=10/prefix=1:lrq/rank=6", 0.05), build_codec("pcaq/rank=10/prefix=1:lrq/rank=6", 0.05)
    p = sender.encode_forward(_message(0), _ctx()).clone()
    p.view(torch.int32)[0] = S + 5
    with pytest.raises(ValueError, match=r"common prefix 69 is not within the message's 64 positions"):
        receiver.decode_forward(p, _ctx(), SHAPE)


def _unlike(seed):
    """[S, B, D] messages from different 3-dim subspaces per seed (one prompt's responses each)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(D, D, generator=g)).Q[:3]
    return (torch.randn(S, B, 3, generator=g) * 5) @ basis + 0.01 * torch.randn(S, B, D, generator=g)


def test_prepass_fits_the_basis_to_the_whole_steps_states():
    """pcaq/prepass=1: the basis the first message carries is the top eigenvectors of the second
    moment of every message the prepass saw (sorted by the first message's variances); same
    bytes and receiver; the step's messages are coded far better than with the first message's
    basis; the Gram is forgotten once used, and a window already held ignores the prepass."""
    from megatron_cegrpo.compression.history import gram_basis, project_sorted

    spec = "pcaq/rank=12/prepass=1:lrq/rank=6"
    sender, receiver, plain = build_codec(spec, 0.05), build_codec(spec, 0.05), build_codec("pcaq/rank=12:lrq/rank=6", 0.05)
    msgs = [_unlike(s) for s in range(4)]
    for m in msgs:
        sender.observe_prepass(m, _ctx(3))
    half = sender.fwd
    gram = sum(x.reshape(-1, D).t() @ x.reshape(-1, D) for x in
               [m.reshape(-1, D).index_fill(0, half._select_rows(m.reshape(-1, D), SHAPE)[3], 0.0) for m in msgs])
    assert torch.allclose(half._prepass[(0, 3)], gram, rtol=1e-5, atol=1e-3)
    expect_v, _, _ = project_sorted(msgs[0].reshape(-1, D), half._select_rows(msgs[0].reshape(-1, D), SHAPE)[3],
                                    gram_basis(half._prepass[(0, 3)].clone(), 12))
    err, err0 = [], []
    for i, m in enumerate(msgs):
        p = sender.encode_forward(m, _ctx(3))
        assert p.numel() * 4 == plain.fwd.nbytes(SHAPE, 4, i == 0)
        y = receiver.decode_forward(p, _ctx(3), SHAPE)
        assert torch.equal(sender.decode_sent_forward(p, _ctx(3), SHAPE), y)
        if i == 0:
            assert torch.equal(half._state["send"][(0, 3)][0], expect_v.float())  # the prepass basis was sent
            assert (0, 3) not in half._prepass  # used once
        y0 = plain.decode_forward(plain.encode_forward(m, _ctx(3)), _ctx(3), SHAPE)
        err.append((y - m).norm().item())
        err0.append((y0 - m).norm().item())
    # the first message pays (its basis was its own, now the step's), the others gain far more
    assert err[0] > err0[0] and max(err[1:]) < 0.3 * min(err0[1:]), (err, err0)
    assert sum(err) < 0.3 * sum(err0)
    assert not sender.prepass_due(_ctx(3)) and sender.prepass_due(_ctx(4))
    sender.observe_prepass(msgs[0], _ctx(3))  # the window's basis is held: nothing gathered
    assert half._prepass == {}
    win = build_codec("pcaq/rank=12/every=2/prepass=1:lrq/rank=6", 0.05)  # one basis serves steps 2 and 3
    assert win.prepass_due(_ctx(2)) and win.prepass_due(_ctx(3))
    win.observe_prepass(msgs[0], _ctx(2))
    win.encode_forward(msgs[0], _ctx(2))
    assert not win.prepass_due(_ctx(3)) and win.prepass_due(_ctx(4))
    assert not build_codec("pcaq/rank=12:lrq/rank=6", 0.05).prepass_due(_ctx(2))
    with pytest.raises(ValueError, match=r"pcaq/prepass=1"):
        build_codec("pcaq/prepass=1/ema=0.9:lrq", 0.05)
    with pytest.raises(ValueError, match=r"lrq takes no parameter 'prepass'"):
        build_codec("pcaq:lrq/prepass=1", 0.05)
    bad = _unlike(9)
    bad[2:6, :, 3] = float("nan")  # more rows than the outlier slots (a NaN row would be sent whole)
    with pytest.raises(FloatingPointError, match=r"prepass holds NaN"):
        build_codec(spec, 0.05).observe_prepass(bad, _ctx(4))
