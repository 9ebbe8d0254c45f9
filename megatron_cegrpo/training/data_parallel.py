"""Data parallelism inside a stage (issue 14): what the replicas of one stage exchange.

``DistContext.dp_group`` is megatron-core's data-parallel group of the stage (``parallel_state``
or the trainer ``HyperCommGrid``, ``initialize.py``); None at DP = 1, where every function here
is the single-replica computation itself (bit for bit what the trainer did before DP).

Each replica runs its share of every mini-batch (``grpo.batch.replica_rows``); the GRPO loss
of a micro-batch is its token sum divided by the *whole* mini-batch's token count
(``grpo/loss.py``, token-mean), so the replicas' gradients add up to the DP = 1 gradient and the
reduction is a SUM (:func:`allreduce_gradients`), not an average.

Why a plain ``torch.distributed.all_reduce`` over megatron's DP group rather than megatron-core's
``DistributedDataParallel`` or DeepSpeed's engine: megatron's DDP wraps the module and moves the
gradients into its own contiguous ``main_grad`` buffers, which only megatron's optimizer reads;
this trainer steps ``p.grad`` with DeepSpeed's Adam *optimizer* (not its engine, whose
``backward`` would own the pipeline schedule megatron-core runs), and the tied-embedding
exchange and the anchor's pre-step correction read and write ``p.grad`` directly. What DDP
would do after the backward pass, one bucketed all-reduce of the stage's gradients over the DP
group, is :func:`allreduce_gradients` (one flat buffer; no overlap with the backward pass).
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from megatron_cegrpo.grpo import core_algos as ca

__all__ = ["allreduce_gradients", "allreduce_sum", "masked_means", "ring_allreduce_bytes"]


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one member sends in a ring all-reduce of an ``nbytes`` buffer over ``n`` members:
    ``2 (n - 1) / n x nbytes`` (reduce-scatter then all-gather; Patarasuk and Yuan 2009),
    rounded down; 0 for one member."""
    return 2 * (n - 1) * nbytes // n if n > 1 else 0


@torch.no_grad()
def allreduce_gradients(params: Sequence[torch.nn.Parameter], group) -> int:
    """Sum every ``p.grad`` over the data-parallel ``group``, in place, as one flat buffer.

    Call after the backward pass and the tied-embedding exchange, before the optimizer's
    pre-step hooks (the anchor's sign blend and clipping see the whole mini-batch's gradient).
    Parameters without a gradient are skipped (the same ones on every replica: the first
    stage's tied-embedding row cache under ``--tied-embedding-sync sparse``).

    Args:
        params: the stage's trainable parameters, the same order on every replica.
        group: the stage's DP group, or None (DP = 1: nothing to do).
    Returns:
        bytes this rank sent (:func:`ring_allreduce_bytes` of the buffer; 0 without a group).
    """
    if group is None:
        return 0
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return ring_allreduce_bytes(flat.numel() * flat.element_size(), dist.get_world_size(group))


def allreduce_sum(values: List[float], group) -> List[float]:
    """``values`` summed over the DP ``group`` (fp64; unchanged without a group): token counts
    and loss sums, so that the logged means are over the whole batch."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def masked_means(values: Sequence[torch.Tensor], mask: torch.Tensor, group) -> List[float]:
    """``masked_mean(v, mask)`` of each tensor over the whole batch: every replica's token sums
    and token count added over the DP ``group`` (one fp64 all-reduce), then divided.

    Args:
        values: float tensors [N_local, S], each the shape of ``mask``.
        mask: float [N_local, S], 1 on counted (response) tokens.
        group: the DP group, or None: ``float(core_algos.masked_mean(v, mask))`` exactly.
    Returns:
        one float per tensor (0.0 when no token is counted anywhere).
    """
    if group is None:
        return [float(ca.masked_mean(v, mask)) for v in values]
    m = mask.to(torch.float64)
    t = torch.stack([(v.to(torch.float64) * m).sum() for v in values] + [m.sum()])
    dist.all_reduce(t, group=group)
    count = max(float(t[-1]), 1.0)
    return [float(x) / count for x in t[:-1]]
