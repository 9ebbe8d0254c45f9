"""GRPO's pure functions: advantages, log-probs, entropy, KL, clipped policy loss.

No state, no torch.distributed: every function maps tensors to tensors. Names
and conventions follow verl's ``trainer/ppo/core_algos.py`` so that metrics
read the same way (``pg_clipfrac``, ``ppo_kl``, ``kl_loss``, ``low_var_kl``).

Shapes use ``b`` = sequences, ``s`` = positions (the response/label axis),
``V`` = vocabulary. All log-probabilities are natural log (nats).

Sources:
- GRPO group-normalised advantage: Shao et al. 2024, "DeepSeekMath", eq. (3)
  (outcome supervision); the "no std" variant is Liu et al. 2025, "Understanding
  R1-Zero-Like Training" (Dr. GRPO). DESIGN.md section 2, step 3.
- Clipped ratio with asymmetric bounds (eps_low, eps_high): Schulman et al.
  2017 (PPO) eq. (7); Yu et al. 2025 (DAPO) "clip-higher".
- k3 KL estimator: J. Schulman, "Approximating KL Divergence" (2020); verl's
  ``low_var_kl`` clamps it to [-10, 10].
- Soft overlong punishment: Yu et al. 2025 (DAPO, arXiv 2503.14476) eq. (13); verl's
  ``DAPORewardManager`` (``reward_model.overlong_buffer``).
- Log-ratio bound before ``exp``: verl ``trainer/ppo/core_algos.py``
  (``compute_policy_loss_vanilla`` and ``kl_penalty`` "low_var_kl", commit 012be9d)
  clamps the log-ratio to [-20, 20] "for numerical stability" (:data:`LOG_RATIO_CLAMP`).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

__all__ = [
    "TIE_RTOL_EPS",
    "LOG_RATIO_CLAMP",
    "bounded_log_ratio",
    "compute_grpo_outcome_advantage",
    "overlong_penalty",
    "tied_groups",
    "logprobs_from_logits",
    "entropy_from_logits",
    "kl_penalty",
    "register_kl_penalty",
    "available_kl_penalties",
    "compute_policy_loss",
    "agg_loss",
    "masked_mean",
    "register_loss_agg_mode",
    "available_loss_agg_modes",
]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1. Shapes broadcast; returns a 0-dim tensor.

    Returns 0 (not NaN) when the mask is empty.
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


#: A group whose scores span at most this many units of the computing dtype's
#: epsilon, relative to their magnitude, counts as tied (advantage exactly 0).
TIE_RTOL_EPS = 4


def _check_groups(scores: torch.Tensor, group_size: int) -> None:
    """``scores`` 1-D and split into whole groups of ``group_size`` >= 1; else ValueError."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(
            f"scores must be 1-D with a length divisible by group_size={group_size}; "
            f"got shape {tuple(scores.shape)}"
        )


def compute_grpo_outcome_advantage(
    scores: torch.Tensor,
    group_size: int,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised outcome advantages.

    A_i = (r_i - mean_group(r)) / (std_group(r) + epsilon) (Shao et al. 2024,
    DeepSeekMath eq. (3)), or without the division when ``norm_adv_by_std``
    is False (Liu et al. 2025, Dr. GRPO). ``std`` is the unbiased sample
    standard deviation (torch.std default), as in verl.

    Tied groups get exactly 0 for every member, with or without the std
    division. A group is tied when ``max - min <= TIE_RTOL_EPS * eps *
    max(|max|, |min|)`` (``eps`` of the computing dtype, 1.19e-7 for fp32):
    the scores are equal, or differ only by a few ulps, the size of the
    rounding of the reward itself. The formula cannot resolve such groups:
    the rounded mean of equal non-dyadic values (8 x 0.35) is not the value,
    its fp32 std is ~3e-8 rather than 0, and the division amplifies that
    rounding into advantages of ~0.03 (0.35) or ~0.8 (7 x 100.3). Every other
    group gets the formula's value bit for bit as before this rule.

    Computation runs in the scores' dtype for fp32/fp64, in fp32 for
    bf16/fp16 (then cast back), and in fp32 for integer or bool scores.

    Args:
        scores: tensor [b] with b = num_prompts * group_size, grouped
            contiguously (responses of prompt j are rows j*G .. j*G+G-1).
            Every value must be finite.
        group_size: G >= 1 (G = 1 gives advantage 0).
    Returns:
        tensor [b], same dtype as ``scores`` for floating scores, fp32 otherwise.
    Raises:
        ValueError: group_size < 1; b not a multiple of ``group_size``; a
            NaN or +-inf score (names the first bad row and its group).
    """
    _check_groups(scores, group_size)
    finite = torch.isfinite(scores)
    if not bool(finite.all()):
        i = int((~finite).nonzero()[0, 0])
        raise ValueError(
            f"scores[{i}] = {scores[i].item()} is not finite (group {i // group_size}); "
            "rewards must be finite numbers: fix the reward function "
            "(megatron_cegrpo.rewards.score_responses rejects such values with the row named)"
        )
    out_dtype = scores.dtype if scores.is_floating_point() else torch.float32
    if scores.numel() == 0:
        return scores.to(out_dtype)
    work = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    grouped = work.reshape(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = grouped - mean
    if norm_adv_by_std:
        if group_size == 1:
            std = torch.ones_like(mean)
        else:
            std = grouped.std(dim=1, keepdim=True)
        centred = centred / (std + epsilon)
    centred = centred.masked_fill(_tied_rows(grouped), 0.0)
    return centred.reshape(-1).to(out_dtype)


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, the reward added to each response for its length.

    With L_max = ``max_new_tokens`` and L_cache = ``buffer_len``: 0 for |y| <= L_max - L_cache,
    ((L_max - L_cache) - |y|) / L_cache x ``penalty_factor`` above it, so -``penalty_factor`` for a
    response cut at L_max (Yu et al. 2025, DAPO, eq. (13); verl ``DAPORewardManager``, whose
    lengths, like these, count the EOS token). Responses never exceed L_max here (the sampler
    stops there), so eq. (13)'s -1 beyond L_max does not arise.

    Args:
        response_lengths: int or float tensor [b], tokens of each response (EOS included).
        max_new_tokens: L_max >= 1, the sampler's limit (``--max-new-tokens``).
        buffer_len: L_cache, 1 <= buffer_len <= max_new_tokens (``--overlong-buffer-len``; verl
            allows L_cache = L_max too: then every token is penalised).
        penalty_factor: >= 0, the reward lost at L_max (``--overlong-penalty-factor``).
    Returns:
        fp32 tensor [b] of values in [-penalty_factor, 0].
    Raises:
        ValueError: for a buffer outside [1, max_new_tokens] or a negative factor.
    """
    if not 1 <= buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in [1, max_new_tokens={max_new_tokens}], got {buffer_len}")
    if not penalty_factor >= 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    exceed = response_lengths.to(torch.float32) - float(max_new_tokens - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def _tied_rows(grouped: torch.Tensor) -> torch.Tensor:
    """bool [groups, 1]: the rows of ``grouped`` [groups, G] (fp32 or fp64) that are tied, i.e.
    span at most ``TIE_RTOL_EPS`` units of the dtype's epsilon relative to their magnitude."""
    hi = grouped.amax(dim=1, keepdim=True)
    lo = grouped.amin(dim=1, keepdim=True)
    tol = TIE_RTOL_EPS * torch.finfo(grouped.dtype).eps
    return (hi - lo) <= tol * torch.maximum(hi.abs(), lo.abs())


def tied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [b / group_size]: True for each group whose scores are tied, the groups to which
    :func:`compute_grpo_outcome_advantage` gives advantage 0 (the same rule, with or without
    the std division). DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl's
    ``filter_groups``, std > 0) keeps the others, here ``grpo/dynamic_sampling.py``.

    Args:
        scores: tensor [b], grouped contiguously as for the advantage; finite values.
        group_size: G >= 1 (every group of one is tied).
    Raises:
        ValueError: group_size < 1 or b not a multiple of it.
    """
    _check_groups(scores, group_size)
    work = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    return _tied_rows(work.reshape(-1, group_size)).reshape(-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position.

    Args:
        logits: float [..., V] (any float dtype; computed in fp32).
        labels: long [...] with values in [0, V).
    Returns:
        fp32 [...] log-probabilities in nats.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, in nats: -sum_v p_v log p_v.

    Args:
        logits: float [..., V].
    Returns:
        fp32 [...].
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


#: Bound on |log-ratio| before ``exp`` (verl ``trainer/ppo/core_algos.py``: the policy loss and
#: the k3 KL clamp it to [-20, 20]). exp(20) = 4.85e8 is finite in fp32, whose ``exp`` overflows
#: past 88.72: without the bound a log-ratio of 94 makes the ratio inf and ``0 * inf`` a NaN loss
#: or gradient, even at a masked position.
LOG_RATIO_CLAMP = 20.0


def bounded_log_ratio(
    logprob: torch.Tensor, other_logprob: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``logprob - other_logprob`` clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] (verl's
    ``torch.clamp(log_ratio, min=-20.0, max=20.0)``), and exactly 0 where ``mask`` is 0.

    The value to pass to ``exp``: finite, with a finite gradient, for any finite inputs. Inside
    the bound, at mask 1, value and gradient are those of the plain difference bit for bit
    (clamp and ``where`` pass them through unchanged); outside it the gradient is 0.

    Args:
        logprob, other_logprob: float [b, s] log-probabilities (nats).
        mask: [b, s] (float {0,1} or bool), 1 on response tokens; None: no position is masked.
    Returns:
        [b, s], the dtype of ``logprob - other_logprob``.
    """
    log_ratio = torch.clamp(logprob - other_logprob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    return log_ratio


_KL_PENALTIES: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_kl_penalty(*names: str):
    """Register a per-token KL estimator ``fn(logprob, ref_logprob) -> [b, s]`` under
    ``names`` (decorator; the first name is the canonical one, the rest are aliases).
    ``--kl-loss-type`` accepts every registered name."""

    def deco(fn):
        for name in names:
            _KL_PENALTIES[name] = fn
        return fn

    return deco


def available_kl_penalties():
    """Every name ``kl_penalty`` (and ``--kl-loss-type``) accepts, sorted."""
    return sorted(_KL_PENALTIES)


@register_kl_penalty("low_var_kl", "k3")
def _kl_low_var(logprob, ref_logprob):
    log_ratio = bounded_log_ratio(ref_logprob, logprob)
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(kl, min=-10.0, max=10.0)


@register_kl_penalty("kl", "k1")
def _kl_k1(logprob, ref_logprob):
    return logprob - ref_logprob


@register_kl_penalty("abs")
def _kl_abs(logprob, ref_logprob):
    return (logprob - ref_logprob).abs()


@register_kl_penalty("mse", "k2")
def _kl_mse(logprob, ref_logprob):
    return 0.5 * (logprob - ref_logprob).square()


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kind: str = "low_var_kl",
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from log-probs of sampled tokens.

    ``low_var_kl`` (k3, default): exp(r) - r - 1 with r = ref - logp clamped to
    [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp``, the result clamped to
    [-10, 10], both as verl does (its ``kl_penalty``); non-negative and unbiased
    for KL(pi||pi_ref) when tokens are drawn from pi. The log-ratio bound changes
    no value (past |r| = 20 the result is 10 either way) and no finite gradient
    (0 there either way); it turns ``0 * inf`` = NaN gradients at r > 88.7 into 0.
    ``kl`` (k1): logp - ref. ``abs``: |logp - ref|. ``mse`` (k2): 0.5 (logp - ref)^2.
    More with :func:`register_kl_penalty`.

    Args:
        logprob, ref_logprob: fp32 [b, s].
        mask: [b, s] {0,1}, 1 on response tokens, or None. Both log-probs are set
            to 0 where it is 0 before the estimator runs (log-ratio 0: every built-in
            estimator gives 0 there, with gradient 0), so a masked position's values,
            however extreme, cannot reach the result or the gradient.
    Returns:
        fp32 [b, s].
    Raises:
        ValueError: unknown ``kind`` (lists the valid ones).
    """
    try:
        fn = _KL_PENALTIES[kind]
    except KeyError:
        raise ValueError(
            f"unknown kl_penalty kind {kind!r}; valid: {', '.join(available_kl_penalties())}"
        ) from None
    if mask is not None:
        keep = mask.bool()
        logprob = torch.where(keep, logprob, torch.zeros_like(logprob))
        ref_logprob = torch.where(keep, ref_logprob, torch.zeros_like(ref_logprob))
    return fn(logprob, ref_logprob)


def compute_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> Dict[str, torch.Tensor]:
    """PPO/GRPO clipped-ratio surrogate per token.

    ratio = exp(clamp(logprob - old_logprob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), with the
    log-ratio set to 0 (ratio 1) where ``response_mask`` is 0 (:func:`bounded_log_ratio`;
    the clamp is verl's ``compute_policy_loss_vanilla``);
    pg_losses = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)).
    Finite, with finite gradients, for any finite inputs; bit for bit the unbounded
    formula at response tokens whose |log-ratio| <= 20.

    Args:
        old_logprob, logprob: fp32 [b, s] (old is detached by the caller).
        advantages: fp32 [b, s] (a sequence's advantage broadcast over its tokens).
        response_mask: {0,1} [b, s]; 1 on response tokens.
    Returns:
        dict with ``pg_losses`` [b, s] (unreduced, differentiable),
        ``pg_clipfrac`` (0-dim: fraction of response tokens where the clipped
        branch was taken), ``ppo_kl`` (0-dim: masked mean of old - new, each
        clamped to [-20, 20] as in verl).
    """
    negative_approx_kl = bounded_log_ratio(logprob, old_logprob, response_mask)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipped = torch.gt(pg_losses2, pg_losses1).float()
    return {
        "pg_losses": pg_losses,
        "pg_clipfrac": masked_mean(clipped, response_mask).detach(),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }


_AGG_MODES: Dict[str, Callable[..., torch.Tensor]] = {}


def register_loss_agg_mode(name: str):
    """Register a loss aggregation mode under ``name`` (decorator)."""

    def deco(fn):
        _AGG_MODES[name] = fn
        return fn

    return deco


def available_loss_agg_modes():
    """Every name ``agg_loss`` (and ``--loss-agg-mode``) accepts, sorted."""
    return sorted(_AGG_MODES)


@register_loss_agg_mode("token-mean")
def _token_mean(loss_mat, mask, global_num_tokens=None, global_num_seqs=None):
    denom = mask.sum() if global_num_tokens is None else global_num_tokens
    return (loss_mat * mask).sum() / max(float(denom), 1.0)


@register_loss_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, global_num_tokens=None, global_num_seqs=None):
    seq = (loss_mat * mask).sum(dim=-1)
    denom = seq.numel() if global_num_seqs is None else global_num_seqs
    return seq.sum() / max(float(denom), 1.0)


@register_loss_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, global_num_tokens=None, global_num_seqs=None):
    seq = (loss_mat * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    denom = seq.numel() if global_num_seqs is None else global_num_seqs
    return seq.sum() / max(float(denom), 1.0)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [b, s] to a scalar.

    ``token-mean`` (default, DAPO): sum over all response tokens / number of
    response tokens. When a mini-batch is split into micro-batches, pass the
    mini-batch's ``global_num_tokens`` (or ``global_num_seqs`` for the seq-*
    modes) so that summing the micro-batch results gives exactly the
    mini-batch aggregate.

    Raises:
        ValueError: unknown mode (lists the valid ones).
    """
    try:
        fn = _AGG_MODES[loss_agg_mode]
    except KeyError:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {available_loss_agg_modes()}"
        ) from None
    return fn(
        loss_mat,
        loss_mask.to(loss_mat.dtype),
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )
