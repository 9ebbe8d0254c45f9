"""Rollout correction: importance weights and rejection between the sampler and the trainer.

The dense sampler draws the responses from pi_rollout (its log-probs: ``sampler_logprobs``),
but the stages' update pass computes log-probs through the compressed boundary, pi_train,
which differs from pi_rollout by 0.4-1.2 nats a token at 5 % of the bytes
(``mismatch/abs_logprob_diff_mean``; docs/results.md), 20-60 times the 0.02-nat gap between
the sampler and the dense bf16 stages. The correction below is verl's rollout correction
(``algorithm.rollout_correction``, Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch"; the token-level truncated
weights are Yao et al. 2025's TIS), with verl's names:

    rho_t = pi_train(y_t) / pi_rollout(y_t)                         (the per-token ratio)

* IS weights, ``--rollout-is``: ``token``: w_t = min(rho_t, C); ``sequence``: w_t =
  min(prod_t rho_t, C) for every token of the sequence (C = ``--rollout-is-threshold``). They
  multiply the policy-gradient term (detached: a weight, not a path for the gradient).
* Rejection, ``--rollout-rs``: a token (``token``), or a whole sequence (``sequence``: the
  product of its ratios; ``geometric``: their geometric mean, exp(mean_t log rho_t)) whose
  ratio lies outside [lower, upper] leaves the loss (its loss-mask entry becomes 0; upper =
  ``--rollout-rs-threshold``, default C; lower = ``--rollout-rs-threshold-lower``, default
  1 / upper).
* Veto, ``--rollout-token-veto-threshold`` v: a sequence with any token of rho_t < v leaves the
  loss (checked on the unbounded ratio).

Log-ratios are bounded to [-20, 20] before ``exp`` (verl's safety bound; a sequence's log-ratio
is the sum of its bounded token log-ratios, so an infinite log-prob cannot make it NaN); positions
off the loss mask have weight 0. pi_train is the pass's own detached log-probs where the update
gives the old ones (bypass mode: one optimizer step an iteration), else the old log-probs pass's
(``--recompute-old-log-prob``, ``--ppo-epochs`` > 1 or several optimizer steps an iteration).

Differences from verl: rejected tokens stay in ``token-mean``'s denominator (the mini-batch's
token count is fixed before its micro-batches run, and the ratio needs the pass's own
log-probs), so a rejected token's share of the mean is dropped, not handed to the others
(``rollout_corr/rollout_is_masked_fraction`` says how much that is; in the ``seq-mean`` modes a
rejected sequence still counts in the number of sequences); ``rollout_is_ratio_fraction_high`` /
``_low`` count tokens by their own ratio at every level. ``pg_clipfrac`` and ``ppo_kl`` are over the
kept tokens, as verl's (its modified response mask).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from megatron_cegrpo.arguments import ROLLOUT_IS_LEVELS as IS_LEVELS, ROLLOUT_RS_LEVELS as RS_LEVELS

__all__ = ["IS_LEVELS", "RS_LEVELS", "LOG_RATIO_BOUND", "RC_SUMS", "rollout_correction", "rollout_corr_metrics"]

#: the sums :func:`rollout_correction` returns (added over micro-batches and replicas)
RC_SUMS = ("rc_tokens", "rc_weight_sum", "rc_high", "rc_low", "rc_rejected", "rc_seqs", "rc_vetoed")
#: verl's safety bound on log-ratios before ``exp`` (weights within [2e-9, 5e8])
LOG_RATIO_BOUND = 20.0


def rollout_correction(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       rollout_is: Optional[str] = None, rollout_is_threshold: float = 2.0,
                       rollout_rs: Optional[str] = None, rollout_rs_threshold: Optional[float] = None,
                       rollout_rs_threshold_lower: Optional[float] = None,
                       rollout_token_veto_threshold: Optional[float] = None,
                       ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """The IS weights and the rejection mask of one micro-batch (module docstring; verl's
    ``compute_rollout_correction_and_rejection_mask``).

    Args:
        train_logprobs: fp32 [b, s], log pi_train of the sampled tokens (detached by the caller).
        rollout_logprobs: fp32 [b, s], the sampler's log-probs of the same tokens.
        mask: float [b, s], 1 on response tokens (the loss mask).
        rollout_is: None, ``token`` or ``sequence``; rollout_is_threshold: C > 0 (truncation).
        rollout_rs: None, ``token``, ``sequence`` or ``geometric``; rollout_rs_threshold: upper
            (default C); rollout_rs_threshold_lower: lower (default 1 / upper).
        rollout_token_veto_threshold: None or v > 0 (a sequence with a token of ratio < v is rejected).

    Returns:
        (weights, kept, stats): weights fp32 [b, s] (``mask`` where ``rollout_is`` is None, else
        the truncated weights times ``mask``), kept float [b, s] (``mask`` with the rejected
        tokens zeroed), and detached 0-dim fp32 sums over the micro-batch: ``rc_tokens`` (mask
        tokens), ``rc_weight_sum`` (weights over mask tokens, before rejection), ``rc_high`` /
        ``rc_low`` (mask tokens whose token ratio is above C / below 1 / C), ``rc_rejected``
        (mask tokens rejected by rejection or veto), ``rc_seqs`` (sequences with a response token),
        ``rc_vetoed`` (of them vetoed).

    Raises:
        ValueError: an unknown level, C <= 0, a veto threshold <= 0, or (with ``rollout_rs``)
            not 0 < lower < upper.
    """
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"--rollout-is must be one of {', '.join(IS_LEVELS)} (or left out); got {rollout_is!r}")
    if rollout_rs is not None and rollout_rs not in RS_LEVELS:
        raise ValueError(f"--rollout-rs must be one of {', '.join(RS_LEVELS)} (or left out); got {rollout_rs!r}")
    upper = float(rollout_is_threshold if rollout_rs_threshold is None else rollout_rs_threshold)
    lower = 1.0 / upper if rollout_rs_threshold_lower is None and upper > 0 else rollout_rs_threshold_lower
    if not rollout_is_threshold > 0 or (rollout_token_veto_threshold is not None
                                        and not rollout_token_veto_threshold > 0):
        raise ValueError(f"rollout correction needs thresholds > 0; got C {rollout_is_threshold}, veto "
                         f"{rollout_token_veto_threshold}")
    if rollout_rs is not None and (not upper > 0 or lower is None or not 0 < float(lower) < upper):
        raise ValueError(f"rollout rejection needs 0 < lower < upper; got [{lower}, {upper}]")
    mask = mask.to(torch.float32)
    on = mask > 0
    log_ratio = torch.where(on, train_logprobs.float() - rollout_logprobs.float(), torch.zeros_like(mask))
    tok_lr = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ntok = mask.sum(dim=-1)  # [b]
    seq_lr = tok_lr.sum(dim=-1)  # log prod_t rho_t (of the bounded token ratios: finite)
    geo_lr = seq_lr / ntok.clamp_min(1.0)

    if rollout_is == "token":
        weights = tok_lr.exp().clamp(max=float(rollout_is_threshold)) * mask
    elif rollout_is == "sequence":
        w = seq_lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp().clamp(max=float(rollout_is_threshold))
        weights = w[:, None] * mask
    else:
        weights = mask.clone()

    reject = torch.zeros_like(on)
    lo, hi = (math.log(float(lower)), math.log(upper)) if rollout_rs is not None else (0.0, 0.0)
    if rollout_rs == "token":
        reject = on & ((tok_lr > hi) | (tok_lr < lo))
    elif rollout_rs in ("sequence", "geometric"):
        agg = seq_lr if rollout_rs == "sequence" else geo_lr
        reject = on & ((agg > hi) | (agg < lo))[:, None]
    vetoed = torch.zeros_like(ntok, dtype=torch.bool)
    if rollout_token_veto_threshold is not None:
        vetoed = (on & (log_ratio < math.log(float(rollout_token_veto_threshold)))).any(dim=-1)
        reject = reject | (on & vetoed[:, None])
    kept = mask * (~reject).to(mask.dtype)

    c = math.log(float(rollout_is_threshold))
    with torch.no_grad():
        stats = {"rc_tokens": mask.sum(), "rc_weight_sum": (weights * mask).sum(),
                 "rc_high": (on & (tok_lr > c)).sum().float(), "rc_low": (on & (tok_lr < -c)).sum().float(),
                 "rc_rejected": reject.sum().float(), "rc_seqs": (ntok > 0).sum().float(),
                 "rc_vetoed": (vetoed & (ntok > 0)).sum().float()}
    return weights.detach(), kept, stats


def rollout_corr_metrics(sums: Dict[str, float]) -> Dict[str, float]:
    """verl's ``rollout_corr/`` metrics from the sums of :func:`rollout_correction` over a batch
    (every micro-batch and data-parallel replica added): ``rollout_is_mean`` (mean weight over
    response tokens), ``rollout_is_ratio_fraction_high`` / ``_low`` (tokens with rho above C /
    below 1 / C), ``rollout_is_masked_fraction`` (tokens rejected), ``rollout_is_veto_fraction``
    (sequences vetoed). The mean log-ratio itself is ``mismatch/logprob_diff_mean`` (its negative)."""
    tok, seqs = max(sums["rc_tokens"], 1.0), max(sums["rc_seqs"], 1.0)
    return {"rollout_corr/rollout_is_mean": sums["rc_weight_sum"] / tok,
            "rollout_corr/rollout_is_ratio_fraction_high": sums["rc_high"] / tok,
            "rollout_corr/rollout_is_ratio_fraction_low": sums["rc_low"] / tok,
            "rollout_corr/rollout_is_masked_fraction": sums["rc_rejected"] / tok,
            "rollout_corr/rollout_is_veto_fraction": sums["rc_vetoed"] / seqs}
