"""``rd=1`` (pcaq, lrq): coefficient bits allocated by the quantiser's own distortion,
``min(lambda_j, a_j**2 / (3 * 4**b))``, from the column scales the payload carries
(``quant.allocate_bits_rd``). The integer optimum against brute force, the same payload sizes as
the variance greedy, what it saves on heavy-tailed coefficients at 1-4 bits a column, and
bit-identical decodes at both ends of a codec."""

import itertools
import random

import pytest
import torch

from megatron_cegrpo.compression import build_codec
from megatron_cegrpo.compression.quant import (allocate_bits, allocate_bits_rd, dequantize_columns_rd,
                                               quantize_columns, quantize_columns_rd)
from megatron_cegrpo.compression.wire import ByteReader

from test_window_basis import SHAPE, _ctx, _data  # the held-basis tests' shape, context and data


def _model(lam, a, bits):
    return sum(l if b == 0 else min(l, x * x / 3 / 4 ** b) for l, x, b in zip(lam, a, bits))


def test_the_allocation_is_the_integer_optimum_of_its_model():
    """Against every allocation of the same total (r <= 4 columns, max_bits <= 4): the least
    model distortion, the exact sum, and never above the variance greedy's bits under the model."""
    rng = random.Random(0)
    for _ in range(300):
        r, mb = rng.randint(1, 4), rng.randint(1, 4)
        lam = [rng.random() ** 3 * 10 for _ in range(r)]
        a = [(v ** 0.5) * rng.uniform(1, 8) for v in lam]
        total = rng.randint(0, mb * r + 3)
        bits = allocate_bits_rd(lam, a, total, mb)
        want = min(total, mb * r)
        assert sum(bits) == want and all(0 <= b <= mb for b in bits)
        best = min(_model(lam, a, c) for c in itertools.product(range(mb + 1), repeat=r) if sum(c) == want)
        assert _model(lam, a, bits) == pytest.approx(best, rel=1e-12, abs=1e-15)
        assert _model(lam, a, bits) <= _model(lam, a, allocate_bits(lam, total, mb)) + 1e-12


def test_a_heavy_tailed_column_gets_no_bits_at_a_low_rate():
    """Two columns of equal variance, one of range 20 sigma (an outlier token), 2 bits in all: the
    variance greedy gives each 1 bit; the quantiser's model gives both to the well-behaved column
    (1 bit over +-20 sigma, levels +-10 sigma, leaves about 100 sigma^2, worse than sending
    nothing)."""
    assert allocate_bits([1.0, 1.0], 2) == [1, 1]
    assert allocate_bits_rd([1.0, 1.0], [2.0, 20.0], 2) == [2, 0]
    assert allocate_bits_rd([1.0, 1.0], [2.0, 2.0], 2) == [1, 1]
    assert allocate_bits_rd([], [], 5) == [] and allocate_bits_rd([1.0], [1.0], 0) == [0]
    with pytest.raises(ValueError, match="2 scales for 1 variances"):
        allocate_bits_rd([1.0], [1.0, 2.0], 4)


def test_heavy_tailed_coefficients_same_bytes_less_error():
    """Student-t (4 degrees of freedom) coefficients, variances falling as 1 / j^1.2 over 128
    columns, 284 rows: at 1, 2 and 3 bits a column the payload has the variance greedy's size and
    the decode's relative squared error is 0.180 against 1.133, 0.089 against 0.368 and 0.042
    against 0.070 (measured 2026-12-07); the decode reads the bits off the scales it receives."""
    torch.manual_seed(0)
    n, r = 284, 128
    lam = torch.tensor([1.0 / (j + 1) ** 1.2 for j in range(r)])
    x = torch.distributions.StudentT(4.0).sample((n, r)) * lam.sqrt()
    var = (x ** 2).mean(0).tolist()
    err = {}
    for per_col in (1, 2, 3):
        total = per_col * r
        p_greedy, hat_greedy = quantize_columns(x, allocate_bits(var, total))
        p_rd, bits = quantize_columns_rd(x, var, total)
        hat_rd = dequantize_columns_rd(ByteReader(p_rd), n, var, total)
        assert p_rd.numel() == p_greedy.numel() and sum(bits) == total
        assert torch.equal(p_rd[:4 * r].view(torch.float32), x.abs().amax(0))  # every scale is sent
        rel = lambda h: float(((h - x) ** 2).sum() / (x ** 2).sum())  # noqa: E731
        err[per_col] = (round(rel(hat_rd), 3), round(rel(hat_greedy), 3))
    assert err == {1: (0.180, 1.133), 2: (0.089, 0.368), 3: (0.042, 0.070)}


@pytest.mark.parametrize("spec", ["pcaq/rank=10/rd=1:lrq/rank=6/rd=1", "pcaq/rank=10/every=3/basis_bits=8/rd=1:lrq/rank=6"])
def test_the_codec_sends_the_same_bytes_and_decodes_alike_at_both_ends(spec):
    """``rd=1`` changes which columns get the bits, not how many bytes cross: every payload has
    the size of the ``rd=0`` codec's; the sender's and the receiver's decodes are bit-identical,
    forward and backward; the forward error stays within the ``rd=0`` codec's on the same data."""
    plain = spec.replace("/rd=1", "")
    snd, rcv, snd0, rcv0 = build_codec(spec, 0.25), build_codec(spec, 0.25), build_codec(plain, 0.25), build_codec(plain, 0.25)
    err, err0 = [], []
    for step in range(3):
        for ids in ((0, 1), (2, 3)):
            ctx, x = _ctx(step, ids), _data(10 * step + ids[0])
            p, p0 = snd.encode_forward(x, ctx), snd0.encode_forward(x, ctx)
            assert p.numel() == p0.numel()
            y = rcv.decode_forward(p, ctx, SHAPE)
            assert torch.equal(snd.decode_sent_forward(p, ctx, SHAPE), y)
            err.append(float((y - x).norm() / x.norm()))
            err0.append(float((rcv0.decode_forward(p0, ctx, SHAPE) - x).norm() / x.norm()))
            gb = snd.encode_backward(x, ctx)
            assert gb.numel() == snd0.encode_backward(x, ctx).numel()
            assert torch.equal(rcv.decode_backward(gb, ctx, SHAPE), snd.bwd.decode_sent(gb, ctx, SHAPE))
    assert sum(err) <= sum(err0) * 1.02, (err, err0)


def test_a_bad_rd_value_is_one_line_with_its_fix():
    with pytest.raises(ValueError, match=r"pcaq/rd=2: .*fix: pcaq/rd=1 \(or rd=0\)"):
        build_codec("pcaq/rd=2:lrq", 0.05)
    with pytest.raises(ValueError, match="rpq takes no parameter 'rd'"):
        build_codec("rpq/rd=1:lrq", 0.05)
