"""The batches and the GRPO loss of the shared-prefix tests (test_shared_prefix_pp1.py, the PP = 2
worker shared_prefix_worker.py): ragged prompts and responses, G responses per prompt."""

from types import SimpleNamespace

import torch

#: clip-higher PPO with a k3 KL term: every branch of the loss has gradients
GRPO = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, kl_coef=0.05, kl_loss_type="k3",
                       loss_agg_mode="token-mean")
TEMPERATURE = 0.9


def make_batch(vocab: int, group: int, groups: int, seed: int, prompt_len=(2, 10), response_len=(1, 8)):
    """``pack_rollouts`` of ``groups`` prompts (``prompt_len`` = [low, high) tokens) with ``group``
    responses (``response_len`` tokens) each, random advantages; :func:`add_policies` adds
    ``old_logprobs`` / ``ref_logprobs``."""
    from megatron_cegrpo.grpo.batch import pack_rollouts

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = torch.randint(0, vocab, (int(torch.randint(*prompt_len, (1,), generator=g)),), generator=g)
        for _ in range(group):
            prompts.append(p)
            responses.append(torch.randint(0, vocab, (int(torch.randint(*response_len, (1,), generator=g)),), generator=g))
    n = len(prompts)
    batch = pack_rollouts(prompts, responses, [torch.zeros(len(r)) for r in responses], torch.zeros(n),
                          torch.randn(n, generator=g), pad_token_id=0)
    batch["sample_ids"] = batch["sample_ids"] + 100
    return batch


def add_policies(batch, logprobs: torch.Tensor, seed: int) -> None:
    """``old_logprobs`` and ``ref_logprobs`` [N, S]: ``logprobs`` (this model's) shifted by noise of
    0.3 nats, so some ratios clip and the KL term is not 0."""
    g = torch.Generator().manual_seed(seed)
    batch["old_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    batch["ref_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)


def loss_fn(num_tokens: float, num_seqs: float, mb, logits):
    """The trainer's update loss (``grpo_token_loss``) and this pass's log-probs."""
    from megatron_cegrpo.grpo.loss import grpo_token_loss

    loss, stats = grpo_token_loss(logits, mb, GRPO, temperature=TEMPERATURE, num_tokens=num_tokens,
                                  num_seqs=num_seqs, old_logprobs=mb.get("old_logprobs"),
                                  ref_logprobs=mb.get("ref_logprobs"))
    return loss, stats["tokens"].to(torch.int), {"loss": loss.detach().clone(), "logprobs": stats["logprobs_detached"]}


def logprob_fn(mb, logits):
    """A forward-only pass's log-probs (the old-logprob and reference passes)."""
    from megatron_cegrpo.grpo.core_algos import logprobs_from_logits

    return torch.zeros(()), torch.tensor(0, dtype=torch.int), {
        "logprobs": logprobs_from_logits(logits.float() / TEMPERATURE, mb["labels"])}


def scored(batch) -> torch.Tensor:
    """bool [N, S]: the positions whose logits score a token of the row (j < P + R - 1), where the
    shared-prefix log-probs are defined."""
    j = torch.arange(batch["tokens"].shape[1]).unsqueeze(0)
    return j < (batch["prompt_lengths"] + batch["response_lengths"] - 1).unsqueeze(1)
