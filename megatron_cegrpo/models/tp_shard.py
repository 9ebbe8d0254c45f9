"""Tensor-parallel shards of a megatron stage state dict, and back (issue 14, "Tensor parallel").

A full stage state dict (``name_map.hf_to_megatron``: megatron names, the whole tensors) is
split into ``tp_size`` shards, one per TP rank, exactly as megatron-core 0.16.1's
tensor-parallel layers hold them (``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``, no sequence parallelism):

==============================================  =========================  ====================
parameter (stage-local name)                    megatron layer             shard of rank r
==============================================  =========================  ====================
embedding.word_embeddings.weight [V, h]         VocabParallelEmbedding     rows r*V/tp ..
output_layer.weight [V, h]                      ColumnParallelLinear       rows r*V/tp ..
decoder.layers.i.self_attention.linear_qkv.*    ColumnParallelLinear       query groups r*G/tp ..
  (grouped ``[q_g | k_g | v_g]`` rows, name_map)                           (dim 0 chunk r)
decoder.layers.i.self_attention.linear_proj.w   RowParallelLinear          columns (dim 1 chunk r)
decoder.layers.i.mlp.linear_fc1.weight          ColumnParallelLinear, GLU  ``cat[gate_r, up_r]``
  (``cat[gate, up]`` [2 ffn, h])                                           (each half's chunk r)
decoder.layers.i.mlp.linear_fc2.weight          RowParallelLinear          columns (dim 1 chunk r)
*layernorm.weight, decoder.final_layernorm.w    replicated                 the whole tensor
==============================================  =========================  ====================

The GLU row: megatron's ``MLP`` applies ``chunk(2, dim=-1)`` to each rank's own fc1 output, so a
rank's fc1 shard is its slice of the gate rows followed by its slice of the up rows (Megatron-LM's
``tools/checkpoint`` splits ``linear_fc1`` the same way). The grouped qkv layout keeps whole query
groups together, so a plain dim-0 chunk gives rank r the groups ``r*G/tp .. (r+1)*G/tp - 1`` with
their q heads (``check_tensor_parallel`` guarantees G and the head count divide).

:func:`partition_dim` is the one table; tests check it against the ``partition_dim`` attribute
megatron sets on each tensor-parallel parameter of a built TP stage.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_cegrpo.models.name_map import is_ignored_key

__all__ = ["partition_dim", "shard_tensor", "shard_stage_state_dict", "merge_tp_shards", "gather_tp_stage_state_dict",
           "is_tp_split", "TPGatheredStage"]

#: stage-local parameter name suffix -> the dimension megatron splits over the TP ranks
_SPLIT = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
_GLU = "mlp.linear_fc1.weight"


def _suffix(name: str) -> str:
    for suffix in _SPLIT:
        if name == suffix or name.endswith("." + suffix):
            return suffix
    return ""


def partition_dim(name: str) -> Optional[int]:
    """The dimension megatron-core splits parameter ``name`` (stage-local megatron name, any
    ``module.`` prefix) along under tensor parallelism; None for a replicated parameter (norms)."""
    return _SPLIT.get(_suffix(name))


def _chunks(name: str, t: torch.Tensor, tp_size: int) -> List[torch.Tensor]:
    dim = partition_dim(name)
    if dim is None:
        return [t] * tp_size
    if _suffix(name) == _GLU:  # cat[gate, up] -> per rank cat[gate_r, up_r]
        gate, up = torch.chunk(t, 2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(_split(name, gate, 0, tp_size), _split(name, up, 0, tp_size))]
    return _split(name, t, dim, tp_size)


def _split(name: str, t: torch.Tensor, dim: int, tp_size: int) -> List[torch.Tensor]:
    if t.shape[dim] % tp_size:
        raise ValueError(f"{name}: dimension {dim} of shape {tuple(t.shape)} is not divisible by "
                         f"--tensor-model-parallel-size {tp_size}")
    return list(torch.chunk(t, tp_size, dim=dim))


def shard_tensor(name: str, t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of one whole stage tensor ``t`` (stage-local megatron name
    ``name``): its chunk along :func:`partition_dim` (the GLU fc1 as ``cat[gate_r, up_r]``), or ``t``
    itself for a replicated parameter. Any dtype and device (the anchor's {-1, +1} signs of a
    whole parameter as well as weights).

    Returns:
        a contiguous tensor of the TP rank's parameter shape (split) or ``t`` (replicated).
    Raises:
        ValueError: ``tp_rank`` out of range, or a split dimension ``tp_size`` does not divide.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tensor-model-parallel size {tp_size}")
    if tp_size == 1 or partition_dim(name) is None:
        return t
    return _chunks(name, t, tp_size)[tp_rank].contiguous()


def shard_stage_state_dict(stage_sd: Dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> Dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s shard of a full stage state dict (layout: module docstring).

    Args:
        stage_sd: megatron stage names -> whole tensors (``hf_to_megatron``); ``*._extra_state``
            entries are dropped.
        tp_rank, tp_size: this rank's place in its tensor-parallel group.
    Returns:
        the same names -> this rank's shards (contiguous copies for split tensors, the
        tensor itself for replicated ones); ``tp_size == 1`` returns the dict unchanged.
    Raises:
        ValueError: a rank out of range, or a split dimension ``tp_size`` does not divide.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tensor-model-parallel size {tp_size}")
    if tp_size == 1:
        return dict(stage_sd)
    out = {}
    for name, t in stage_sd.items():
        if is_ignored_key(name):
            continue
        part = _chunks(name, t, tp_size)[tp_rank]
        out[name] = part.contiguous() if partition_dim(name) is not None else part
    return out


def merge_tp_shards(shards: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`shard_stage_state_dict`: one stage's TP shards (index = TP rank) ->
    its full state dict. A replicated parameter is taken from TP rank 0 (megatron keeps the
    copies equal: their gradients are the same on every TP rank).

    Raises:
        KeyError: the shards do not hold the same names.
        ValueError: no shards.
    """
    if not shards:
        raise ValueError("merge_tp_shards: no shards")
    names = [n for n in shards[0] if not is_ignored_key(n)]
    for r, sd in enumerate(shards[1:], start=1):
        other = {n for n in sd if not is_ignored_key(n)}
        if other != set(names):
            raise KeyError(f"TP shard {r} holds other parameters than shard 0: {sorted(other ^ set(names))[:5]}")
    if len(shards) == 1:
        return {n: shards[0][n] for n in names}
    out = {}
    for name in names:
        dim = partition_dim(name)
        parts = [sd[name] for sd in shards]
        if dim is None:
            out[name] = parts[0]
        elif _suffix(name) == _GLU:
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            out[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out


def gather_tp_stage_state_dict(stage_sd: Dict[str, torch.Tensor], tp_group) -> Dict[str, torch.Tensor]:
    """The whole stage from this rank's TP shard: a collective over ``tp_group`` (every TP rank
    of the stage calls it with its own shard, same names in the same order). Each TP-split
    tensor is all-gathered (``torch.distributed.all_gather``, gloo or NCCL) and the pieces merged
    as :func:`merge_tp_shards` does; replicated tensors are returned as held (TP rank 0's copy is
    equal). For the driver's sampler / evaluation / weight sync and the anchor's shipments, which
    take whole weights.

    Args:
        stage_sd: this TP rank's stage parameters (megatron names, e.g. ``model.state_dict()``
            without ``*._extra_state``).
        tp_group: the stage's tensor-parallel group; None or size 1 returns ``stage_sd`` as is.
    Returns:
        names -> whole tensors (new tensors for the split ones), on every TP rank.
    """
    import torch.distributed as dist

    if tp_group is None or tp_group.size() == 1:
        return dict(stage_sd)
    tp = tp_group.size()
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in stage_sd.items():
        if is_ignored_key(name):
            continue
        if partition_dim(name) is None:
            for sd in shards:
                sd[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
        for sd, part in zip(shards, parts):
            sd[name] = part
    return merge_tp_shards(shards)


def is_tp_split(p: torch.Tensor) -> bool:
    """Whether megatron-core split parameter ``p`` over the TP ranks (its ``tensor_model_parallel``
    attribute, set by the tensor-parallel layers); False for a replicated one (norms), whose
    gradient is the same on every TP rank: a norm or sum over the stage counts it on TP rank 0 only
    (megatron-core's ``param_is_not_tensor_parallel_duplicate``)."""
    return bool(getattr(p, "tensor_model_parallel", False))


class TPGatheredStage:
    """The whole stage, gathered from the TP shards, seen as a module's parameters: what the
    sampler's weight sync (``pipeline/weight_sync.py``, ``delta_sync.py``) reads at TP > 1
    instead of a TP rank's shard.

    :meth:`named_parameters` yields ``(name, whole tensor)`` in the stage's parameter order, with
    the shapes of the TP = 1 stage (fp32 or the model's dtype). The tensors are allocated once and
    refreshed in place by :meth:`refresh`, so a weight sync that keeps references to them sees the
    new values. Constructing and refreshing are collectives over ``tp_group`` (every TP rank of the
    stage calls them, :func:`gather_tp_stage_state_dict`).

    Args:
        model: this TP rank's stage.
        tp_group: the stage's tensor-parallel group (size > 1).
    """

    def __init__(self, model: torch.nn.Module, tp_group):
        self.model, self.group = model, tp_group
        self._named = [(n, t.clone()) for n, t in self._gather().items()]

    def _gather(self) -> Dict[str, torch.Tensor]:
        return gather_tp_stage_state_dict({n: p.detach() for n, p in self.model.named_parameters()}, self.group)

    @torch.no_grad()
    def refresh(self) -> None:
        """Gather the stage's current weights into the whole tensors (collective over ``tp_group``)."""
        for (_, dst), src in zip(self._named, self._gather().values()):
            dst.copy_(src)

    def named_parameters(self):
        """``(name, whole tensor)`` pairs, stage order."""
        return iter(self._named)

    def parameters(self):
        """The whole tensors, stage order."""
        return (t for _, t in self._named)
