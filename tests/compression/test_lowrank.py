"""The ``lowrank`` codec (issue 10 item 3): rank formula, chain-rule backward against autograd,
power iteration, both basis owners, resume bit for bit."""

import pytest
import torch

from megatron_cegrpo.compression import BoundaryContext, build_codec
from megatron_cegrpo.compression.lowrank import initial_basis, lowrank_rank, orthonormalize, power_step

torch.set_num_threads(1)


def _ctx(step, boundary=0, b=3, seed=1234):
    return BoundaryContext(seed=seed, boundary=boundary, step=step, sample_ids=torch.arange(b))


def _acts(step, s=8, b=3, d=32):
    # activations with a decaying spectrum, so a rank-r subspace is meaningful
    g = torch.Generator().manual_seed(step)
    return (torch.randn(s, b, d, generator=g) * torch.logspace(0, -2, d)).double().float()


def test_rank_formula_values():
    # SmolLM2 at the 128-token rollout shape: T = 32 x 128 x 4 = 16384, ratio 0.05
    assert lowrank_rank(576, 0.05, 16384, 1.0) == 27  # floor(471859.2 / 16960) = floor(27.82)
    assert lowrank_rank(576, 0.05, 16384, 0.5) == 28  # anchor-owned, c = 4: floor(28.30)
    assert lowrank_rank(64, 0.25, 384, 1.0) == 13
    assert lowrank_rank(8, 1.0, 10, 0.0) == 8
    for d, rho, T, q in [(576, 0.05, 16384, 1.0), (1536, 0.05, 5000, 1.0), (64, 0.25, 384, 0.1)]:
        r = lowrank_rank(d, rho, T, q)
        assert (r * T + q * d * r) <= rho * d * T < ((r + 1) * T + q * d * (r + 1))
    with pytest.raises(ValueError, match="--boundary-keep-ratio"):
        lowrank_rank(64, 0.01, 384, 1.0)


def test_build_codec_passes_only_known_options():
    c = build_codec("lowrank", 0.05, q_owner="anchor", anchor_interval=4, tokens_per_iteration=16384, other=1)
    assert c.fwd.q_owner == "anchor" and c.fwd.rank(576) == 28
    assert build_codec("mask", 0.05, q_owner="fast").fwd.k(576) == 29
    with pytest.raises(ValueError, match="--lowrank-q-owner"):
        build_codec("lowrank", q_owner="nobody")


def test_backward_is_autograd_of_forward_map():
    codec = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    sender = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    receiver = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    x = _acts(1).requires_grad_(True)
    g = torch.randn(8, 3, 32, generator=torch.Generator().manual_seed(5))
    ctx = _ctx(1)
    y = codec.forward_map(x, ctx)
    y.backward(g)
    # the wire: coefficients forward, the basis once, coefficients backward
    payload = sender.encode_forward(x.detach(), ctx)
    basis = sender.basis_to_send(ctx)
    assert sender.basis_to_send(ctx) is None  # shipped once per step
    buf = receiver.basis_to_receive(ctx, x.shape, x.dtype)
    buf.copy_(basis)
    receiver.accept_basis(ctx, buf)
    assert receiver.basis_to_receive(ctx, x.shape, x.dtype) is None
    r = codec.fwd.rank(32)
    assert payload.shape == (8, 3, r) and basis.shape == (32, r)
    assert torch.equal(receiver.decode_forward(payload, ctx, x.shape), y.detach())
    grad_in = sender.decode_backward(receiver.encode_backward(g, ctx), ctx, x.shape)
    torch.testing.assert_close(grad_in, x.grad, rtol=0, atol=1e-6)
    # y lies in span(Q) and is the orthogonal projection of x: (x - y) Q = 0
    q = receiver.state_dict()["fwd"]["bases"][0][0]
    torch.testing.assert_close((x.detach() - y.detach()) @ q, torch.zeros(8, 3, r), rtol=0, atol=1e-5)


def test_receiver_without_the_basis_refuses_to_decode():
    receiver = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    with pytest.raises(ValueError, match="never arrived"):
        receiver.decode_forward(torch.zeros(8, 3, receiver.fwd.rank(32)), _ctx(1), (8, 3, 32))


def test_power_iteration_finds_the_top_subspace():
    x = _acts(3, s=64, b=4).reshape(-1, 32)
    r = 4
    q = initial_basis(7, 0, 32, r)
    torch.testing.assert_close(q.t() @ q, torch.eye(r), rtol=0, atol=1e-6)
    assert torch.equal(q, initial_basis(7, 0, 32, r)) and not torch.equal(q, initial_basis(7, 1, 32, r))
    for _ in range(30):
        q = power_step(q, x)
    err = (x - x @ q @ q.t()).norm() ** 2
    sv = torch.linalg.svdvals(x.double())
    best = (sv[r:] ** 2).sum()
    assert abs(float(err) - float(best)) <= 1e-3 * float(best)
    # orthonormalize is deterministic in sign (diag(R) >= 0)
    m = torch.randn(32, r, generator=torch.Generator().manual_seed(1))
    assert torch.all(torch.diagonal(orthonormalize(m).t() @ m) > 0)


def test_fast_owner_refreshes_once_per_step_and_resumes_bit_exactly():
    a = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    for step in (1, 2, 3):
        for mb in range(3):  # only the first crossing of a step refreshes
            a.encode_forward(_acts(10 * step + mb), _ctx(step))
        q_step = a.state_dict()["fwd"]["bases"][0]
        assert q_step[1] == step
        expected = power_step(initial_basis(1234, 0, 32, a.fwd.rank(32)), _acts(10)) if step == 1 else None
        if expected is not None:
            assert torch.equal(q_step[0], expected)
    b = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    b.load_state_dict(a.state_dict())
    pa, pb = a.encode_forward(_acts(40), _ctx(4)), b.encode_forward(_acts(40), _ctx(4))
    assert torch.equal(pa, pb) and torch.equal(a.basis_to_send(_ctx(4)), b.basis_to_send(_ctx(4)))
    other = build_codec("lowrank", 0.25, q_owner="anchor", tokens_per_iteration=96)
    with pytest.raises(ValueError, match="--lowrank-q-owner fast"):
        other.load_state_dict(a.state_dict())


def test_forward_map_backward_projects_with_the_basis_of_its_own_forward():
    """autograd through ``forward_map`` uses the Q of that forward, even after a later step refreshed
    the basis (as autograd through ``(x Q) Q^T`` did before the halves)."""
    c = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    x1 = _acts(1).requires_grad_(True)
    y1 = c.forward_map(x1, _ctx(1))
    q1 = c.state_dict()["fwd"]["bases"][0][0].clone()
    c.forward_map(_acts(2), _ctx(2))  # step 2 refreshes the basis
    assert not torch.equal(q1, c.state_dict()["fwd"]["bases"][0][0])
    g = torch.randn(8, 3, 32, generator=torch.Generator().manual_seed(9))
    y1.backward(g)
    assert torch.equal(x1.grad, (g @ q1) @ q1.t())


def test_lowrank_is_one_basis_seen_from_both_directions():
    """``lowrank`` is a forward half and its backward view sharing one basis (issue 34: every codec a
    pair of halves): it only goes alone, the backward keeps no state of its own, and a checkpoint
    written before the halves (the whole state at the top level) still resumes."""
    c = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    assert c.bwd is c.fwd.own_backward() and c.bwd.owner is c.fwd and c.is_chain_rule
    from megatron_cegrpo.compression import BoundaryCodec, MaskHalf
    with pytest.raises(ValueError, match="only goes alone"):
        BoundaryCodec(c.fwd, MaskHalf(0.25))
    for bad in ("lowrank:mask", "mask:lowrank", "lowrank:lowrank"):
        with pytest.raises(ValueError, match="couples its two directions"):
            build_codec(bad, 0.25)
    c.encode_forward(_acts(1), _ctx(1))
    state = c.state_dict()
    assert set(state) == {"fwd", "bwd"} and state["bwd"] == {} and state["fwd"]["bases"][0][1] == 1
    legacy = build_codec("lowrank", 0.25, tokens_per_iteration=96)
    legacy.load_state_dict(state["fwd"])  # the pre-issue-34 layout
    x = _acts(2)
    assert torch.equal(legacy.encode_forward(x, _ctx(1)), c.encode_forward(x, _ctx(1)))


def test_anchor_owner_uses_a_sent_basis_from_its_first_step_only():
    c = build_codec("lowrank", 0.25, q_owner="anchor", tokens_per_iteration=96, anchor_interval=2)
    r = c.fwd.rank(32)
    assert r == lowrank_rank(32, 0.25, 96, 1.0)
    x = _acts(1)
    q0 = initial_basis(1234, 0, 32, r)
    assert torch.equal(c.encode_forward(x, _ctx(4)), x @ q0)  # no traffic: the seed's basis
    assert c.basis_to_send(_ctx(4)) is None and c.basis_to_receive(_ctx(4), x.shape, x.dtype) is None
    q_new = orthonormalize(torch.randn(32, r, generator=torch.Generator().manual_seed(3)))
    c.stage_basis(0, q_new, first_step=5)
    saved = c.state_dict()
    assert torch.equal(c.encode_forward(x, _ctx(4)), x @ q0)
    assert torch.equal(c.encode_forward(x, _ctx(5)), x @ q_new)
    d = build_codec("lowrank", 0.25, q_owner="anchor", tokens_per_iteration=96, anchor_interval=2)
    d.load_state_dict(saved)  # a checkpoint taken between the fire and the basis' first step
    assert torch.equal(d.encode_forward(x, _ctx(5)), x @ q_new)
