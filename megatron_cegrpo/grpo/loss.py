"""The GRPO token loss, in one place: the stages' update pass, the anchor's dense replay and
the link benchmark all call :func:`grpo_token_loss` (DESIGN.md section 2, step 7).

loss = agg( max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) + beta KL(pi || pi_ref) ),
r = exp(log pi(y) - log pi_old(y)) (the log-ratio clamped to [-20, 20] and 0 at masked positions
before ``exp``: ``core_algos.bounded_log_ratio``), log-probs of the logits divided by the sampling
temperature (the sampler's distribution), KL by ``kl_loss_type`` (k3 by default). With one of
verl's rollout corrections on (``grpo/rollout_correction.py``) and the sampler's log-probs given,
the policy-gradient term is multiplied by the importance weights w_t and the rejected tokens leave
the aggregation mask: loss = agg_{kept}( w pg + beta KL ).
Sources: PPO (Schulman et al. 2017) eq. (7), DAPO's clip-higher and token-mean
aggregation (Yu et al. 2025), GRPO (Shao et al. 2024) eq. (3); ``grpo/core_algos.py``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.rollout_correction import rollout_correction

__all__ = ["grpo_token_loss", "update_metrics"]


def grpo_token_loss(
    logits: torch.Tensor,
    mb: Dict[str, torch.Tensor],
    grpo,
    *,
    temperature: float,
    num_tokens: float,
    num_seqs: float,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped-ratio GRPO loss (+ KL to the reference) of one micro-batch.

    Args:
        logits: [b, s, V] (any float dtype; computed in fp32).
        mb: the micro-batch: ``labels`` long [b, s], ``loss_mask`` float [b, s] (1 on
            response tokens), ``advantages`` float [b, s].
        grpo: a GRPOConfig (``clip_ratio_low``, ``clip_ratio_high``, ``kl_coef``,
            ``kl_loss_type``, ``loss_agg_mode``).
        temperature: the sampler's temperature (logits are divided by it).
        num_tokens, num_seqs: response tokens / sequences of the whole mini-batch, so that
            the micro-batch losses add up to the mini-batch's mean (``agg_loss``).
        old_logprobs: fp32 [b, s] of the policy that generated the batch; None: this pass's
            own detached log-probs (ratio 1, gradient -A grad log pi: the anchor's replay).
        ref_logprobs: fp32 [b, s] of the frozen reference, or None for no KL term (the KL
            term is added only when ``grpo.kl_coef > 0`` and ``ref_logprobs`` is given).
        rollout_logprobs: fp32 [b, s], the sampler's log-probs: with ``grpo.rollout_correction``
            the ratio pi_old / pi_rollout (pi_old: ``old_logprobs``, else this pass's own) sets the
            weights and the rejection (``grpo/rollout_correction.py``); None: no correction (the
            anchor's dense replay).

    Returns:
        (loss, stats): the 0-dim loss, and detached sums over the micro-batch's response
        tokens: ``pg_loss_sum``, ``clip_sum`` (clipped tokens), ``ppo_kl_sum`` and, when there is a KL
        term, ``kl_sum``, each over the tokens a rollout correction keeps (all of them without one);
        ``tokens``, every response token; ``rc_*`` with a rollout correction
        (``rollout_correction``'s sums), and ``logprobs_detached`` (fp32 [b, s], this pass's
        log-probs at the temperature, every position).
    """
    logp = ca.logprobs_from_logits(logits.float() / temperature, mb["labels"])
    mask = mb["loss_mask"]
    old = logp.detach() if old_logprobs is None else old_logprobs
    ntok = mask.sum()
    weights, rc = None, {}
    if rollout_logprobs is not None and getattr(grpo, "rollout_correction", False):
        weights, mask, rc = rollout_correction(  # mask: the kept tokens from here on (verl's modified mask)
            old.detach(), rollout_logprobs, mask, rollout_is=grpo.rollout_is,
            rollout_is_threshold=grpo.rollout_is_threshold, rollout_rs=grpo.rollout_rs,
            rollout_rs_threshold=grpo.rollout_rs_threshold, rollout_rs_threshold_lower=grpo.rollout_rs_threshold_lower,
            rollout_token_veto_threshold=grpo.rollout_token_veto_threshold)
    # pg_clipfrac and ppo_kl over the kept tokens, as verl's: a rejected token has no gradient
    pol = ca.compute_policy_loss(old, logp, mb["advantages"], mask,
                                 clip_ratio_low=grpo.clip_ratio_low, clip_ratio_high=grpo.clip_ratio_high)
    loss_mat = pol["pg_losses"] if weights is None else pol["pg_losses"] * weights
    nkept = mask.sum()
    stats = {"pg_loss_sum": (loss_mat.detach() * mask).sum(),
             "clip_sum": pol["pg_clipfrac"] * nkept, "ppo_kl_sum": pol["ppo_kl"] * nkept, "tokens": ntok,
             "logprobs_detached": logp.detach(), **rc}
    if ref_logprobs is not None and grpo.kl_coef > 0:
        kl = ca.kl_penalty(logp, ref_logprobs, grpo.kl_loss_type, mask)
        loss_mat = loss_mat + grpo.kl_coef * kl
        stats["kl_sum"] = (kl.detach() * mask).sum()
    loss = ca.agg_loss(loss_mat, mask, grpo.loss_agg_mode, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
    return loss, stats


def update_metrics(sums: Dict[str, float], kl_term: bool) -> Dict[str, float]:
    """The update pass's ``actor/`` metrics from :func:`grpo_token_loss`'s stats summed over a batch
    (every micro-batch, epoch and data-parallel replica): ``actor/pg_loss`` (and ``actor/kl_loss`` with
    ``kl_term``) over every response token, the token mean the loss takes; ``actor/pg_clipfrac`` and
    ``actor/ppo_kl`` over the tokens a rollout correction keeps (``tokens - rc_rejected``), as verl's.
    Both denominators are at least 1 (a batch without response tokens reads 0)."""
    tok = max(sums["tokens"], 1.0)
    kept = max(sums["tokens"] - sums.get("rc_rejected", 0.0), 1.0)
    out = {"actor/pg_loss": sums["pg_loss_sum"] / tok, "actor/pg_clipfrac": sums["clip_sum"] / kept,
           "actor/ppo_kl": sums["ppo_kl_sum"] / kept}
    if kl_term:
        out["actor/kl_loss"] = sums["kl_sum"] / tok
    return out
