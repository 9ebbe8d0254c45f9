"""Optimizer pre-step hooks: the correction formula and global-norm clipping."""

import math

import pytest
import torch

from megatron_cegrpo.optim.hooks import GradClipHook, SignCorrectionHook


def _params():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def test_correction_is_identity_until_signs_arrive_then_matches_formula():
    ps = _params()
    before = [p.grad.clone() for p in ps]
    opt = torch.optim.SGD(ps, lr=0.0)
    hook = SignCorrectionHook(ps, alpha=0.25, beta=0.75)
    opt.register_step_pre_hook(hook)
    opt.step()
    for p, g in zip(ps, before):
        assert torch.equal(p.grad, g)
    signs = [torch.where(torch.rand_like(p) > 0.5, 1.0, -1.0) for p in ps]
    hook.set_signs(signs)
    opt.step()
    for p, g, s in zip(ps, before, signs):
        torch.testing.assert_close(p.grad, 0.25 * g + 0.75 * g.abs() * s)
    assert hook.num_applied == 1


def test_constant_magnitude_ablation_replaces_abs_g_by_its_tensor_mean():
    ps = _params()
    before = [p.grad.clone() for p in ps]
    signs = [torch.where(torch.rand_like(p) > 0.5, 1.0, -1.0) for p in ps]
    opt = torch.optim.SGD(ps, lr=0.0)
    hook = SignCorrectionHook(ps, alpha=0.25, beta=0.75, magnitude="mean")
    opt.register_step_pre_hook(hook)
    hook.set_signs(signs)
    opt.step()
    for p, g, s in zip(ps, before, signs):
        torch.testing.assert_close(p.grad, 0.25 * g + 0.75 * g.abs().mean() * s)
    # alpha 0, beta 1: every coordinate is mean|G| of its tensor with the sign of M
    for p, g in zip(ps, before):
        p.grad = g.clone()
    pure = SignCorrectionHook(ps, alpha=0.0, beta=1.0, magnitude="mean")
    pure.set_signs(signs)
    pure(opt, (), {})
    for p, g, s in zip(ps, before, signs):
        assert torch.equal(p.grad.abs(), g.abs().mean().expand_as(g)) and torch.equal(p.grad.sign(), s)
    with pytest.raises(ValueError, match="magnitude must be one of"):
        SignCorrectionHook(ps, magnitude="const")


def test_clip_hook_global_norm():
    ps = _params()
    grads = [p.grad.clone() for p in ps]
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
    hook = GradClipHook(ps, ps, max_norm=norm / 2)
    opt = torch.optim.SGD(ps, lr=0.0)
    opt.register_step_pre_hook(hook)
    opt.step()
    assert abs(hook.last_grad_norm - norm) < 1e-9
    new = torch.sqrt(sum(p.grad.double().square().sum() for p in ps)).item()
    assert abs(new - norm / 2) < 1e-5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("optimizer", ["torch-adamw", "deepspeed-cpu-adam"])
def test_non_finite_gradient_skips_the_step(bad, optimizer):
    """A NaN/inf anywhere in the gradient: weights and Adam moments untouched, the skip counted;
    the next finite step updates as usual."""
    ps = _params()
    if optimizer == "torch-adamw":
        opt = torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(ps, lr=0.1, weight_decay=0.1, adamw_mode=True)
    hook = GradClipHook(ps, ps, max_norm=1.0)
    opt.register_step_pre_hook(hook)
    opt.step()  # a finite step first, so Adam has moments to protect
    weights = [p.detach().clone() for p in ps]
    moments = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in ps]
    for p in ps:
        p.grad = torch.randn_like(p)
    ps[1].grad[3] = bad
    opt.step()
    assert hook.num_skipped == 1 and not math.isfinite(hook.last_grad_norm)
    for p, w, mom in zip(ps, weights, moments):
        assert torch.equal(p.detach(), w)
        for k, v in mom.items():
            assert torch.equal(opt.state[p][k], v), k
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert hook.num_skipped == 1 and math.isfinite(hook.last_grad_norm)
    assert all(not torch.equal(p.detach(), w) for p, w in zip(ps, weights))


def test_clip_hook_adds_an_external_term_at_its_parameter_place():
    """--tied-embedding-sync sparse: the first stage's tied embedding has no gradient of its own;
    its ||G||^2 (computed where the summed gradient lives) enters the sum at the same place, so
    the norm equals the one computed from the gradient itself, to the bit."""
    ps = _params()
    local = GradClipHook(ps, ps, max_norm=0.0)
    local(None, (), {})
    term = ps[0].grad.detach().double().square().sum()
    ps[0].grad = None
    remote = GradClipHook(ps, ps, max_norm=0.0, external_terms=lambda: {id(ps[0]): term})
    remote(None, (), {})
    assert remote.last_grad_norm == local.last_grad_norm


def test_sign_agreement_counts_only_the_counted_parameters():
    ps = _params()
    signs = [torch.where(p.grad >= 0, 1.0, -1.0) for p in ps]  # every coordinate agrees
    signs[1] = -signs[1]  # ... but none of the second parameter's
    hook = SignCorrectionHook(ps, counted=[ps[0]])
    hook.set_signs(signs)
    hook(None, (), {})
    assert hook.last_agreement == (15, 15)
    both = SignCorrectionHook(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    both.set_signs([torch.where(p.grad >= 0, 1.0, -1.0) for p in ps])
    both(None, (), {})
    assert both.last_agreement == (22, 22)


def test_tensors_without_a_sign_keep_their_gradient_bit_for_bit():
    """Zero-M issue: a None sign entry (M all 0 on that tensor) leaves its gradient unchanged;
    only None entries (all of M 0) is no correction at all."""
    ps = _params()
    before = [p.grad.clone() for p in ps]
    opt = torch.optim.SGD(ps, lr=0.0)
    hook = SignCorrectionHook(ps, alpha=0.25, beta=0.75)
    opt.register_step_pre_hook(hook)
    hook.set_signs([None, None])
    assert hook.signs is None
    opt.step()
    assert hook.num_applied == 0 and all(torch.equal(p.grad, g) for p, g in zip(ps, before))
    s0 = torch.where(torch.rand_like(ps[0]) > 0.5, 1.0, -1.0)
    hook.set_signs([s0, None])
    opt.step()
    assert hook.num_applied == 1
    assert torch.equal(ps[0].grad, 0.25 * before[0] + 0.75 * before[0].abs() * s0)
    assert torch.equal(ps[1].grad, before[1])  # bit for bit
    agree = int(((before[0] > 0) == (s0 > 0)).sum())
    assert hook.last_agreement == (agree, before[0].numel())  # the unsigned tensor is not counted
    with pytest.raises(ValueError, match="sign shape"):
        hook.set_signs([None, torch.ones(3)])


def test_sign_agreement_counts_only_nonzero_gradient_coordinates():
    """A zero gradient has no sign: its coordinates are left out of anchor/sign_agreement, and a
    step whose gradient is exactly 0 reports no agreement (not 1.0)."""
    from megatron_cegrpo.anchor.circuit import _correction

    p = torch.nn.Parameter(torch.zeros(6))
    p.grad = torch.tensor([0.0, 0.0, 1.0, -1.0, 2.0, 0.0])
    hook = SignCorrectionHook([p])
    hook.set_signs([torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0])])
    hook(None, (), {})
    assert hook.last_agreement == (1, 3)  # coordinate 2 agrees, 3 and 4 do not; 0, 1, 5 are g = 0
    p.grad = torch.zeros(6)
    hook(None, (), {})
    assert hook.last_agreement == (0, 0) and torch.equal(p.grad, torch.zeros(6))
    m = _correction({"_anchor/applied": 1, "_anchor/agree": 0, "_anchor/total": 0})
    assert m == {"anchor/correction_applied": 1}  # no anchor/sign_agreement key


def test_blend_sign_is_sign_m_so_adam_moves_ballistically_on_a_directionless_gradient():
    """With alpha < beta every corrected coordinate's sign is sign(M) (|G| where G agrees, (beta -
    alpha) |G| where it does not), so between the anchor's fires Adam sees a gradient of fixed sign
    and moves each coordinate ~lr a step in one direction (a distance linear in the steps), where
    the same directionless gradient (unit normal noise) uncorrected moves it like a random walk: why
    every arm of the study that folds on every step moves its weights 1.3-2x as far as dense
    (docs/anchor.md, "What the fold does to Adam")."""
    n, steps, lr = 20000, 32, 1e-3
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]  # no direction at all
    signs = torch.where(torch.rand(n, generator=gen) > 0.5, 1.0, -1.0)
    moved = {}
    for name in ("plain", "blended"):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = torch.optim.Adam([p], lr=lr)
        hook = SignCorrectionHook([p], alpha=0.25, beta=0.75)
        if name == "blended":
            opt.register_step_pre_hook(hook)
            hook.set_signs([signs])
        for g in grads:
            p.grad = g.clone()
            opt.step()
            if name == "blended":
                assert torch.equal(torch.sign(p.grad), signs)  # the step's gradient sign is sign(M), always
                torch.testing.assert_close(p.grad.abs(), torch.where(torch.sign(g) == signs, 1.0, 0.5) * g.abs())
        moved[name] = float(p.detach().norm()) / (lr * steps * math.sqrt(n))  # 1.0: every coordinate lr a step
    # blended: about E|G| 0.75 / sqrt(E G^2 0.625) = 0.76 of lr a step, one way (0.80 measured, Adam's
    # bias correction adding a little early); plain: a random walk of Adam's momentum, 0.20 measured
    assert 0.70 < moved["blended"] < 0.90, moved
    assert moved["plain"] < 0.3 and moved["blended"] > 3 * moved["plain"], moved
