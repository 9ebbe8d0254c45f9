"""A pcaq basis held over several steps (``pcaq/every=R``, issue 32 item 3): sent once a window,
the same at both ends, amortised in the documented bytes, kept across a checkpoint."""

import math

import pytest
import torch

from megatron_cegrpo.compression import BoundaryContext, build_codec
from megatron_cegrpo.compression.spec import spec_bytes

SHAPE = (32, 2, 48)  # N = 64 tokens, d = 48
SPEC = "pcaq/rank=10/every=3:lrq/rank=6"


def _ctx(step, ids=(0, 1)):
    return BoundaryContext(seed=1, boundary=0, step=step, sample_ids=torch.tensor(list(ids)))


def _data(seed):
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(7)
    basis = torch.linalg.qr(torch.randn(48, 48, generator=gb)).Q[:12]
    return (torch.randn(32, 2, 12, generator=g) * torch.logspace(1, -1, 12)) @ basis \
        + 0.01 * torch.randn(32, 2, 48, generator=g)


def _run(codecs, steps, e=4):
    """Forward messages of two micro-batches a step through (sender, receiver); returns the payload
    lengths in bytes and the receiver's decodes, asserting decode_sent == the receiver's decode."""
    sender, receiver = codecs
    sizes, outs = [], []
    for step in steps:
        for ids in ((0, 1), (2, 3)):
            ctx = _ctx(step, ids)
            p = sender.encode_forward(_data(10 * step + ids[0]), ctx)
            assert tuple(p.shape) == receiver.wire_shape("fwd", SHAPE, ctx, torch.float32, "recv")
            y = receiver.decode_forward(p, ctx, SHAPE)
            assert torch.equal(sender.decode_sent_forward(p, ctx, SHAPE), y)
            sizes.append(p.numel() * e)
            outs.append(y)
    return sizes, outs


def test_the_basis_is_sent_on_the_first_message_of_each_window_only():
    sizes, _ = _run((build_codec(SPEC, 0.25), build_codec(SPEC, 0.25)), range(7))
    half = build_codec(SPEC, 0.25).fwd
    first, later = half.nbytes(SHAPE, 4, True), half.nbytes(SHAPE, 4, False)
    assert first > later
    # steps 0..6, two messages each: windows start at steps 0, 3 and 6
    assert sizes == [first if i in (0, 6, 12) else later for i in range(14)]


def test_step_bytes_amortise_the_basis_over_the_window():
    held, fresh = build_codec(SPEC, 0.25), build_codec("pcaq/rank=10:lrq/rank=6", 0.25)
    first, later = held.fwd.nbytes(SHAPE, 4, True), held.fwd.nbytes(SHAPE, 4, False)
    fwd, _ = spec_bytes(held, SHAPE, 4, 4, 2)
    assert fwd == 4 * later + math.ceil((first - later) / 3)
    assert fwd < spec_bytes(fresh, SHAPE, 4, 4, 2)[0]


def test_a_resume_inside_a_window_decodes_as_the_straight_run():
    straight = (build_codec(SPEC, 0.25), build_codec(SPEC, 0.25))
    _, ys = _run(straight, range(5))
    first = (build_codec(SPEC, 0.25), build_codec(SPEC, 0.25))
    _run(first, range(4))  # stop after step 3: inside the window of steps 3..5
    state = [c.state_dict() for c in first]
    assert set(state[0]["fwd"]["window_basis"]) == {"send", "recv"}
    resumed = (build_codec(SPEC, 0.25), build_codec(SPEC, 0.25))
    for c, st in zip(resumed, state):
        c.load_state_dict(st)
    sizes, ys_resumed = _run(resumed, [4])
    assert sizes[0] == build_codec(SPEC, 0.25).fwd.nbytes(SHAPE, 4, False)  # no basis resent
    assert all(torch.equal(a, b) for a, b in zip(ys[-2:], ys_resumed))
    with pytest.raises(ValueError, match=r"every=1; fix: resume with the checkpoint's pcaq/every=R"):
        build_codec("pcaq/rank=10:lrq/rank=6", 0.25).load_state_dict(state[0])


@pytest.mark.parametrize("spec, msg", [("pcaq:lrq/every=2", r"lrq takes no parameter 'every'"),
                                       ("pcaq/every=0:lrq", r"pcaq/every=0: every is the number of steps")])
def test_bad_window_specs_name_the_fix(spec, msg):
    with pytest.raises(ValueError, match=msg):
        build_codec(spec, 0.05)


def _with_sink(seed, shared=True):
    """_data with a 150x-norm position 0, the same vector in every sequence when ``shared``."""
    x = _data(seed)
    g = torch.Generator().manual_seed(seed + 99)
    row = 150 * torch.randn(48, generator=g)
    x[0] = row if shared else row + torch.randn(2, 48, generator=g)
    return x


def test_a_shared_sink_crosses_once_per_message_and_exactly():
    """pcaq/sink=1/outliers=0: one fp16 row and a flag instead of b outlier rows (the documented
    bytes), position 0 decoded to that row in every sequence, the other tokens coded better than
    when the sink sets the scales; rows that differ are coded like any token (flag 0)."""
    spec = "pcaq/rank=10/sink=1/outliers=0:lrq/rank=6"
    sender, receiver = build_codec(spec, 0.25), build_codec(spec, 0.25)
    half = sender.fwd
    d, b = SHAPE[2], SHAPE[1]
    # at 5 %: the bytes the coefficients do not get are 2d + 1 for the sink against b (2d + 4) outlier bytes
    tight = build_codec(spec, 0.05).fwd
    plain = build_codec("pcaq/rank=10:lrq/rank=6", 0.05).fwd  # outliers=1: b rows of 2d + 4
    assert tight.outlier_count(SHAPE) == 0 and plain.outlier_count(SHAPE) == b
    assert tight.coef_bits(SHAPE, 4) == math.floor(
        8 * (tight.budget(SHAPE, 4) * (1 - tight.share) - 4 * 10 - (2 * d + 1)) / (SHAPE[0] * b))
    assert plain.coef_bits(SHAPE, 4) == math.floor(
        8 * (plain.budget(SHAPE, 4) * (1 - plain.share) - 4 * 10 - b * (2 * d + 4)) / (SHAPE[0] * b))
    assert tight.coef_bits(SHAPE, 4) > plain.coef_bits(SHAPE, 4)
    x = _with_sink(3)
    ctx = _ctx(0)
    p = sender.encode_forward(x, ctx)
    assert p.numel() * 4 == half.nbytes(SHAPE, 4, True)
    y = receiver.decode_forward(p, ctx, SHAPE)
    assert torch.equal(sender.decode_sent_forward(p, ctx, SHAPE), y)
    assert torch.equal(y[0], x[0].half().float().expand(b, d))  # the sink, fp16-exact, in every sequence
    no_sink = build_codec("pcaq/rank=10/outliers=0:lrq/rank=6", 0.25)
    y0 = no_sink.decode_forward(no_sink.encode_forward(x, ctx), ctx, SHAPE)
    assert (y[1:] - x[1:]).norm() < 0.5 * (y0[1:] - x[1:]).norm()
    # position 0 differs between the sequences: flag 0, same bytes, decoded like the other tokens
    xd = _with_sink(4, shared=False)
    p2 = sender.encode_forward(xd, _ctx(1))
    assert p2.numel() * 4 == half.nbytes(SHAPE, 4, True)
    y2 = receiver.decode_forward(p2, _ctx(1), SHAPE)
    assert not torch.equal(y2[0, 0], y2[0, 1]) and torch.isfinite(y2).all()
    with pytest.raises(ValueError, match=r"lrq takes no parameter 'sink'"):
        build_codec("pcaq:lrq/sink=1", 0.05)
