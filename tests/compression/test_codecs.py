"""Tests for the codec registry and the dense and mask codecs (compression/codecs.py, halves.py,
mask.py): every codec is a BoundaryCodec of two halves from one registry (issue 34)."""

import math
import threading
from pathlib import Path

import pytest
import torch

_REPO = Path(__file__).resolve().parents[2]

from megatron_cegrpo.compression import (
    BoundaryCodec,
    BoundaryContext,
    DenseHalf,
    DirectionCodec,
    MaskHalf,
    available_codecs,
    build_codec,
    exact_k_indices,
    register_half,
)

torch.set_num_threads(1)


def MaskCodec(keep_ratio=0.05, cache_size=64):
    """``--boundary-codec mask`` at ``keep_ratio``, its index LRU holding ``cache_size`` entries."""
    c = build_codec("mask", keep_ratio)
    c.fwd.cache_size = cache_size
    return c


def _ctx(step=7, b=3, seed=1234, boundary=0, offset=0):
    return BoundaryContext(seed=seed, boundary=boundary, step=step,
                           sample_ids=torch.arange(offset, offset + b, dtype=torch.int64))


# --------------------------------------------------------------------------- registry

def test_registry_names_and_build():
    assert available_codecs() == ["dense", "lowrank", "mask"]  # the halves that go alone
    d = build_codec("dense")
    assert isinstance(d, BoundaryCodec) and isinstance(d.fwd, DenseHalf) and d.bwd is d.fwd
    m = build_codec("mask", 0.05)
    assert isinstance(m.fwd, MaskHalf) and m.bwd is m.fwd  # one index cache for both directions
    assert m.fwd.k(576) == 29 and m.fwd.k(1536) == 77 and m.name == "mask"
    # the other halves go only in a pair, each direction its own instance
    with pytest.raises(ValueError, match="or FWD:BWD with halves from dense, lrq, mask, pcaq, rpq"):
        build_codec("pcaq", 0.05)
    p = build_codec("pcaq:pcaq", 0.05)
    assert type(p.fwd) is type(p.bwd) and p.fwd is not p.bwd and p.name == "pcaq:pcaq"


def test_registry_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown codec 'topk'; valid names:") as e:
        build_codec("topk")
    msg = str(e.value)
    assert "topk" in msg and "valid names: dense, lowrank, mask," in msg


def test_register_half_rejects_non_codec_and_duplicate():
    with pytest.raises(ValueError, match="DirectionCodec"):
        register_half("not_a_codec")(object)
    with pytest.raises(ValueError, match="already registered"):
        @register_half("dense")
        class Other(DenseHalf):
            pass
    assert build_codec("dense").fwd.__class__ is DenseHalf


def test_abstract_half_not_instantiable():
    with pytest.raises(TypeError, match="Can't instantiate abstract class DirectionCodec"):
        DirectionCodec()


# --------------------------------------------------------------------------- dense

def test_dense_is_identity():
    c = build_codec("dense")
    x = torch.randn(5, 3, 16, dtype=torch.bfloat16)
    ctx = _ctx()
    assert c.payload_shape((5, 3, 16)) == (5, 3, 16)
    p = c.encode_forward(x, ctx)
    assert p.is_contiguous() and torch.equal(p, x)
    assert torch.equal(c.decode_forward(p, ctx, (5, 3, 16)), x)
    g = torch.randn(5, 3, 16).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    pg = c.encode_backward(g, ctx)
    assert pg.is_contiguous() and torch.equal(c.decode_backward(pg, ctx, (5, 3, 16)), g)
    xg = x.float().requires_grad_(True)
    y = c.forward_map(xg, ctx)
    y.backward(g)
    assert torch.equal(y, xg.detach()) and torch.equal(xg.grad, g)  # identity both ways
    assert c.state_dict() == {} and not c.claims_budget and not c.precomputes
    c.load_state_dict({})


# --------------------------------------------------------------------------- mask

def test_mask_rejects_bad_ratio():
    for r in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="ratio"):
            build_codec("mask", r)


def test_mask_payload_shape_and_values():
    s, b, d = 17, 3, 576
    c = MaskCodec(0.05)
    k = 29
    assert c.payload_shape((s, b, d)) == (s, b, k)
    assert c.fwd.scale(d) == 576 / 29
    x = torch.randn(s, b, d, dtype=torch.bfloat16, requires_grad=True)
    ctx = _ctx(b=b)
    with torch.no_grad():
        p = c.encode_forward(x, ctx)
    assert p.shape == (s, b, k) and p.dtype == torch.bfloat16 and p.is_contiguous()
    assert not p.requires_grad
    idx = exact_k_indices(ctx.seed, ctx.boundary, ctx.step, ctx.sample_ids, s, d, k)
    assert torch.equal(p, x.detach().gather(-1, idx))  # raw values, no scaling on the wire
    y = c.decode_forward(p, ctx, (s, b, d))
    assert y.shape == (s, b, d) and y.dtype == torch.bfloat16
    assert bool(((y != 0).sum(-1) <= k).all())
    mask = torch.zeros(s, b, d, dtype=torch.bool).scatter(-1, idx, True)
    assert bool((y[~mask] == 0).all())
    assert torch.equal(y[mask], (x.detach() * (d / k))[mask])


def test_mask_encode_forward_does_not_require_grad_even_with_grad_enabled():
    c = MaskCodec(0.25)
    x = torch.randn(2, 1, 8, requires_grad=True)
    assert not c.encode_forward(x, _ctx(b=1)).requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_mask_wire_roundtrip_bit_equals_forward_map_two_ends(dtype):
    s, b, d = 9, 3, 576
    sender, receiver = MaskCodec(0.05), MaskCodec(0.05)  # two "ranks", independent caches
    x = torch.randn(s, b, d, dtype=dtype)
    ctx = _ctx(b=b, boundary=2, step=11)
    with torch.no_grad():
        payload = sender.encode_forward(x, ctx)
    y = receiver.decode_forward(payload, ctx, (s, b, d))
    assert torch.equal(y, sender.forward_map(x, ctx))
    assert torch.equal(y, MaskCodec(0.05).forward_map(x, ctx))
    # the values, from the PRF's indices and the d/k scale directly (not through the codec)
    idx = exact_k_indices(ctx.seed, ctx.boundary, ctx.step, ctx.sample_ids, s, d, 29)
    assert torch.equal(y, torch.zeros_like(x).scatter(-1, idx, x.gather(-1, idx) * (d / 29)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_backward_is_exact_chain_rule(dtype):
    s, b, d = 9, 3, 576
    sender, receiver = MaskCodec(0.05), MaskCodec(0.05)
    x = torch.randn(s, b, d, dtype=dtype, requires_grad=True)
    g = torch.randn(s, b, d, dtype=dtype)
    ctx = _ctx(b=b, boundary=1, step=3)
    (want,) = torch.autograd.grad(sender.forward_map(x, ctx), x, g)
    payload = receiver.encode_backward(g, ctx)
    assert payload.shape == (s, b, 29) and payload.dtype == dtype
    got = sender.decode_backward(payload, ctx, (s, b, d))
    assert got.dtype == dtype
    assert torch.equal(got, want)
    # f(x) = (d/k) m * x, so df/dx^T g = (d/k) m * g: built from the PRF's indices, not the codec
    idx = exact_k_indices(ctx.seed, ctx.boundary, ctx.step, ctx.sample_ids, s, d, 29)
    assert torch.equal(got, torch.zeros_like(g).scatter(-1, idx, g.gather(-1, idx) * (d / 29)))


def test_mask_unbiased_over_steps():
    # f_t(x) = (d/k) m_t ⊙ x with m_t a uniformly random k-of-d subset, so each
    # coordinate is x * (d/k) * Bernoulli(k/d): E = x, Var = x^2 (d/k - 1).
    # Masks of different steps are independent PRF draws, so the mean over N steps
    # has standard error |x| sqrt((d/k - 1) / N). With d=64, ratio 0.25 (k=16,
    # d/k-1=3) and N=4000, SE = 0.027|x|. We require every one of the 256
    # coordinates within 5 SE (normal tail 5.7e-7 each, ~1.5e-4 for all 256),
    # and that 5 SE is a real constraint: a 25% error in the scale (9 SE per
    # coordinate) fails it on average, not just at the worst coordinate.
    s, b, d, ratio, n = 2, 2, 64, 0.25, 4000
    c = MaskCodec(ratio, cache_size=0)
    k = c.fwd.k(d)
    assert k == 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, d, generator=g, dtype=torch.float64)
    sids = torch.tensor([4, 17])
    acc = torch.zeros_like(x)
    for t in range(n):
        acc += c.forward_map(x, BoundaryContext(seed=99, boundary=0, step=t, sample_ids=sids))
    mean = acc / n
    se = x.abs() * math.sqrt((d / k - 1) / n)
    z = (mean - x).abs() / se
    assert z.max().item() < 5.0
    # Sanity: the z-scores look like |N(0,1)| (mean sqrt(2/pi) = 0.80), not zero.
    assert 0.5 < z.mean().item() < 1.1
    assert ((mean * 1.25 - x).abs() / se).mean().item() > 5.0


def test_mask_index_cache_reuse_and_lru():
    c = MaskHalf(0.25)
    c.cache_size = 2
    x = torch.randn(3, 2, 16)
    ctx = _ctx(b=2)
    i1 = c.indices(ctx, 3, 16, "cpu")
    assert c.indices(_ctx(b=2), 3, 16, "cpu") is i1  # equal context (fresh tensor) hits
    c.encode(x, ctx)
    c.indices(_ctx(b=2, step=8), 3, 16, "cpu")
    c.indices(_ctx(b=2, step=9), 3, 16, "cpu")  # evicts step 7
    assert len(c._cache) == 2
    again = c.indices(ctx, 3, 16, "cpu")
    assert again is not i1 and torch.equal(again, i1)
    assert not torch.equal(c.indices(_ctx(b=2, offset=5), 3, 16, "cpu"), i1)


def test_mask_precompute_on_another_thread_gives_the_on_demand_bits():
    # one end precomputes on a background thread (as pipeline/prefetch.py does), the other
    # derives on demand: the same payload and the same decoded tensor, bit for bit; the
    # precomputed end derives nothing on the critical path
    s, b, d = 9, 3, 576
    x, g = torch.randn(s, b, d), torch.randn(s, b, d)
    ctx = _ctx(b=b, boundary=1, step=5)
    sender, receiver = MaskCodec(0.05), MaskCodec(0.05)
    worker = threading.Thread(target=sender.precompute, args=(ctx, (s, b, d), "cpu"))
    worker.start()
    worker.join()
    assert sender.derivations == {"precomputed": 1, "on_demand": 0}
    payload = sender.encode_forward(x, ctx)
    assert torch.equal(payload, receiver.encode_forward(x, ctx))
    assert torch.equal(sender.decode_forward(payload, ctx, (s, b, d)), receiver.decode_forward(payload, ctx, (s, b, d)))
    gp = receiver.encode_backward(g, ctx)
    assert torch.equal(sender.decode_backward(gp, ctx, (s, b, d)), receiver.decode_backward(gp, ctx, (s, b, d)))
    assert sender.derivations == {"precomputed": 1, "on_demand": 0}
    assert receiver.derivations == {"precomputed": 0, "on_demand": 1}
    assert sender.precompute(ctx, (s, b, d)) is True  # already held: not derived again
    assert sender.derivations["precomputed"] == 1


def test_mask_precompute_plan_holds_one_step():
    c = MaskHalf(0.25)
    c.cache_size = 0
    shape = (3, 2, 16)
    for off in range(40):  # more crossings than the LRU default: the plan keeps all of one step
        c.precompute(_ctx(b=2, step=7, offset=2 * off), shape)
    kept = c.indices(_ctx(b=2, step=7), 3, 16, "cpu")
    assert c.derivations == {"precomputed": 40, "on_demand": 0}
    c.precompute(_ctx(b=2, step=8), shape)  # a newer step replaces the plan
    again = c.indices(_ctx(b=2, step=7), 3, 16, "cpu")
    assert c.derivations == {"precomputed": 41, "on_demand": 1}
    assert again is not kept and torch.equal(again, kept)
    assert not torch.equal(c.indices(_ctx(b=2, step=8), 3, 16, "cpu"), kept)
    assert c.derivations["on_demand"] == 1
    with pytest.raises(ValueError, match="sample_ids"):
        c.precompute(_ctx(b=3), shape)
    with pytest.raises(ValueError, match=r"\[s, b, d\]"):
        c.precompute(_ctx(b=2), (3, 16))
    c.clear_cache()
    c.indices(_ctx(b=2, step=8), 3, 16, "cpu")
    assert c.derivations["on_demand"] == 2


def test_precomputes_is_declared_by_the_halves():
    assert MaskCodec(0.05).precomputes and not build_codec("dense").precomputes
    assert build_codec("dense").precompute(_ctx(), (2, 3, 8)) is False


def test_mask_validation_errors():
    c = MaskCodec(0.25)
    with pytest.raises(ValueError, match="sample_ids"):
        c.encode_forward(torch.randn(3, 2, 16), _ctx(b=3))
    with pytest.raises(ValueError, match=r"\[s, b, d\]"):
        c.encode_forward(torch.randn(3, 16), _ctx(b=3))
    with pytest.raises(ValueError, match="payload shape"):
        c.decode_forward(torch.randn(3, 2, 5), _ctx(b=2), (3, 2, 16))
    with pytest.raises(ValueError, match="unexpected codec state keys"):
        c.load_state_dict({"x": 1})
    with pytest.raises(ValueError, match="keeps no state"):
        c.load_state_dict({"fwd": {"x": 1}})
    assert c.state_dict() == {}
    c.load_state_dict({})


def test_mask_ratio_one_is_identity():
    c = MaskCodec(1.0)
    x = torch.randn(4, 2, 8)
    assert torch.equal(c.forward_map(x, _ctx(b=2)), x)
