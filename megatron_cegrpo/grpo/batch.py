"""Pack rollouts into the fixed-shape tensors the pipeline consumes, and split them.

Each sequence is prompt + response, right-padded to one length S per
iteration (megatron's non-interleaved schedule needs one [S, mbs, d] shape for
every micro-batch of a pass). Position j of ``labels`` is token j + 1, so the
logits at position j score ``labels[j]``; ``loss_mask[j]`` is 1 exactly where
``labels[j]`` is a response token.
"""

from __future__ import annotations

from typing import List, TypedDict

import torch

__all__ = ["RolloutBatch", "pack_rollouts", "slice_batch", "microbatches", "replica_rows"]


class RolloutBatch(TypedDict, total=False):
    """An iteration's batch: the one place its fields are written down (a plain dict at run time).

    N rows: the iteration's sequences (``--rollout-batch-size`` x ``--num-generations``), a data-parallel
    replica's share (``replica_rows``) or a micro-batch's slice; S columns: prompt + response,
    right-padded to a multiple of 8. Position j scores ``labels[j]`` = token j + 1.
    """

    # made by pack_rollouts (the driver), broadcast to every stage
    tokens: torch.Tensor            #: long [N, S], prompt + response + padding
    position_ids: torch.Tensor      #: long [N, S], 0..S-1 per row
    labels: torch.Tensor            #: long [N, S], tokens shifted left by one
    loss_mask: torch.Tensor         #: fp32 [N, S], 1 where labels[j] is a response token
    sampler_logprobs: torch.Tensor  #: fp32 [N, S], the dense sampler's log-probs (0 off the mask)
    advantages: torch.Tensor        #: fp32 [N, S], the group-normalised advantage on response positions
    scores: torch.Tensor            #: fp32 [N], the verifier's reward
    sample_ids: torch.Tensor        #: long [N], the global row index (keys the PRF masks; kept by replicas)
    response_lengths: torch.Tensor  #: long [N]
    prompt_lengths: torch.Tensor    #: long [N]
    # added by the driver (training/driver.py)
    finished: torch.Tensor          #: fp32 [N], 1 where the response ended with EOS
    # added by a stage's passes (training/stage.py)
    old_logprobs: torch.Tensor      #: fp32 [N, S], the compressed view's log-probs before the step
    ref_logprobs: torch.Tensor      #: fp32 [N, S], the frozen reference's (--kl-coef > 0)


def pack_rollouts(
    prompt_ids: List[torch.Tensor],
    response_ids: List[torch.Tensor],
    response_logprobs: List[torch.Tensor],
    scores: torch.Tensor,
    advantages: torch.Tensor,
    *,
    pad_token_id: int,
    pad_to_multiple: int = 8,
    max_seq_length: int | None = None,
) -> RolloutBatch:
    """Right-pad N prompt+response sequences into one batch (:class:`RolloutBatch`).

    Args:
        prompt_ids, response_ids: N LongTensors [P_i] and [R_i] (R_i >= 1).
        response_logprobs: N fp32 [R_i], the sampler's log-probs of the response tokens.
        scores, advantages: fp32 [N], one per sequence.
        pad_token_id: filler for positions past each sequence.
        pad_to_multiple: S is rounded up to a multiple of this.
        max_seq_length: the model's position limit; ValueError if S would exceed it.
    Returns:
        dict with ``tokens`` long [N, S], ``position_ids`` long [N, S],
        ``labels`` long [N, S], ``loss_mask`` fp32 [N, S],
        ``sampler_logprobs`` fp32 [N, S] (0 off the mask), ``advantages`` fp32 [N, S]
        (the sequence advantage on its response positions, 0 elsewhere),
        ``scores`` fp32 [N], ``sample_ids`` long [N] (0..N-1),
        ``response_lengths`` long [N], ``prompt_lengths`` long [N].
    """
    n = len(prompt_ids)
    if not (len(response_ids) == len(response_logprobs) == n == scores.numel() == advantages.numel()):
        raise ValueError("pack_rollouts: prompt/response/logprob/score/advantage counts differ")
    lengths = [int(p.numel() + r.numel()) for p, r in zip(prompt_ids, response_ids)]
    s = max(lengths)
    s = -(-s // pad_to_multiple) * pad_to_multiple
    if max_seq_length is not None and s > max_seq_length:
        if max(lengths) > max_seq_length:
            raise ValueError(
                f"a prompt+response of {max(lengths)} tokens exceeds the model's {max_seq_length} "
                "positions; lower --max-prompt-length or --max-new-tokens"
            )
        s = max_seq_length
    tokens = torch.full((n, s), int(pad_token_id), dtype=torch.long)
    labels = torch.full((n, s), int(pad_token_id), dtype=torch.long)
    loss_mask = torch.zeros((n, s), dtype=torch.float32)
    sampler_lp = torch.zeros((n, s), dtype=torch.float32)
    adv = torch.zeros((n, s), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompt_ids, response_ids, response_logprobs)):
        if r.numel() < 1:
            raise ValueError(f"sequence {i} has an empty response")
        seq = torch.cat([p.long(), r.long()])
        tokens[i, : seq.numel()] = seq
        labels[i, : seq.numel() - 1] = seq[1:]
        lo, hi = p.numel() - 1, p.numel() - 1 + r.numel()
        loss_mask[i, lo:hi] = 1.0
        sampler_lp[i, lo:hi] = lp.float()
        adv[i, lo:hi] = float(advantages[i])
    return {
        "tokens": tokens,
        "position_ids": torch.arange(s, dtype=torch.long).unsqueeze(0).expand(n, s).contiguous(),
        "labels": labels,
        "loss_mask": loss_mask,
        "sampler_logprobs": sampler_lp,
        "advantages": adv,
        "scores": scores.float().clone(),
        "sample_ids": torch.arange(n, dtype=torch.long),
        "response_lengths": torch.tensor([int(r.numel()) for r in response_ids], dtype=torch.long),
        "prompt_lengths": torch.tensor([int(p.numel()) for p in prompt_ids], dtype=torch.long),
    }


def slice_batch(batch: RolloutBatch, start: int, end: int) -> RolloutBatch:
    """Rows [start, end) of every per-sequence tensor in ``batch``."""
    return {k: v[start:end] for k, v in batch.items()}


def microbatches(batch: RolloutBatch, micro_batch_size: int) -> List[RolloutBatch]:
    """Split a batch of N rows into N / micro_batch_size consecutive micro-batches.

    Raises:
        ValueError: if micro_batch_size does not divide N.
    """
    n = batch["tokens"].shape[0]
    if n % micro_batch_size:
        raise ValueError(f"--micro-batch-size={micro_batch_size} does not divide the {n} sequences")
    return [slice_batch(batch, i, i + micro_batch_size) for i in range(0, n, micro_batch_size)]


def replica_rows(num_rows: int, mini_batch_size: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """The rows of an iteration's batch that data-parallel replica ``dp_rank`` of ``dp_size`` runs
    (issue 14): of every mini-batch (``mini_batch_size`` = ``--global-batch-size`` consecutive
    rows, one optimizer step) the ``dp_rank``-th contiguous slice of ``mini_batch_size / dp_size``
    rows, mini-batches in order. Replica ``r``'s own mini-batches are then consecutive slices of
    ``mini_batch_size / dp_size`` rows of its share, and the DP-summed gradient of each is the
    whole mini-batch's. The rows keep their ``sample_ids``, so the PRF masks (keyed by the global
    sample id) do not depend on the replica that runs a sample.

    Returns:
        int64 [num_rows / dp_size] row indices, ascending.
    Raises:
        ValueError: ``mini_batch_size`` does not divide ``num_rows`` or ``dp_size`` does not
            divide ``mini_batch_size`` (``TrainConfig.validate`` refuses both at start-up).
    """
    if num_rows % mini_batch_size or mini_batch_size % dp_size:
        raise ValueError(f"{num_rows} rows in mini-batches of {mini_batch_size} cannot be shared by "
                         f"{dp_size} replicas")
    share = mini_batch_size // dp_size
    return torch.cat([torch.arange(s + dp_rank * share, s + (dp_rank + 1) * share)
                      for s in range(0, num_rows, mini_batch_size)])
