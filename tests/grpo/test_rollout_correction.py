"""verl's rollout correction (``grpo/rollout_correction.py``): the weights, the rejection, the veto and
the metrics against hand-computed values; the loss's gradient against autograd of the formula; the
flags' checks and their resume record."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.loss import grpo_token_loss, update_metrics
from megatron_cegrpo.grpo.rollout_correction import rollout_corr_metrics, rollout_correction

L2 = math.log(2.0)
# two sequences of 4 positions; the second has 3 response tokens; log rho per token:
#   seq 0: +0.1, -1.0 (rho 0.37 < 1/2), +0.9 (rho 2.46 > 2), 0.0
#   seq 1: +0.2, +0.2, +0.2, (off the mask: +5)
LOG_RHO = torch.tensor([[0.1, -1.0, 0.9, 0.0], [0.2, 0.2, 0.2, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.7, -0.4, -1.1, -2.0]])
TRAIN = ROLLOUT + LOG_RHO


def test_token_is_weights_are_truncated_ratios_zero_off_the_mask():
    w, kept, st = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_is="token", rollout_is_threshold=2.0)
    want = torch.tensor([[math.exp(0.1), math.exp(-1.0), 2.0, 1.0], [math.exp(0.2)] * 3 + [0.0]])
    torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    assert torch.equal(kept, MASK)  # no rejection asked
    assert st["rc_tokens"] == 7 and st["rc_high"] == 1 and st["rc_low"] == 1 and st["rc_rejected"] == 0
    torch.testing.assert_close(st["rc_weight_sum"], want.sum())


def test_sequence_is_weights_are_the_truncated_product():
    w, _, _ = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_is="sequence", rollout_is_threshold=2.0)
    # seq 0: exp(0.1 - 1.0 + 0.9 + 0) = 1.0; seq 1: exp(0.6) = 1.82 (the off-mask +5 is not counted)
    torch.testing.assert_close(w, torch.tensor([[1.0] * 4, [math.exp(0.6)] * 3 + [0.0]]), rtol=1e-6, atol=1e-7)
    w, _, _ = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_is="sequence", rollout_is_threshold=1.5)
    torch.testing.assert_close(w[1], torch.tensor([1.5, 1.5, 1.5, 0.0]))


def test_token_rejection_uses_the_is_threshold_and_its_reciprocal_by_default():
    w, kept, st = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_rs="token", rollout_is_threshold=2.0)
    assert torch.equal(w, MASK)  # no IS weights asked
    assert kept.tolist() == [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    assert st["rc_rejected"] == 2
    # explicit bounds: [0.3, 3] keeps every token
    _, kept, _ = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_rs="token", rollout_rs_threshold=3.0,
                                    rollout_rs_threshold_lower=0.3)
    assert torch.equal(kept, MASK)


def test_sequence_and_geometric_rejection_reject_whole_sequences():
    # product: seq 0 1.0 (kept), seq 1 exp(0.6) = 1.82: rejected at upper 1.5
    _, kept, st = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_rs="sequence", rollout_rs_threshold=1.5)
    assert kept.tolist() == [[1.0] * 4, [0.0] * 4] and st["rc_rejected"] == 3
    # geometric mean: seq 0 exp(0) = 1, seq 1 exp(0.2) = 1.22: rejected at upper 1.2, kept at 1.25
    _, kept, _ = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_rs="geometric", rollout_rs_threshold=1.2)
    assert kept.tolist() == [[1.0] * 4, [0.0] * 4]
    _, kept, _ = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_rs="geometric", rollout_rs_threshold=1.25)
    assert torch.equal(kept, MASK)


def test_veto_rejects_the_sequence_of_a_catastrophic_token_on_the_mask_only():
    train = TRAIN.clone()
    train[0, 2] = ROLLOUT[0, 2] - 30.0  # rho = e^-30 < 1e-4, beyond the +-20 bound too
    train[1, 3] = ROLLOUT[1, 3] - 30.0  # off the mask: no veto
    w, kept, st = rollout_correction(train, ROLLOUT, MASK, rollout_is="token", rollout_token_veto_threshold=1e-4)
    assert kept.tolist() == [[0.0] * 4, [1.0, 1.0, 1.0, 0.0]]
    assert st["rc_vetoed"] == 1 and st["rc_seqs"] == 2 and st["rc_rejected"] == 4
    assert w[0, 2] == pytest.approx(math.exp(-20.0), rel=1e-5)  # the weight is bounded at exp(-20)


def test_a_truncation_at_or_below_one_is_legal_without_rejection():
    # C <= 1 only caps the weights (the rejection band's default 1 / C is checked only with --rollout-rs)
    w, kept, _ = rollout_correction(TRAIN, ROLLOUT, MASK, rollout_is="token", rollout_is_threshold=1.0,
                                    rollout_token_veto_threshold=1e-4)
    assert torch.equal(kept, MASK) and float(w.max()) == 1.0
    assert w[0, 1] == pytest.approx(math.exp(-1.0), rel=1e-6)


def test_an_infinite_log_prob_gives_a_finite_sequence_weight():
    train = TRAIN.clone()
    train[0, 0], train[0, 1] = float("inf"), float("-inf")
    w, _, _ = rollout_correction(train, ROLLOUT, MASK, rollout_is="sequence", rollout_rs="sequence",
                                 rollout_rs_threshold=1e9, rollout_rs_threshold_lower=1e-9)
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"rollout_is": "tok"}, "--rollout-is must be one of token, sequence"),
    ({"rollout_rs": "seq"}, "--rollout-rs must be one of token, sequence, geometric"),
    ({"rollout_is_threshold": 0.0}, "thresholds > 0"),
    ({"rollout_is": "token", "rollout_token_veto_threshold": 0.0}, "thresholds > 0"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 2.0}, "lower < upper"),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 0.9}, "lower < upper"),
])
def test_bad_levels_and_thresholds_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(TRAIN, ROLLOUT, MASK, **kwargs)


def test_metrics_are_the_sums_ratios():
    sums = {"rc_tokens": 8.0, "rc_weight_sum": 6.0, "rc_high": 2.0, "rc_low": 1.0, "rc_rejected": 4.0,
            "rc_seqs": 4.0, "rc_vetoed": 1.0}
    assert rollout_corr_metrics(sums) == {
        "rollout_corr/rollout_is_mean": 0.75, "rollout_corr/rollout_is_ratio_fraction_high": 0.25,
        "rollout_corr/rollout_is_ratio_fraction_low": 0.125, "rollout_corr/rollout_is_masked_fraction": 0.5,
        "rollout_corr/rollout_is_veto_fraction": 0.25}


def _grpo(**kw):
    base = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, kl_coef=0.0, kl_loss_type="low_var_kl",
                loss_agg_mode="token-mean", rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None,
                rollout_rs_threshold=None, rollout_rs_threshold_lower=None, rollout_token_veto_threshold=None)
    base.update(kw)
    g = SimpleNamespace(**base)
    g.rollout_correction = g.rollout_is is not None or g.rollout_rs is not None or g.rollout_token_veto_threshold
    return g


def _micro_batch(seed=0, b=3, s=6, v=11):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=gen)
    labels = torch.randint(0, v, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.2).float()
    adv = torch.randn(b, 1, generator=gen).expand(b, s).contiguous()
    lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    rollout = (lp + 0.8 * torch.randn(b, s, generator=gen)) * mask  # a compressed view's mismatch
    return logits, {"labels": labels, "loss_mask": mask, "advantages": adv}, rollout


def test_loss_gradient_is_autograd_of_the_weighted_kept_token_mean():
    logits, mb, rollout = _micro_batch()
    grpo = _grpo(rollout_is="token", rollout_rs="token", rollout_rs_threshold=1.8)
    x = logits.clone().requires_grad_(True)
    loss, stats = grpo_token_loss(x, mb, grpo, temperature=1.0, num_tokens=20.0, num_seqs=3.0,
                                  rollout_logprobs=rollout)
    loss.backward()
    # the formula by hand: ratio 1 (the pass's own old log-probs), pg = -A r, w = min(rho, 2) detached,
    # the kept tokens those with rho in [1/1.8, 1.8], divided by the mini-batch's 20 tokens
    y = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(y, -1).gather(-1, mb["labels"][..., None])[..., 0]
    rho = torch.exp((lp.detach() - rollout) * mb["loss_mask"])
    w = rho.clamp(max=2.0)
    kept = mb["loss_mask"] * ((rho <= 1.8) & (rho >= 1 / 1.8)).float()
    assert 0 < kept.sum() < mb["loss_mask"].sum()  # the case rejects some tokens, not all
    ratio = torch.exp(lp - lp.detach())
    want = (-(mb["advantages"] * ratio) * w * kept).sum() / 20.0
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)
    assert stats["rc_rejected"] == (mb["loss_mask"] - kept).sum()


def test_clipfrac_and_ppo_kl_are_over_the_kept_tokens_as_verls():
    # old log-probs 0.3 nats off on half the tokens: those clip (|log r| = 0.3 > log 1.2) and carry ppo_kl
    logits, mb, rollout = _micro_batch(seed=3)
    lp = ca.logprobs_from_logits(logits, mb["labels"])
    shift = torch.zeros_like(lp)
    shift[:, ::2] = 0.3
    old = (lp - shift * torch.sign(mb["advantages"])) * mb["loss_mask"]  # r = e^{+-0.3}: the clipped side
    grpo = _grpo(rollout_rs="token", rollout_rs_threshold=1.8)
    _, stats = grpo_token_loss(logits.clone(), mb, grpo, temperature=1.0, num_tokens=15.0, num_seqs=3.0,
                               old_logprobs=old, rollout_logprobs=rollout)
    rho = torch.exp((old - rollout) * mb["loss_mask"])
    kept = mb["loss_mask"] * ((rho <= 1.8) & (rho >= 1 / 1.8)).float()
    clipped = kept * (shift > 0).float()
    assert (mb["advantages"] != 0).all()  # every shifted token is on the clipped side
    assert 0 < clipped.sum() < kept.sum() < mb["loss_mask"].sum()  # some clip, some rejected
    assert stats["tokens"] == mb["loss_mask"].sum() and stats["rc_rejected"] == mb["loss_mask"].sum() - kept.sum()
    torch.testing.assert_close(stats["clip_sum"], clipped.sum())  # metric = clip_sum / (tokens - rejected)
    torch.testing.assert_close(stats["ppo_kl_sum"], ((old - lp) * kept).sum(), rtol=1e-5, atol=1e-6)


def test_update_metrics_divide_clipfrac_and_ppo_kl_by_the_kept_tokens_and_the_losses_by_all():
    # a batch's sums (micro-batches, epochs and replicas added): 40 response tokens, 10 of them rejected
    sums = {"pg_loss_sum": 2.0, "clip_sum": 6.0, "ppo_kl_sum": 0.3, "kl_sum": 0.8, "tokens": 40.0, "rc_rejected": 10.0}
    assert update_metrics(sums, kl_term=True) == {"actor/pg_loss": 0.05, "actor/pg_clipfrac": 0.2,
                                                  "actor/ppo_kl": 0.01, "actor/kl_loss": 0.02}
    del sums["rc_rejected"]  # no rollout correction: every denominator is the batch's tokens
    assert update_metrics(sums, kl_term=False) == {"actor/pg_loss": 0.05, "actor/pg_clipfrac": 0.15,
                                                   "actor/ppo_kl": 0.0075}
    empty = dict.fromkeys(("pg_loss_sum", "clip_sum", "ppo_kl_sum", "tokens", "rc_rejected"), 0.0)
    assert set(update_metrics(empty, kl_term=False).values()) == {0.0}  # no response tokens: 0, not NaN


def test_the_weights_use_the_old_log_probs_when_they_are_given():
    # --ppo-epochs > 1 or several optimizer steps: pi_train is the old-log-prob pass's, not this pass's
    logits, mb, rollout = _micro_batch(seed=2)
    old = (ca.logprobs_from_logits(logits, mb["labels"]) - 0.3) * mb["loss_mask"]
    grpo = _grpo(rollout_is="token")
    x = logits.clone().requires_grad_(True)
    loss, stats = grpo_token_loss(x, mb, grpo, temperature=1.0, num_tokens=15.0, num_seqs=3.0, old_logprobs=old,
                                  rollout_logprobs=rollout)
    want_w = torch.exp((old - rollout) * mb["loss_mask"]).clamp(max=2.0) * mb["loss_mask"]
    torch.testing.assert_close(stats["rc_weight_sum"], want_w.sum(), rtol=1e-6, atol=1e-6)
    y = logits.clone().requires_grad_(True)
    ref, _ = grpo_token_loss(y, mb, _grpo(), temperature=1.0, num_tokens=15.0, num_seqs=3.0, old_logprobs=old)
    pol = ca.compute_policy_loss(old, ca.logprobs_from_logits(logits, mb["labels"]), mb["advantages"],
                                 mb["loss_mask"], clip_ratio_low=0.2, clip_ratio_high=0.2)
    torch.testing.assert_close(loss, (pol["pg_losses"] * want_w).sum() / 15.0, rtol=1e-6, atol=1e-7)
    assert not torch.equal(loss, ref)


def test_loss_without_a_correction_is_unchanged_bit_for_bit():
    logits, mb, rollout = _micro_batch(seed=1)
    grads = []
    for grpo, rl in ((_grpo(), rollout), (_grpo(rollout_is="token"), None), (_grpo(), None)):
        x = logits.clone().requires_grad_(True)
        loss, stats = grpo_token_loss(x, mb, grpo, temperature=1.0, num_tokens=15.0, num_seqs=3.0,
                                      rollout_logprobs=rl)
        loss.backward()
        grads.append((loss.detach(), x.grad))
        assert not any(k.startswith("rc_") for k in stats)
    for loss, g in grads[1:]:
        assert torch.equal(loss, grads[0][0]) and torch.equal(g, grads[0][1])
    # and a correction whose bounds keep everything with weights 1 (rho == 1) is the same loss
    x = logits.clone().requires_grad_(True)
    lp = ca.logprobs_from_logits(logits, mb["labels"])
    loss, _ = grpo_token_loss(x, mb, _grpo(rollout_is="token", rollout_rs="token"), temperature=1.0,
                              num_tokens=15.0, num_seqs=3.0, rollout_logprobs=lp * mb["loss_mask"])
    loss.backward()
    torch.testing.assert_close(x.grad, grads[0][1], rtol=0, atol=0)


def _cfg(*flags):
    return build_config(parse_args(list(flags))).validate()


def test_flags_parse_validate_and_are_recorded_for_resume_only_when_on():
    cfg = _cfg("--rollout-is", "token", "--rollout-rs", "geometric", "--rollout-rs-threshold", "1.01",
               "--rollout-token-veto-threshold", "1e-4")
    g = cfg.grpo
    assert (g.rollout_is, g.rollout_rs, g.rollout_rs_threshold, g.rollout_token_veto_threshold) == \
        ("token", "geometric", 1.01, 1e-4) and g.rollout_correction
    opts = cfg.resume_options()
    assert opts["--rollout-is"] == "token" and opts["--rollout-rs-threshold"] == 1.01
    assert opts["--rollout-is-threshold"] == 2.0 and opts["--rollout-rs-threshold-lower"] is None
    off = _cfg().resume_options()
    assert not _cfg().grpo.rollout_correction and not any(k.startswith("--rollout-is") or k.startswith(
        "--rollout-rs") or k == "--rollout-token-veto-threshold" for k in off)


@pytest.mark.parametrize("flags, match", [
    (("--rollout-is-threshold", "0"), "--rollout-is-threshold must be a finite number > 0"),
    (("--rollout-rs", "token", "--rollout-rs-threshold", "-1"), "--rollout-rs-threshold must be"),
    (("--rollout-rs", "token", "--rollout-rs-threshold", "2", "--rollout-rs-threshold-lower", "3"),
     "--rollout-rs-threshold-lower must be a finite number > 0 and < 2"),
    (("--rollout-token-veto-threshold", "0"), "--rollout-token-veto-threshold must be"),
    (("--rollout-rs-threshold", "2"), "without --rollout-rs"),
    (("--rollout-rs", "token", "--rollout-is-threshold", "1"), "its default lower bound 1 / 1 is not below it"),
])
def test_bad_flags_stop_with_one_line(flags, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(*flags)
    assert "\n" not in str(e.value) and "fix:" in str(e.value)


def test_bad_level_is_refused_by_the_parser_in_one_line():
    with pytest.raises(ConfigError, match="argument --rollout-rs: invalid choice: 'tokens'") as e:
        parse_args(["--rollout-rs", "tokens"])
    assert "\n" not in str(e.value)
