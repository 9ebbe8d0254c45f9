"""One schedule call of megatron-core with the iteration context the codec needs.

``PipelineRunner.run`` splits a packed batch into micro-batches, tells the
communicator the iteration ``step`` and each micro-batch's sample ids (so the
PRF masks of passes 5, 6 and 7 of DESIGN.md section 2 coincide), and calls
megatron-core's own ``forward_backward_pipelining_without_interleaving`` (or
``forward_backward_no_pipelining`` at PP=1) with the compressed communicator.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional

import torch
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
)

from megatron_cegrpo.grpo.batch import microbatches
from megatron_cegrpo.optim.mixed_precision import compute_precision

__all__ = ["PipelineRunner", "LossFn"]

# loss_fn(micro_batch: dict, logits [mbs, S, V]) -> (loss 0-dim, num_tokens int tensor, dict)
LossFn = Callable[[Dict[str, torch.Tensor], torch.Tensor], tuple]


class PipelineRunner:
    """Runs forward(-only) or forward+backward passes of one pipeline stage.

    Args:
        communicator: a ``CompressedP2PCommunicator`` (ignored at PP=1).
        pg_collection: megatron ``ProcessGroupCollection`` (tp, cp, pp, embd, pos_embd, dp_cp).
        micro_batch_size: sequences per micro-batch.
        pp_size: pipeline size.
    """

    def __init__(self, communicator, pg_collection, micro_batch_size: int, pp_size: int):
        self.comm = communicator
        self.pg_collection = pg_collection
        self.micro_batch_size = micro_batch_size
        self.pp_size = pp_size

    def prefetch(self, batch: Dict[str, torch.Tensor], *, step: int) -> int:
        """Queue the codec's work for every micro-batch of ``batch`` at iteration ``step``
        (``CompressedP2PCommunicator.prefetch``: a background thread, off the critical path).
        Call it as soon as the iteration's batch is known; ``run`` queues whatever was not.

        Returns:
            the number of crossings queued (0 at PP=1 or for a codec without precompute).
        """
        if self.pp_size == 1:
            return 0
        mbs = microbatches(batch, self.micro_batch_size)
        return self.comm.prefetch(step, [mb["sample_ids"] for mb in mbs], int(batch["tokens"].shape[1]))

    def run(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor], *, step: int,
            forward_only: bool, loss_fn: LossFn) -> List[dict]:
        """One schedule call over every row of ``batch``.

        Args:
            model: this rank's GPTModel stage (or its frozen reference copy).
            batch: packed rows (``grpo.batch.pack_rollouts`` keys, plus whatever
                ``loss_fn`` reads, e.g. ``old_logprobs``), N divisible by the micro-batch size.
            step: iteration t keying the boundary masks.
            forward_only: no backward (old-logprob / reference passes).
            loss_fn: evaluated on the last stage per micro-batch.
        Under ``--bf16`` the pass runs on the model's bf16 compute view and its gradients arrive
        in fp32 (``optim.mixed_precision.compute_precision``).
        Returns:
            on the last stage, the list of ``loss_fn`` dicts (one per micro-batch, in order);
            an empty list elsewhere.
        """
        mbs = microbatches(batch, self.micro_batch_size)
        seq_length = int(batch["tokens"].shape[1])

        def forward_step(data_iterator, stage):
            mb = next(data_iterator)
            out = stage(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)
            return out, partial(loss_fn, mb)

        common = dict(forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                      num_microbatches=len(mbs), seq_length=seq_length,
                      micro_batch_size=self.micro_batch_size, forward_only=forward_only)
        with compute_precision(model):
            if self.pp_size == 1:
                return forward_backward_no_pipelining(**common)
            self.comm.begin_pass(step, [mb["sample_ids"] for mb in mbs], seq_length)
            out = forward_backward_pipelining_without_interleaving(
                **common, p2p_communicator=self.comm, pg_collection=self.pg_collection)
        self.comm.end_pass(forward_only)
        return out
