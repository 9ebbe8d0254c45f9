"""Independent forward/backward codecs (issue 10, item 4): the spec parser, the byte
budget, the wire format, the backward's definition, and both ends in separate processes."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_cegrpo.compression import (BoundaryCodec, BoundaryContext, MaskHalf, build_codec, check_codec_budget,
                                         parse_codec_spec)
from megatron_cegrpo.compression.quant import allocate_bits, dequantize_columns, quantize_columns
from megatron_cegrpo.compression.wire import ByteReader, bit_stream, pack_stream, stream_values, unpack_stream

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ctx(step=3, b=2):
    return BoundaryContext(seed=11, boundary=0, step=step, sample_ids=torch.arange(b) + 5)


def _lowrank_data(shape, rank=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, b, d = shape
    basis = torch.randn(rank, d, generator=g)
    return (torch.randn(s, b, rank, generator=g) * torch.logspace(1, -1, rank)) @ basis \
        + 0.01 * torch.randn(s, b, d, generator=g)


# ---------------------------------------------------------------- parsing
@pytest.mark.parametrize("bad, msg", [
    ("", "empty codec spec"),
    ("topk", "unknown codec 'topk'"),
    ("pcaq:lrq:mask", "has 2 ':'"),
    ("pcaq:nope", "unknown backward half 'nope'"),
    ("pcaq/rank=:lrq", "is not NAME or NAME/key=value"),
    ("pcaq/rank=4/rank=5:lrq", "sets rank twice"),
    ("pcaq/bits=4:lrq", "pcaq takes no parameter 'bits'"),
    ("pcaq/rank=2.5:lrq", "pcaq/rank='2.5' is not a number"),
    ("mask/keep_ratio=0.1:mask", "mask takes no parameter 'keep_ratio'"),
])
def test_malformed_specs_are_rejected(bad, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        build_codec(bad, 0.05)


def test_spec_parses_halves_and_params():
    p = parse_codec_spec("pcaq/rank=96/share=0.1:lrq/rank=32")
    assert (p.fwd, p.bwd, p.fwd_params, p.bwd_params) == ("pcaq", "lrq", {"rank": "96", "share": "0.1"},
                                                          {"rank": "32"})
    c = build_codec(p.text, 0.05)
    assert isinstance(c, BoundaryCodec) and (c.fwd.rank, c.fwd.share, c.bwd.rank) == (96, 0.1, 32)
    assert parse_codec_spec("mask").single == "mask" and isinstance(build_codec("mask", 0.05).fwd, MaskHalf)
    one = parse_codec_spec("lowrank")  # a codec that goes alone: the same name both ways
    assert (one.single, one.fwd, one.bwd, one.fwd_params) == ("lowrank", "lowrank", "lowrank", {})
    for bad in ("pcaq", "pcaq/rank=96", "mask/rank=2"):  # one direction's codecs, and no params alone
        with pytest.raises(ValueError, match="unknown codec"):
            parse_codec_spec(bad)


def test_mask_pair_is_bit_identical_to_mask_and_is_the_chain_rule():
    x = torch.randn(7, 2, 40)
    g = torch.randn(7, 2, 40)
    m, mm = build_codec("mask", 0.1), build_codec("mask:mask", 0.1)
    assert mm.is_chain_rule and not build_codec("pcaq:lrq", 0.1).is_chain_rule
    ctx = _ctx()
    for enc, dec in (("encode_forward", "decode_forward"), ("encode_backward", "decode_backward")):
        pa, pb = getattr(m, enc)(x, ctx), getattr(mm, enc)(x, ctx)
        assert torch.equal(pa, pb)
        assert torch.equal(getattr(m, dec)(pa, ctx, x.shape), getattr(mm, dec)(pb, ctx, x.shape))
    # backward of the pair's forward_map == autograd of the mask's linear map
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ga,) = torch.autograd.grad(m.forward_map(xa, ctx), xa, g)
    (gb,) = torch.autograd.grad(mm.forward_map(xb, ctx), xb, g)
    assert torch.equal(ga, gb)


def test_pair_mask_halves_precompute_off_the_critical_path():
    """issue 10 item 6: a pair's mask halves derive their PRF indices in precompute (as the single
    mask codec does), with the same bits; pairs of data-dependent halves have nothing to precompute."""
    x = torch.randn(7, 2, 40)
    assert not build_codec("pcaq:lrq", 0.1).precomputes and not build_codec("dense:dense", 0.1).precomputes
    m = build_codec("mask", 0.1)
    for spec in ("mask:mask", "dense:mask"):
        c, ctx = build_codec(spec, 0.1), _ctx()
        assert c.precomputes and c.precompute(ctx, tuple(x.shape))
        pb = c.encode_backward(x, ctx)
        assert torch.equal(pb, m.encode_backward(x, ctx))
        assert torch.equal(c.decode_backward(pb, ctx, x.shape), m.decode_backward(pb, ctx, x.shape))
        if spec == "mask:mask":
            pf = c.encode_forward(x, ctx)
            assert torch.equal(c.decode_forward(pf, ctx, x.shape), m.decode_forward(pf, ctx, x.shape))
        assert c.derivations == {"precomputed": 2 if spec == "mask:mask" else 1, "on_demand": 0}


def test_pair_backward_is_the_straight_through_compressed_gradient():
    """pcaq:lrq is NOT the chain rule (compression/codecs.py says why): dL/dx = lrq.roundtrip(dL/dx_hat)."""
    shape = (24, 2, 48)
    x, g = _lowrank_data(shape), _lowrank_data(shape, seed=1)
    codec, ref = build_codec("pcaq/rank=12:lrq/rank=8", 0.25), build_codec("pcaq/rank=12:lrq/rank=8", 0.25)
    xr = x.clone().requires_grad_()
    y = codec.forward_map(xr, _ctx())
    (gx,) = torch.autograd.grad(y, xr, g)
    assert torch.equal(y.detach(), ref.fwd.roundtrip(x, _ctx()))
    assert torch.equal(gx, ref.bwd.roundtrip(g, _ctx()))
    rel = float(((gx - g) ** 2).sum() / (g ** 2).sum())
    assert rel < 1e-3  # the gradient is rank 6 + noise: an 8-row basis keeps it


# ---------------------------------------------------------------- quantiser and wire
def test_bit_allocation_is_the_greedy_reverse_water_filling():
    assert allocate_bits([100.0, 9.0, 1.0, 0.09, 0.01], 14) == [6, 4, 3, 1, 0]
    assert allocate_bits([1.0, 1.0], 3) == [2, 1]  # ties: lower index first
    assert allocate_bits([5.0, 1.0], 100, max_bits=8) == [8, 8]


def test_quantiser_roundtrip_is_exact_and_within_half_a_step():
    c = torch.randn(37, 5, generator=torch.Generator().manual_seed(3)) * torch.tensor([10.0, 3.0, 1.0, 0.3, 0.1])
    bits = [6, 4, 3, 1, 0]
    payload, c_hat = quantize_columns(c, bits)
    assert payload.numel() == 4 * 5 + (37 * 14 + 7) // 8
    assert torch.equal(dequantize_columns(ByteReader(payload), 37, bits), c_hat)
    a = c.abs().amax(0)
    for j, w in enumerate(bits):
        err = (c_hat[:, j] - c[:, j]).abs().max()
        assert err <= (a[j] / (1 << w) if w else a[j]) + 1e-5 * a[j]  # fp32 rounding of -a + (i + 0.5) step


def test_bit_stream_roundtrip():
    q = torch.randint(0, 32, (13,))
    data = pack_stream(bit_stream(q, 5))
    assert data.numel() == (13 * 5 + 7) // 8
    assert torch.equal(stream_values(unpack_stream(data, 65), 5), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_bytes_exactly_as_documented(dtype):
    """pcaq at keep 0.25, shape (10, 2, 32), rank 8, share 0.12, 1 outlier per sequence:
    budget floor(0.25*20*32*e); B = floor(8 (budget * 0.88 - 32 - 2 * 68) / 20); message =
    [8 x 32 fp16 + 8 fp32 on the first] + 2 x (int32 + 32 fp16) outliers + 8 fp32 scales +
    ceil(20 B / 8), padded to whole elements. lrq rank 4: r = min(4, budget // 144), no outliers."""
    shape, e = (10, 2, 32), torch.empty((), dtype=dtype).element_size()
    codec = build_codec("pcaq/rank=8:lrq/rank=4", 0.25)
    budget = int(0.25 * 20 * 32 * e)
    bits = min(8 * 8, int(8 * (budget * 0.88 - 32 - 2 * 68) // 20))  # at most max_bits per row
    coef = 2 * 68 + 32 + (20 * bits + 7) // 8
    pad = lambda n: -(-n // e) * e  # noqa: E731
    assert codec.bytes_per_message("fwd", shape, e, True) == pad(8 * (64 + 4) + coef)
    assert codec.bytes_per_message("fwd", shape, e, False) == pad(coef)
    r = min(4, budget // 144)
    lrq_bits = min(8 * r, int(8 * (budget - r * 72) // 20))
    assert codec.bytes_per_message("bwd", shape, e, False) == pad(r * 72 + (20 * lrq_bits + 7) // 8)
    x = _lowrank_data(shape).to(dtype)
    ctx = _ctx()
    for first in (True, False):
        p = codec.encode_forward(x, ctx)
        assert p.dtype == dtype and p.numel() * e == codec.bytes_per_message("fwd", shape, e, first)
        assert tuple(p.shape) == codec.wire_shape("fwd", shape, ctx, dtype, "recv")
        codec.decode_forward(p, ctx, shape)
    pb = codec.encode_backward(x, ctx)
    assert pb.numel() * e == codec.bytes_per_message("bwd", shape, e, False)
    assert pb.numel() * e <= budget


def test_budget_check_rejects_specs_over_their_claim():
    demo = dict(shape=(188, 4, 576), messages=24, bwd_messages=8)
    for ok in ("mask", "dense", "pcaq:lrq", "mask:lrq", "pcaq:mask"):
        check_codec_budget(build_codec(ok, 0.05), 0.05, **demo)
    for bad, what in (("dense:lrq", "forward sends"), ("pcaq/rank=576/share=0.01:lrq", "forward sends"),
                      ("mask:dense", "backward sends")):
        with pytest.raises(ValueError, match=what):
            check_codec_budget(build_codec(bad, 0.05), 0.05, **demo)


# ---------------------------------------------------------------- two processes
def _messages():
    """Three forward messages: two of step 4, one of step 5 (rank-6 data, d = 40)."""
    g = torch.Generator().manual_seed(5)
    x = [(torch.randn(12, 2, 6, generator=g) @ torch.randn(6, 40, generator=g)) for _ in range(3)]
    ctxs = [BoundaryContext(seed=1, boundary=0, step=4 + i // 2, sample_ids=torch.tensor([2 * i, 2 * i + 1]))
            for i in range(3)]
    return x, ctxs


_RECEIVER = r"""
import sys, torch
from megatron_cegrpo.compression import BoundaryContext, build_codec
c = build_codec("pcaq/rank=10:lrq/rank=6", 0.25)
res = []
for p, step, ids in torch.load(sys.argv[1]):
    ctx = BoundaryContext(seed=1, boundary=0, step=step, sample_ids=ids)
    assert tuple(p.shape) == c.wire_shape("fwd", (12, 2, 40), ctx, p.dtype, "recv")
    res.append(c.decode_forward(p, ctx, (12, 2, 40)))
torch.save(res, sys.argv[2])
"""


def test_both_ends_in_separate_processes_decode_the_same_tensors(tmp_path):
    """Sender (here) and receiver (another process): the receiver's decoded tensors equal, bit
    for bit, the single-process roundtrip; messages 0 and 2 (first of steps 4 and 5) carry a basis."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    wire, got = tmp_path / "wire.pt", tmp_path / "got.pt"
    x, ctxs = _messages()
    sender = build_codec("pcaq/rank=10:lrq/rank=6", 0.25)
    msgs = [(sender.encode_forward(t, c), c.step, c.sample_ids) for t, c in zip(x, ctxs)]
    torch.save(msgs, wire)
    subprocess.run([sys.executable, "-c", _RECEIVER, str(wire), str(got)], check=True, env=env, cwd=REPO)
    decoded = torch.load(got)
    sizes = [p.numel() for p, _, _ in msgs]
    assert sizes[0] == sizes[2] > sizes[1]
    ref = build_codec("pcaq/rank=10:lrq/rank=6", 0.25)
    for t, c, got_t in zip(x, ctxs, decoded):
        assert torch.equal(ref.fwd.roundtrip(t, c), got_t)
    assert float(((decoded[0] - x[0]) ** 2).sum() / (x[0] ** 2).sum()) < 1e-3  # rank 6 data, 10 rows


def test_outlier_tokens_travel_whole_and_stop_setting_the_scales():
    """One token per sequence with a 300x norm (SmolLM2's attention sink): pcaq sends it in fp16
    and quantises the others on their own scale; without outliers their error is far larger."""
    shape = (16, 2, 48)
    x = _lowrank_data(shape, rank=20)
    x[0] *= 300.0
    normal = torch.ones(16, 2, dtype=torch.bool)
    normal[0] = False

    def err(spec):
        y = build_codec(spec, 0.25).fwd.roundtrip(x, _ctx())
        return y, float(((y - x)[normal] ** 2).sum() / (x[normal] ** 2).sum())

    y, e1 = err("pcaq/rank=24:dense")
    assert torch.equal(y[0], x[0].half().float())
    _, e0 = err("pcaq/rank=24/outliers=0:dense")
    assert e1 < 0.1 * e0


def test_sender_decode_of_its_own_payloads_equals_the_receivers_across_passes():
    """codec/error_persistence decodes at the sender: for the first message of a step (basis
    on board) and later ones (basis from the send-side state, e.g. an update pass whose
    old-logprob pass was not tracked) it must equal what the receiver decodes, and leave the
    receive-side state alone."""
    sender, receiver = build_codec("pcaq/rank=8:lrq/rank=4", 0.25), build_codec("pcaq/rank=8:lrq/rank=4", 0.25)
    shape = (12, 2, 32)
    payloads = [sender.encode_forward(_lowrank_data(shape, seed=i), _ctx()) for i in range(3)]
    assert payloads[0].numel() > payloads[1].numel() == payloads[2].numel()  # the basis rides on the first
    at_sender = [sender.decode_sent_forward(p, _ctx(), shape) for p in payloads[::-1]][::-1]  # later ones first
    at_receiver = [receiver.decode_forward(p, _ctx(), shape) for p in payloads]
    for a, b in zip(at_sender, at_receiver):
        assert torch.equal(a, b)
    assert not sender.fwd._state["recv"]  # the sender's receive-side state stays empty


def test_declared_capabilities_match_the_constructors():
    """Each codec declares what it takes (no signature probing at build time): the spec parameters
    ``PARAMS`` (names, order, types), ``claims_budget`` (a ``keep_ratio``) and the run-level
    ``RUN_OPTIONS``; checked here against the constructors themselves. One registry (issue 34)."""
    import inspect

    from megatron_cegrpo.arguments import TrainConfig
    from megatron_cegrpo.compression.halves import _HALVES, DirectionCodec

    run_options = set(TrainConfig().boundary_codec_options())
    for name, cls in _HALVES.items():
        sig = inspect.signature(cls).parameters
        own = {k: type(p.default) for k, p in sig.items() if k != "keep_ratio" and k not in cls.RUN_OPTIONS}
        assert cls.PARAMS == own and list(cls.PARAMS) == list(own), name
        assert cls.claims_budget == ("keep_ratio" in sig), name
        assert set(cls.RUN_OPTIONS) <= set(sig) and set(cls.RUN_OPTIONS) <= run_options, name
    # what build_codec passes: lowrank takes every run option, the others none
    assert set(_HALVES["lowrank"].RUN_OPTIONS) == run_options
    assert [n for n, c in _HALVES.items() if c.RUN_OPTIONS] == ["lowrank"]
    assert sorted(n for n, c in _HALVES.items() if c.coupled) == ["lowrank"]
    for name, cls in _HALVES.items():  # a declaration that its code contradicts would go unnoticed
        assert cls.precomputes == (cls.precompute is not DirectionCodec.precompute), name
        assert cls.alone == (cls.own_backward is not DirectionCodec.own_backward), name
    assert sorted(n for n, c in _HALVES.items() if c.alone) == ["dense", "lowrank", "mask"]


def test_dense_alone_is_the_control_but_a_dense_pair_claims_the_budget():
    """``dense`` alone is the uncompressed control (no budget check); ``dense:dense`` names two
    halves and is checked like any pair (and refused: it sends all of dense)."""
    assert not build_codec("dense").claims_budget
    with pytest.warns(UserWarning, match="ignored by --boundary-codec dense"):
        build_codec("dense", 0.1)
    pair = build_codec("dense:dense", 0.05)
    assert pair.claims_budget
    with pytest.raises(ValueError, match="forward sends"):
        check_codec_budget(pair, 0.05, (16, 2, 64), 4)
