"""Optimizer pre-step hooks: the correction formula and global-norm clipping."""

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
