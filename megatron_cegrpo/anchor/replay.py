"""The anchor's dense replay: one forward + backward of the GRPO objective over a rollout batch at
PP = 1, micro-batch by micro-batch, its gradients accumulated in the replica's ``.grad``
(``G_anc`` of the seeds' anchor circuit, ``../shared/seeds``; ``worker.AnchorWorker`` sets the
weights, the precision and reads the gradients).

With ``shared_prefix_group = G`` (``--shared-prefix``, issue 32 item 1) each micro-batch's groups
run as ``[prompt, r_1, ..., r_G]`` (``grpo/shared_prefix.py``): the prompt is computed once per
group, and the loss sees the unshared ``[mbs, S, V]`` logits gathered from the packed ones, the
same path the stages' ``pipeline/schedule.py`` takes. Equal to the unshared replay within fp32
reduction order (``tests/pipeline/test_shared_prefix_anchor_replay.py``; the tolerance is
test_shared_prefix_pp1.py's).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.batch import microbatches
from megatron_cegrpo.grpo.loss import grpo_token_loss
from megatron_cegrpo.grpo.shared_prefix import pack_shared_prefix, packed_microbatch, rows_from_packed
from megatron_cegrpo.pipeline.schedule import packed_forward

__all__ = ["SHARED_PREFIX_KEYS", "replay_backward"]

#: the batch keys the shared-prefix layout needs beyond ``client.ANCHOR_BATCH_KEYS`` (long [N] each)
SHARED_PREFIX_KEYS = ("prompt_lengths", "response_lengths")


def _forward(model: torch.nn.Module, mb: dict, packed: Optional[dict], group: int) -> torch.Tensor:
    """Logits [mbs, S, V] of the rows ``mb``, unshared or gathered from the packed groups."""
    if packed is None:
        return model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)
    return rows_from_packed(packed_forward(model, packed), packed["logit_index"], group)


def replay_backward(model: torch.nn.Module, ref_model: Optional[torch.nn.Module], batch: dict, *,
                    micro_batch_size: int, grpo, temperature: float, shared_prefix_group: int = 0) -> None:
    """Accumulate the GRPO objective's gradient over ``batch`` into ``model``'s ``.grad``.

    The loss is ``grpo_token_loss`` with the ratio against the replica's own detached log-probs
    (the clipped term's gradient is ``-A grad log pi``), the KL term to ``ref_model`` when given,
    aggregated over the whole batch by ``grpo.loss_agg_mode`` (``num_tokens`` = the batch's
    ``loss_mask`` sum, ``num_seqs`` its rows).

    Args:
        model: the PP = 1 policy replica (a GPTModel), in whatever compute precision the caller set.
        ref_model: the frozen reference (PP = 1) or None (no KL term).
        batch: rows of ``pack_rollouts``: ``tokens``, ``position_ids``, ``labels``, ``loss_mask``
            [N, S], ``advantages`` [N]; with a shared prefix also ``prompt_lengths`` and
            ``response_lengths`` long [N], the G rows of a group consecutive.
        micro_batch_size: rows per forward + backward; a multiple of G with a shared prefix.
        grpo: the GRPO settings (``cfg.grpo``: clip ratios, KL coefficient and type, aggregation).
        temperature: the sampler's temperature (logits are divided by it).
        shared_prefix_group: G > 0 computes each group's prompt once; 0 runs the rows as they are.
    Raises:
        ValueError: a shared prefix whose G does not divide ``micro_batch_size``, or whose groups do
            not share their prompt (``pack_shared_prefix``).
    """
    group = int(shared_prefix_group)
    mbs = microbatches(batch, micro_batch_size)
    packed = [None] * len(mbs)
    if group:
        if micro_batch_size % group:
            raise ValueError(f"anchor replay: the group size {group} does not divide the micro-batch size "
                             f"{micro_batch_size}")
        layout = pack_shared_prefix(batch["tokens"], batch["prompt_lengths"], batch["response_lengths"], group)
        packed = [packed_microbatch(layout, i * micro_batch_size, (i + 1) * micro_batch_size)
                  for i in range(len(mbs))]
    num_tokens = float(batch["loss_mask"].sum())
    num_seqs = float(batch["tokens"].shape[0])
    for mb, pk in zip(mbs, packed):
        ref_lp = None
        if ref_model is not None:
            with torch.no_grad():
                ref_logits = _forward(ref_model, mb, pk, group)
                ref_lp = ca.logprobs_from_logits(ref_logits.float() / temperature, mb["labels"])
        logits = _forward(model, mb, pk, group)
        loss, _ = grpo_token_loss(logits, mb, grpo, temperature=temperature, num_tokens=num_tokens,
                                  num_seqs=num_seqs, ref_logprobs=ref_lp)
        loss.backward()
