"""One schedule call of megatron-core with the iteration context the codec needs.

``PipelineRunner.run`` splits a packed batch into micro-batches, tells the
communicator the iteration ``step`` and each micro-batch's sample ids (so the
PRF masks of passes 5, 6 and 7 of DESIGN.md section 2 coincide), and calls
megatron-core's own ``forward_backward_pipelining_without_interleaving`` (or
``forward_backward_no_pipelining`` at PP=1) with the compressed communicator.

With a group size (``--shared-prefix``, issue 32 item 1) each micro-batch of ``mbs`` rows runs as
its ``mbs / G`` groups packed ``[prompt, r_1, ..., r_G]`` (``grpo/shared_prefix.py``): the stages
compute each prompt once, the boundary carries ``[L, mbs / G, d]`` tensors, and the loss function
sees the logits gathered back to the rows' ``[mbs, S, V]`` layout, so it is unchanged.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Dict, List, Tuple

import torch
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
)

from megatron_cegrpo.compression import BoundaryContext
from megatron_cegrpo.grpo.batch import RolloutBatch, microbatches
from megatron_cegrpo.grpo.shared_prefix import (pack_shared_prefix, packed_group_length, packed_microbatch,
                                                rows_from_packed)
from megatron_cegrpo.optim.mixed_precision import compute_precision

__all__ = ["PipelineRunner", "LossFn", "rope_at_positions"]

# loss_fn(micro_batch: dict, logits [mbs, S, V]) -> (loss 0-dim, num_tokens int tensor, dict)
LossFn = Callable[[Dict[str, torch.Tensor], torch.Tensor], tuple]


class PipelineRunner:
    """Runs forward(-only) or forward+backward passes of one pipeline stage.

    Args:
        communicator: a ``CompressedP2PCommunicator`` (ignored at PP=1).
        pg_collection: megatron ``ProcessGroupCollection`` (tp, cp, pp, embd, pos_embd, dp_cp).
        micro_batch_size: sequences per micro-batch.
        pp_size: pipeline size.
        shared_prefix_group: G > 0: run every pass in the shared-prefix layout of groups of G
            consecutive rows (``--shared-prefix``; G must divide ``micro_batch_size``); 0: off.
    """

    def __init__(self, communicator, pg_collection, micro_batch_size: int, pp_size: int,
                 shared_prefix_group: int = 0):
        self.comm = communicator
        self.pg_collection = pg_collection
        self.micro_batch_size = micro_batch_size
        self.pp_size = pp_size
        self.group = int(shared_prefix_group)
        if self.group and micro_batch_size % self.group:
            raise ValueError(f"shared prefix: the group size {self.group} does not divide the micro-batch size "
                             f"{micro_batch_size}")

    def plan(self, batch: RolloutBatch) -> Tuple[list, int, int, List[torch.Tensor]]:
        """What one pass over ``batch`` runs: (items, seq_length, micro_batch_size, boundary ids).

        Unshared: the row micro-batches, S, ``micro_batch_size`` and each micro-batch's
        ``sample_ids``. Shared prefix: ``(rows, packed)`` pairs (``packed_microbatch``), the packed
        length L, ``micro_batch_size / G`` sequences per micro-batch, and the ``sample_ids`` of each
        group's first row (the ids keying a codec's masks of the packed ``[L, mbs / G, d]`` tensors).
        """
        mbs = microbatches(batch, self.micro_batch_size)
        if not self.group:
            return mbs, int(batch["tokens"].shape[1]), self.micro_batch_size, [mb["sample_ids"] for mb in mbs]
        layout = pack_shared_prefix(batch["tokens"], batch["prompt_lengths"], batch["response_lengths"], self.group)
        m = self.micro_batch_size
        items = [(mb, packed_microbatch(layout, i * m, (i + 1) * m)) for i, mb in enumerate(mbs)]
        return items, layout.seq_length, m // self.group, [mb["sample_ids"][::self.group] for mb in mbs]

    def pass_shape(self, batch: RolloutBatch) -> Tuple[int, int]:
        """(sequences, positions per sequence) one pass over ``batch`` computes: ``(N, S)`` unshared,
        ``(N / G, L)`` with shared prefixes (every packed row has the batch's packed length L).
        What ``training/perf.py``'s FLOP count of the update pass multiplies."""
        n = int(batch["tokens"].shape[0])
        if not self.group:
            return n, int(batch["tokens"].shape[1])
        return n // self.group, packed_group_length(batch["prompt_lengths"], batch["response_lengths"], self.group)

    def prefetch(self, batch: RolloutBatch, *, step: int) -> int:
        """Queue the codec's work for every micro-batch of ``batch`` at iteration ``step``
        (``CompressedP2PCommunicator.prefetch``: a background thread, off the critical path).
        Call it as soon as the iteration's batch is known; ``run`` queues whatever was not.

        Returns:
            the number of crossings queued (0 at PP=1 or for a codec without precompute).
        """
        if self.pp_size == 1:
            return 0
        _, seq_length, _, ids = self.plan(batch)
        return self.comm.prefetch(step, ids, seq_length)

    @torch.no_grad()
    def boundary_prepass(self, model: torch.nn.Module, batch: RolloutBatch, *, step: int) -> int:
        """``pcaq/prepass=1`` (``compression/history.py``): on the first stage, a forward of every
        micro-batch of ``batch`` (no gradient, no communication, the pass's own layout and
        precision) whose boundary states the codec folds into the basis it will send with the
        step's first message. The first stage holds its inputs (the tokens); a later stage's
        inputs arrive message by message, so its boundary fits as without the prepass.

        Returns:
            the micro-batches observed: 0 at PP = 1, on later stages, for a codec without
            ``prepass``, or where the step's window already has its basis (then nothing runs).
        """
        codec = getattr(self.comm, "codec", None)
        if self.pp_size == 1 or self.comm.pp_rank != 0 or codec is None or not codec.wants_prepass:
            return 0
        items, _, _, ids = self.plan(batch)
        ctxs = [BoundaryContext(seed=self.comm.seed, boundary=0, step=int(step), sample_ids=sids) for sids in ids]
        if not codec.prepass_due(ctxs[0]):
            return 0  # the basis of this step's window is held (every = R: not its first step)
        with compute_precision(model):
            for item, ctx in zip(items, ctxs):
                if self.group:
                    out = packed_forward(model, item[1])
                else:
                    out = model(input_ids=item["tokens"], position_ids=item["position_ids"], attention_mask=None)
                codec.observe_prepass(out, ctx)
        return len(items)

    def run(self, model: torch.nn.Module, batch: RolloutBatch, *, step: int,
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
        items, seq_length, micro_batch_size, ids = self.plan(batch)
        group = self.group

        def forward_step(data_iterator, stage):
            if not group:
                mb = next(data_iterator)
                out = stage(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)
                return out, partial(loss_fn, mb)
            mb, pk = next(data_iterator)
            return packed_forward(stage, pk), partial(_rows_loss, loss_fn, mb, pk["logit_index"], group)

        common = dict(forward_step_func=forward_step, data_iterator=iter(items), model=[model],
                      num_microbatches=len(items), seq_length=seq_length,
                      micro_batch_size=micro_batch_size, forward_only=forward_only)
        with compute_precision(model):
            if self.pp_size == 1:
                return forward_backward_no_pipelining(**common)
            self.comm.begin_pass(step, ids, seq_length)
            out = forward_backward_pipelining_without_interleaving(
                **common, p2p_communicator=self.comm, pg_collection=self.pg_collection)
        self.comm.end_pass(forward_only)
        return out


def _rows_loss(loss_fn: LossFn, mb: Dict[str, torch.Tensor], logit_index: torch.Tensor, group: int,
               logits: torch.Tensor) -> tuple:
    """``loss_fn`` of the rows ``mb`` on the shared-prefix pass's packed logits [mbs / G, L, V]:
    gathered to [mbs, S, V] (``rows_from_packed``; the positions where ``logit_index`` is -1 hold
    the group's position-0 logits, outside every loss mask)."""
    return loss_fn(mb, rows_from_packed(logits, logit_index, group))


def packed_forward(stage: torch.nn.Module, packed: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``stage``'s forward over packed shared-prefix groups (``packed_microbatch``: ``tokens``,
    ``position_ids`` long [mbs / G, L], ``attention_mask`` bool [mbs / G, 1, L, L]), RoPE at each
    token's own position (:func:`rope_at_positions`). Returns what the stage returns: its output
    activations, or on the last stage the packed logits [mbs / G, L, V]."""
    with rope_at_positions(stage, packed["position_ids"]):
        return stage(input_ids=packed["tokens"], position_ids=packed["position_ids"],
                     attention_mask=packed["attention_mask"])


@contextlib.contextmanager
def rope_at_positions(stage: torch.nn.Module, position_ids: torch.Tensor):
    """While active, ``stage``'s rotary embedding is evaluated at ``position_ids`` per token.

    megatron-core 0.16.1's ``GPTModel._preprocess`` calls ``self.rotary_pos_emb(seq_len)``, which
    returns the table of positions ``0..seq_len-1`` as fp32 ``[s, 1, 1, dim]`` (one row per
    sequence position, shared by the batch); the attention's ``apply_rotary_pos_emb`` broadcasts it
    over ``[s, b, heads, dim]``. Here that call returns the same table read at each token's
    position, ``[s, b, 1, dim]`` (``table[position_ids.t()]``: the entries are the ones the model
    computes for those positions, bit for bit). The stage's own ``RotaryEmbedding`` is found among
    its modules (every stage applies RoPE, the first stage's embedding has none); a stage without
    one runs unchanged.

    Args:
        stage: a GPTModel stage (or a wrapper holding one).
        position_ids: long [b, s], each < the model's position limit.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    ropes = [m for m in stage.modules() if isinstance(m, RotaryEmbedding)]
    if not ropes:
        yield
        return
    rope = ropes[0]
    table = type(rope).forward(rope, int(position_ids.max()) + 1)  # [n, 1, 1, dim]
    emb = table[:, 0][position_ids.t()]  # [s, b, 1, dim]
    rope.forward = lambda *args, **kwargs: emb
    try:
        yield
    finally:
        del rope.forward
