"""``pcaq/ema=beta``: the forward basis fitted to the sender's exponential moving average of the
second moment of every message it coded (issue 32 item 3; ``compression/history.py``). The history
against the formula, the sent basis against its eigenvectors, bytes and decodes unchanged, a
resume bit for bit, lower error than a first-message basis on messages that differ, bad specs."""

import pytest
import torch

from megatron_cegrpo.compression import build_codec

from test_window_basis import SHAPE, _ctx, _data  # the held-basis tests' shape ([32, 2, 48]), context and data

SPEC = "pcaq/rank=10/ema=0.75:lrq/rank=6"


def _rows(x):
    return x.reshape(-1, x.shape[-1]).float()


def test_history_is_the_moving_average_and_the_basis_its_eigenvectors():
    snd, rcv = build_codec(SPEC, 0.25), build_codec(SPEC, 0.25)
    msgs = [(_ctx(0, (0, 1)), _data(1)), (_ctx(0, (2, 3)), _data(2)), (_ctx(1, (0, 1)), _data(3))]
    expect = None
    for ctx, x in msgs:
        rows = _rows(x)
        idx = torch.topk(rows.norm(dim=-1), 2).indices  # pcaq's default: 1 outlier token a sequence, b = 2
        z = rows.index_fill(0, idx, 0.0)
        g = z.t() @ z / rows.shape[0]
        expect = g if expect is None else 0.75 * expect + 0.25 * g
        p = snd.encode_forward(x, ctx)
        y = rcv.decode_forward(p, ctx, SHAPE)
        assert torch.equal(snd.decode_sent_forward(p, ctx, SHAPE), y)
    assert torch.allclose(snd.fwd._history[0], expect, rtol=1e-5, atol=1e-6)
    # the step-1 message carried the basis: the span of the top-10 eigenvectors of the history after it
    v = rcv.fwd._state["recv"][(0, 1)][0]  # fp32 [10, 48], the fp16 rows
    evecs = torch.linalg.eigh(expect.double()).eigenvectors[:, -10:].float()
    proj_sent, proj_eig = v.t() @ v, evecs @ evecs.t()
    assert (proj_sent - proj_eig).abs().max() < 5e-3  # fp16 rows
    assert rcv.fwd._history == {}  # the receiver keeps no history: it needs none


def test_bytes_are_those_of_the_first_message_basis():
    """The payloads themselves (basis-carrying or not, fp32 and bf16 wires) are as long as the
    ``ema=0`` codec's on the same messages, and as ``nbytes`` says."""
    for dtype, elem in ((torch.float32, 4), (torch.bfloat16, 2)):
        a, b = build_codec(SPEC, 0.25), build_codec("pcaq/rank=10:lrq/rank=6", 0.25)
        for step in range(2):
            for ids in ((0, 1), (2, 3)):
                ctx, x = _ctx(step, ids), _data(10 * step + ids[0]).to(dtype)
                pa, pb = a.encode_forward(x, ctx), b.encode_forward(x, ctx)
                assert pa.numel() * elem == pb.numel() * elem == a.fwd.nbytes(SHAPE, elem, ids == (0, 1))


def _mixed(seed):
    """[32, 2, 48]: each message in its own 8 of 12 fixed directions (equal scales), plus noise."""
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(7)
    basis = torch.linalg.qr(torch.randn(48, 48, generator=gb)).Q[:12]
    keep = torch.randperm(12, generator=g)[:8]
    coef = torch.zeros(32, 2, 12)
    coef[..., keep] = torch.randn(32, 2, 8, generator=g)
    return coef @ basis + 0.01 * torch.randn(32, 2, 48, generator=g)


def test_a_history_basis_codes_unlike_messages_better_than_the_first_message_basis():
    """Messages that use different directions: a basis from one message misses the others'
    directions, the history's covers the directions of them all (rank 10 of 12)."""
    errs = {}
    for spec in (SPEC, "pcaq/rank=10:lrq/rank=6"):
        snd, rcv = build_codec(spec, 0.25), build_codec(spec, 0.25)
        e = []
        for step in range(6):
            for ids in ((0, 1), (2, 3), (4, 5), (6, 7)):
                ctx, x = _ctx(step, ids), _mixed(100 * step + ids[0])
                y = rcv.decode_forward(snd.encode_forward(x, ctx), ctx, SHAPE)
                if step >= 2 and ids != (0, 1):  # a history of 2 steps; messages not the basis's own
                    e.append(((y - x).norm() / x.norm()).item())
        errs[spec] = sum(e) / len(e)
    assert errs[SPEC] < 0.8 * errs["pcaq/rank=10:lrq/rank=6"], errs


@pytest.mark.parametrize("every", [1, 2])
def test_resume_codes_bit_for_bit(every):
    """A run checkpointed after step 2 and resumed sends step 3's payloads bit for bit as the
    uninterrupted run (every=2: inside a window, so the held basis comes from the state too)."""
    spec = f"pcaq/rank=10/every={every}/ema=0.9:lrq/rank=6"
    straight, first, last = build_codec(spec, 0.25), build_codec(spec, 0.25), []
    for step in range(4):
        for ids in ((0, 1), (2, 3)):
            x, ctx = _data(10 * step + ids[0]), _ctx(step, ids)
            p = straight.encode_forward(x, ctx)
            if step < 3:
                first.encode_forward(x, ctx)
            else:
                last.append(p)
    state = first.state_dict()
    assert "history" in state["fwd"]
    resumed = build_codec(spec, 0.25)
    resumed.load_state_dict(state)
    for ids, p in zip(((0, 1), (2, 3)), last):
        # as raw bits: a payload's bytes viewed as fp32 can spell a NaN, which equals nothing
        again = resumed.encode_forward(_data(30 + ids[0]), _ctx(3, ids))
        assert torch.equal(again.view(torch.int32), p.view(torch.int32))
    assert torch.equal(resumed.fwd._history[0], straight.fwd._history[0])


def test_a_history_does_not_load_into_a_half_without_one():
    src = build_codec(SPEC, 0.25)
    src.encode_forward(_data(1), _ctx(0))
    with pytest.raises(ValueError, match=r"second-moment history, this run's has ema=0; fix: resume with"):
        build_codec("pcaq/rank=10:lrq/rank=6", 0.25).load_state_dict(src.state_dict())


@pytest.mark.parametrize("spec, msg", [
    ("pcaq/ema=1:lrq", r"pcaq/ema=1.0: ema is the decay .*fix: pcaq/every=2/ema=0.9"),
    ("pcaq/warm=1/ema=0.9:lrq", r"pcaq/ema=0.9: .*with warm=0"),
    ("pcaq:lrq/ema=0.9", r"lrq takes no parameter 'ema'")])
def test_bad_ema_names_the_fix(spec, msg):
    with pytest.raises(ValueError, match=msg):
        build_codec(spec, 0.05)


def test_a_non_finite_message_is_refused_before_it_joins_the_history():
    """A NaN/inf message that carries no basis stops the run with one line and leaves the history
    as it was (folded in, it would make every later basis of the run, and the checkpoint, unusable)."""
    c = build_codec(SPEC, 0.25)
    c.encode_forward(_data(1), _ctx(0, (0, 1)))  # carries the step's basis
    before = c.fwd._history[0].clone()
    x = _data(2)
    x[3:6, 0, 5] = float("inf")  # 3 tokens: more than the 2 outliers, which leave the history
    with pytest.raises(FloatingPointError, match=r"pcaq/ema: .* the second-moment history is left as it was"):
        c.encode_forward(x, _ctx(0, (2, 3)))
    assert torch.equal(c.fwd._history[0], before)
