"""GRPO math against hand-computed values."""

import math

import pytest
import torch

from megatron_cegrpo.grpo import core_algos as ca


def test_group_advantage_hand_values():
    # two groups of G=4: [1,0,0,0] and [1,1,0,0]
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = ca.compute_grpo_outcome_advantage(scores, 4, epsilon=0.0)
    # group 1: mean .25, unbiased std = sqrt((.75^2 + 3*.25^2)/3) = 0.5
    exp1 = [0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5]
    # group 2: mean .5, std = sqrt(4 * .25 / 3) = 0.57735
    s2 = math.sqrt(1.0 / 3.0)
    exp2 = [0.5 / s2, 0.5 / s2, -0.5 / s2, -0.5 / s2]
    torch.testing.assert_close(adv, torch.tensor(exp1 + exp2), rtol=0, atol=1e-6)


def test_group_advantage_constant_group_is_zero_and_dr_grpo():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    adv = ca.compute_grpo_outcome_advantage(scores, 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    nostd = ca.compute_grpo_outcome_advantage(scores, 3, norm_adv_by_std=False)
    torch.testing.assert_close(nostd[3:], torch.tensor([-1 / 3, 2 / 3, -1 / 3]))


def test_group_advantage_rejects_bad_shape():
    with pytest.raises(ValueError, match="group_size"):
        ca.compute_grpo_outcome_advantage(torch.zeros(5), 2)


def test_logprobs_and_entropy_hand_values():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    lp = ca.logprobs_from_logits(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-7)
    ent = ca.entropy_from_logits(logits)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-7)


def test_k3_kl_hand_value_and_clamp():
    logp = torch.tensor([[math.log(0.5), math.log(0.5), -30.0]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])
    kl = ca.kl_penalty(logp, ref, "low_var_kl")
    # r = ref/p = 0.5 -> 0.5 - log 0.5 - 1
    assert kl[0, 0].item() == pytest.approx(0.5 - math.log(0.5) - 1.0, abs=1e-6)
    assert kl[0, 1].item() == 0.0
    assert kl[0, 2].item() == 10.0  # exp(30) - 30 - 1 clamped
    with pytest.raises(ValueError, match="low_var_kl"):
        ca.kl_penalty(logp, ref, "nope")


def test_clipped_policy_loss_hand_values():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    out = ca.compute_policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # A>0, ratio 1.5: max(-1.5, -1.28) = -1.28 (clipped)
    # A>0, ratio 0.5: max(-0.5, -0.8) = -0.5 (not clipped)
    # A<0, ratio 1.1: max(1.1, 1.1) = 1.1 (not clipped)
    # A<0, ratio 0.7: max(0.7, 0.8) = 0.8 (clipped)
    torch.testing.assert_close(out["pg_losses"], torch.tensor([[-1.28, -0.5, 1.1, 0.8]]))
    assert out["pg_clipfrac"].item() == pytest.approx(0.5)
    assert out["ppo_kl"].item() == pytest.approx(-new.mean().item(), abs=1e-6)


def test_clipped_loss_gradient_matches_autograd_of_formula():
    torch.manual_seed(0)
    old = torch.randn(2, 5) * 0.1
    new = (old + torch.randn(2, 5) * 0.3).requires_grad_(True)
    adv = torch.randn(2, 1).expand(2, 5)
    mask = torch.ones(2, 5)
    loss = ca.agg_loss(ca.compute_policy_loss(old, new, adv, mask)["pg_losses"], mask)
    (g,) = torch.autograd.grad(loss, new)
    ratio = torch.exp(new.detach() - old)
    inside = ((ratio > 0.8) & (ratio < 1.2)) | ((adv > 0) & (ratio <= 0.8)) | ((adv < 0) & (ratio >= 1.2))
    expected = torch.where(inside, -adv * ratio, torch.zeros_like(ratio)) / 10.0
    torch.testing.assert_close(g, expected)


def test_token_mean_over_microbatches_equals_minibatch():
    torch.manual_seed(1)
    loss = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    full = ca.agg_loss(loss, mask, "token-mean")
    n = mask.sum()
    parts = sum(ca.agg_loss(loss[i : i + 1], mask[i : i + 1], global_num_tokens=n) for i in range(4))
    torch.testing.assert_close(parts, full)
    # seq-mean-token-mean by hand
    sm = ca.agg_loss(loss, mask, "seq-mean-token-mean")
    hand = torch.stack([(loss[i] * mask[i]).sum() / mask[i].sum() for i in range(4)]).mean()
    torch.testing.assert_close(sm, hand)
    with pytest.raises(ValueError, match="token-mean"):
        ca.agg_loss(loss, mask, "bogus")
