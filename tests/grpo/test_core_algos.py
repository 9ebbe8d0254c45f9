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


def _advantage_before_tie_rule(scores, group_size, norm_adv_by_std=True, epsilon=1e-6):
    """compute_grpo_outcome_advantage as it was before tied groups were zeroed
    (commit 945baa9): the formula the tie rule must leave untouched."""
    grouped = scores.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = grouped - mean
    if norm_adv_by_std:
        std = torch.ones_like(mean) if group_size == 1 else grouped.std(dim=1, keepdim=True)
        centred = centred / (std + epsilon)
    return centred.reshape(-1)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    "value,group_size",
    [(0.35, 8), (0.3, 7), (0.2, 16), (0.1, 3), (100.3, 7), (-0.35, 5), (0.123456789, 64), (1e-30, 6), (12345.678, 12)],
)
def test_tied_fractional_group_is_exactly_zero(value, group_size, norm):
    scores = torch.full((2 * group_size,), value)
    scores[group_size:] = torch.tensor([1.0, 0.0] * group_size)[:group_size]  # second group ordinary
    before = _advantage_before_tie_rule(scores, group_size, norm)
    adv = ca.compute_grpo_outcome_advantage(scores, group_size, norm_adv_by_std=norm)
    assert torch.equal(adv[:group_size], torch.zeros(group_size))
    assert torch.equal(_bits(adv[group_size:]), _bits(before[group_size:]))


def test_tied_group_regression_values():
    # the reported failures: fp32 rounding turned into advantages up to ~0.03,
    # and ~0.8 for a group of 7 x 100.3
    for value, g, old_max in [(0.35, 8, 0.0288), (0.3, 7, 0.0288), (0.2, 16, 0.0146), (100.3, 7, 0.8256)]:
        scores = torch.full((g,), value)
        assert _advantage_before_tie_rule(scores, g).abs().max().item() == pytest.approx(old_max, abs=1e-4)
        assert ca.compute_grpo_outcome_advantage(scores, g).abs().max().item() == 0.0


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_binary_rewards_bit_identical_to_formula(group_size, norm):
    # every 0/1 pattern of a group, all in one batch
    rows = [[(k >> j) & 1 for j in range(group_size)] for k in range(2**group_size)]
    scores = torch.tensor(rows, dtype=torch.float32).reshape(-1)
    adv = ca.compute_grpo_outcome_advantage(scores, group_size, norm_adv_by_std=norm)
    assert adv.dtype == torch.float32
    assert torch.equal(_bits(adv), _bits(_advantage_before_tie_rule(scores, group_size, norm)))


@pytest.mark.parametrize("norm", [True, False])
def test_ordinary_groups_bit_identical_to_formula(norm):
    gen = torch.Generator().manual_seed(0)
    binary = (torch.rand(64 * 16, generator=gen) > 0.5).float()  # 64 groups of 16
    fractional = torch.rand(32 * 8, generator=gen) * 10 - 3  # 32 groups of 8
    partial = (torch.randint(0, 11, (40 * 5,), generator=gen) / 10.0)  # 0.0 .. 1.0 in tenths
    for scores, g in [(binary, 16), (fractional, 8), (partial, 5)]:
        adv = ca.compute_grpo_outcome_advantage(scores, g, norm_adv_by_std=norm)
        ref = _advantage_before_tie_rule(scores, g, norm)
        tied = scores.view(-1, g).amax(1) == scores.view(-1, g).amin(1)
        keep = (~tied).repeat_interleave(g)
        assert torch.equal(_bits(adv[keep]), _bits(ref[keep]))
        assert torch.equal(adv[~keep], torch.zeros(int((~keep).sum())))


def test_near_equal_groups():
    x = torch.tensor(0.35)
    up = torch.nextafter(x, torch.tensor(1.0))
    # a one-ulp spread is rounding, not signal: tied
    one_ulp = torch.stack([x] * 7 + [up])
    assert _advantage_before_tie_rule(one_ulp, 8).abs().max().item() > 0.01
    assert torch.equal(ca.compute_grpo_outcome_advantage(one_ulp, 8), torch.zeros(8))
    # a spread of 1e-4 (~840 ulps) is a real difference: the formula applies
    near = torch.tensor([0.35] * 7 + [0.3501])
    adv = ca.compute_grpo_outcome_advantage(near, 8)
    d = near.double()
    exact = (d - d.mean()) / (d.std() + 1e-6)  # fp32 inputs, fp64 formula
    torch.testing.assert_close(adv.double(), exact, rtol=0, atol=1e-3)
    # by hand: spread u ~ 1e-4, std = u / sqrt(8), so A_odd = (7u/8) / (u/sqrt(8) + 1e-6) ~ 2.41
    assert adv[7].item() == pytest.approx(2.407, abs=2e-3)
    assert adv[0].item() == pytest.approx(-2.407 / 7, abs=1e-3)


def test_group_size_one_and_empty():
    scores = torch.tensor([0.35, 1.0, -2.5])
    for norm in (True, False):
        assert torch.equal(ca.compute_grpo_outcome_advantage(scores, 1, norm_adv_by_std=norm), torch.zeros(3))
    assert ca.compute_grpo_outcome_advantage(torch.zeros(0), 4).shape == (0,)


def test_fp64_bf16_and_integer_scores():
    tied64 = torch.full((7,), 100.3, dtype=torch.float64)
    assert _advantage_before_tie_rule(tied64, 7).abs().max().item() > 1e-9  # rounding in fp64 too
    adv64 = ca.compute_grpo_outcome_advantage(tied64, 7)
    assert adv64.dtype == torch.float64 and torch.equal(adv64, torch.zeros(7, dtype=torch.float64))
    s64 = torch.tensor([1.0, 0.0, 0.0, 0.25, 0.5, 0.75], dtype=torch.float64)
    assert torch.equal(ca.compute_grpo_outcome_advantage(s64, 3), _advantage_before_tie_rule(s64, 3))
    # bf16: computed in fp32, rounded once. [1,0,0] -> 1.1547 rounds to 1.1562 in
    # bf16 (bf16 arithmetic gave 1.1484)
    sb = torch.tensor([1.0, 0.0, 0.0, 0.35, 0.35, 0.35], dtype=torch.bfloat16)
    advb = ca.compute_grpo_outcome_advantage(sb, 3)
    assert advb.dtype == torch.bfloat16
    assert advb[:3].tolist() == [1.15625, -0.578125, -0.578125]
    assert torch.equal(advb[3:], torch.zeros(3, dtype=torch.bfloat16))
    # integer / bool scores: fp32 result
    si = torch.tensor([1, 0, 0, 1])
    advi = ca.compute_grpo_outcome_advantage(si, 2)
    assert advi.dtype == torch.float32
    assert torch.equal(advi, ca.compute_grpo_outcome_advantage(si.float(), 2))
    assert torch.equal(ca.compute_grpo_outcome_advantage(si.bool(), 2), advi)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_raise(bad):
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, bad])
    with pytest.raises(ValueError, match=r"scores\[5\] = .* is not finite \(group 1\)"):
        ca.compute_grpo_outcome_advantage(scores, 3)


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
    # seq-mean-token-sum by hand: each sequence's token sum, averaged over sequences (verl)
    torch.testing.assert_close(ca.agg_loss(loss, mask, "seq-mean-token-sum"), (loss * mask).sum(1).mean())
    # the seq-* modes over micro-batches of one sequence, given the mini-batch's sequence count
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        parts = sum(ca.agg_loss(loss[i : i + 1], mask[i : i + 1], mode, global_num_seqs=4) for i in range(4))
        torch.testing.assert_close(parts, ca.agg_loss(loss, mask, mode))
    with pytest.raises(ValueError, match="token-mean"):
        ca.agg_loss(loss, mask, "bogus")


# --------------------------------------------------------------------------
# log-ratio bound (issue 35 item 5): no NaN loss or gradient from finite log-probs
# --------------------------------------------------------------------------
def _policy_loss_before_bound(old, new, adv, lo=0.2, hi=0.2):
    """compute_policy_loss's pg_losses before the log-ratio bound (exp of the raw difference)."""
    ratio = torch.exp(new - old)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - lo, 1.0 + hi))


def _k3_before_bound(logp, ref):
    r = ref - logp
    return torch.clamp(torch.exp(r) - r - 1.0, min=-10.0, max=10.0)


def _verl_policy_loss(old, new, adv, mask, lo=0.2, hi=0.2):
    """verl's compute_policy_loss_vanilla (trainer/ppo/core_algos.py, commit 012be9d) without
    its dual clip, token-mean: the log-ratio clamped to [-20, 20] before exp, masked mean."""
    neg_kl = torch.clamp(new - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi))
    return (pg * mask).sum() / mask.sum()


def test_issue_example_gives_verls_value_not_nan():
    old = torch.tensor([[-5.0, -95.0]])
    new = torch.tensor([[-5.1, -1.0]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    # before: exp(94) overflows fp32 to inf, and the masked position's 0 * inf is NaN
    assert torch.isnan(ca.agg_loss(_policy_loss_before_bound(old, new.detach(), adv), mask))
    loss = ca.agg_loss(ca.compute_policy_loss(old, new, adv, mask)["pg_losses"], mask)
    d = torch.float64  # verl's formula on the exact inputs
    verl = _verl_policy_loss(torch.tensor([[-5.0, -95.0]], dtype=d), torch.tensor([[-5.1, -1.0]], dtype=d),
                             adv.to(d), mask.to(d))
    assert verl.item() == pytest.approx(-math.exp(-0.1), abs=1e-12)  # -0.904837
    assert loss.item() == pytest.approx(verl.item(), abs=1e-6)
    assert round(loss.item(), 3) == -0.905
    (g,) = torch.autograd.grad(loss, new)
    # d/dnew of -A exp(new - old) at the response token (ratio 0.905, unclipped); 0 at the masked one
    torch.testing.assert_close(g, torch.tensor([[-math.exp(-0.1), 0.0]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("masked", [True, False])
def test_k3_gradient_is_finite_past_fp32_exp_overflow(masked):
    # ref - logp = 100 > 88.7: exp overflows; the old k3 was clamped to 10 but its gradient was
    # 0 * inf = NaN, at a masked position too
    logp = torch.tensor([[-0.5, -100.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0 if masked else 1.0]])
    (g_old,) = torch.autograd.grad(ca.agg_loss(_k3_before_bound(logp, ref), mask), logp)
    assert torch.isnan(g_old[0, 1])
    kl = ca.kl_penalty(logp, ref, "k3", mask)
    assert kl[0, 1].item() == (0.0 if masked else 10.0)
    (g,) = torch.autograd.grad(ca.agg_loss(kl, mask), logp)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); the clamp at 10 has gradient 0
    n = mask.sum().item()
    torch.testing.assert_close(g, torch.tensor([[(1 - math.exp(-0.5)) / n, 0.0]]), rtol=0, atol=1e-7)


def _reference_loss(old, new, ref, adv, mask, kind, mode):
    """Float64 statement of the bounded loss: the log-ratios clamped to [-20, 20] (verl) and 0 at
    masked positions before exp; every KL estimator on zeroed masked positions."""
    m = mask.bool()
    z = torch.zeros_like(new)
    lr = torch.where(m, torch.clamp(new - old, -20.0, 20.0), z)
    ratio = torch.exp(lr)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    lp, rf = torch.where(m, new, z), torch.where(m, ref, z)
    if kind in ("low_var_kl", "k3"):
        r = torch.clamp(rf - lp, -20.0, 20.0)
        kl = torch.clamp(torch.exp(r) - r - 1.0, -10.0, 10.0)
    elif kind in ("kl", "k1"):
        kl = lp - rf
    elif kind == "abs":
        kl = (lp - rf).abs()
    else:
        kl = 0.5 * (lp - rf) ** 2
    per_token = (pg + 0.01 * kl) * mask
    if mode == "token-mean":
        return per_token.sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return per_token.sum(-1).mean()
    return (per_token.sum(-1) / mask.sum(-1)).mean()  # seq-mean-token-mean


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("kind", ["low_var_kl", "k1", "abs", "k2"])
def test_no_nan_loss_or_gradient_for_log_ratios_up_to_1000(kind, mode):
    """Property: random finite log-probs whose log-ratios reach +-1000 (nine in ten past the
    +-88.7 where fp32 exp overflows) give a finite loss and finite gradients, equal to a float64
    statement of the formula, gradients to its autograd."""
    gen = torch.Generator().manual_seed(35)
    for _ in range(25):
        b, s = 3, 8
        old = -torch.rand(b, s, generator=gen) * 20
        new = old + (torch.rand(b, s, generator=gen) * 2 - 1) * 1000
        ref = new + (torch.rand(b, s, generator=gen) * 2 - 1) * 1000
        adv = torch.randn(b, 1, generator=gen).expand(b, s) * 3
        mask = (torch.rand(b, s, generator=gen) > 0.3).float()
        mask[0, 0] = 1.0
        new32 = new.clone().requires_grad_(True)
        pg = ca.compute_policy_loss(old, new32, adv, mask)["pg_losses"]
        loss = ca.agg_loss(pg + 0.01 * ca.kl_penalty(new32, ref, kind, mask), mask, mode)
        (g,) = torch.autograd.grad(loss, new32)
        assert torch.isfinite(loss) and bool(torch.isfinite(g).all())
        new64 = new.double().requires_grad_(True)
        want = _reference_loss(old.double(), new64, ref.double(), adv.double(), mask.double(), kind, mode)
        (g64,) = torch.autograd.grad(want, new64)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-5)
        assert torch.equal(g[mask == 0], torch.zeros(int((mask == 0).sum())))


@pytest.mark.parametrize("kind", ["low_var_kl", "k1", "abs", "k2"])
def test_in_range_loss_and_gradient_are_bit_identical_to_the_unbounded_formula(kind):
    """|log-ratio| <= 20 at response tokens (every real run): the bound changes no bit of the
    loss or of the gradient."""
    old_kl = {"low_var_kl": _k3_before_bound, "k1": lambda a, b: a - b, "abs": lambda a, b: (a - b).abs(),
              "k2": lambda a, b: 0.5 * (a - b).square()}[kind]
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        old = -torch.rand(4, 16, generator=gen) * 8
        new = old + torch.randn(4, 16, generator=gen) * 0.5
        new[0, :4] = old[0, :4] + torch.tensor([19.5, -19.5, 3.0, -3.0])  # near the bound, past the PPO clip
        ref = new + torch.randn(4, 16, generator=gen) * 0.3
        adv = torch.randn(4, 1, generator=gen).expand(4, 16)
        mask = (torch.rand(4, 16, generator=gen) > 0.25).float()
        mask[0, :4] = 1.0
        a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
        loss_a = ca.agg_loss(_policy_loss_before_bound(old, a, adv) + 0.01 * old_kl(a, ref), mask)
        out = ca.compute_policy_loss(old, b, adv, mask)
        loss_b = ca.agg_loss(out["pg_losses"] + 0.01 * ca.kl_penalty(b, ref, kind, mask), mask)
        assert torch.equal(_bits(loss_a.detach()), _bits(loss_b.detach()))
        (ga,), (gb,) = torch.autograd.grad(loss_a, a), torch.autograd.grad(loss_b, b)
        assert torch.equal(ga, gb)
        keep = mask.bool()
        assert torch.equal(_bits(_policy_loss_before_bound(old, new, adv)[keep]), _bits(out["pg_losses"].detach()[keep]))
        assert out["ppo_kl"].item() == ca.masked_mean(old - new, mask).item()


def test_bounded_log_ratio_values():
    a = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    b = torch.tensor([[-1000.0, 1000.0, 0.25, float("-inf")]])
    assert ca.bounded_log_ratio(a, b).tolist() == [[20.0, -20.0, -0.25, 20.0]]
    assert ca.bounded_log_ratio(a, b, torch.tensor([[1, 1, 1, 0]])).tolist() == [[20.0, -20.0, -0.25, 0.0]]
    assert ca.LOG_RATIO_CLAMP == 20.0
