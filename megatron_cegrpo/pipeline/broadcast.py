"""The driver's rollout batch to every stage, metered (issue 12: the whole-step ledger).

What ``torch.distributed.broadcast_object_list`` moves, written out so that its bytes are
known exactly: the object's pickle bytes (:func:`dumps`, wire format :data:`BATCH_WIRE`) behind an
int64 length, from the group's rank 0 to each other member. Not a pipeline boundary: token ids,
masks, advantages and the sampler's log-probs, which no codec touches.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["BATCH_WIRE", "broadcast_metered", "broadcast_nbytes", "scatter_metered", "dumps", "loads"]

#: the batch's wire format, named in the equivalence records (tests/equivalence): ``comm/batch_bytes``
#: is its length. Before 2026-12-06 the batch went as torch's own pickle, whose length depended on
#: the tensors' memory addresses (:func:`dumps`).
BATCH_WIRE = "tensor-bytes/1"


def _tensor_from_bytes(dtype: str, shape: Tuple[int, ...], data: bytes) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)


def _reduce_tensor(t: torch.Tensor):
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return _tensor_from_bytes, (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


def dumps(obj: Any) -> bytes:
    """The wire bytes of ``obj``: a pickle in which every ``torch.Tensor`` is its dtype, shape and
    raw bytes (C order, this host's byte order), so the length depends on the values only.
    torch's own tensor pickle embeds a legacy ``torch.save`` of each storage keyed by its memory
    address in decimal, whose length moved ``comm/batch_bytes`` by ~110 bytes a batch between two
    runs of one program (and ~300 bytes of its header a tensor are saved). Tensors arrive
    contiguous, on the CPU (``compat/placement.place_batch`` moves them), without ``requires_grad``.
    Other objects pickle as ``pickle`` does (protocol :data:`pickle.HIGHEST_PROTOCOL`)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = copyreg.dispatch_table.copy()
    p.dispatch_table[torch.Tensor] = _reduce_tensor
    p.dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """The object :func:`dumps` wrote."""
    return pickle.loads(data)


def broadcast_nbytes(payload_bytes: int, group_size: int) -> int:
    """Bytes that cross hosts when ``payload_bytes`` of pickle go from one member to the
    ``group_size - 1`` others: ``(8 + payload_bytes) x (group_size - 1)`` (one copy each,
    the int64 length included)."""
    return (8 + payload_bytes) * (group_size - 1)


def broadcast_metered(obj: Any, group, copies: Optional[int] = None) -> Tuple[Any, int]:
    """Broadcast ``obj`` (given on the group's rank 0, None elsewhere) to every member.

    ``copies``: how many copies cross hosts (default: one per other member); with tensor
    parallelism the trainer passes the number of other stages (a stage's TP ranks share a host).

    Returns (the object, ``(8 + len(pickle)) x copies`` bytes, :func:`broadcast_nbytes` by default)
    on every member; the count is the same everywhere. Raises RuntimeError (the backend's) when a
    peer is gone.
    """
    src = dist.get_global_rank(group, 0)
    if group.rank() == 0:
        data = torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    if group.rank() != 0:
        data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    if group.rank() != 0:
        obj = loads(data.numpy().tobytes())
    return obj, broadcast_nbytes(int(n.item()), group.size() if copies is None else int(copies) + 1)


def scatter_metered(shards: Optional[Sequence[Any]], replica_of: Callable[[int], int], group,
                    counted: Optional[Callable[[int], bool]] = None) -> Tuple[Any, int]:
    """Data parallel (issue 14): each member of ``group`` receives only its replica's share.

    The group's rank 0 (the driver) gives ``shards`` (one picklable object per data-parallel
    replica, None elsewhere); member ``g`` (global rank) receives ``shards[replica_of(g)]`` as
    :func:`broadcast_metered` would send it (int64 length, then the pickle bytes), by point-to-point
    sends from rank 0; rank 0 keeps ``shards[replica_of(rank 0)]``.

    ``counted(g)``: whether the send to member ``g`` counts in rank 0's total (default: every
    send). The trainer at TP > 1 counts only TP rank 0 of each stage and replica (one copy per
    other pipeline position; a stage's TP ranks share a host, as in :func:`broadcast_metered`'s
    ``copies``), so ``comm/batch_bytes`` at TP x DP equals TP = 1's at the same DP.

    Returns:
        (this member's share, bytes): on rank 0 the bytes it sent to the counted members, ``sum (8 +
        len(pickle))`` over them (the ledger's ``comm/batch_bytes``); elsewhere the bytes this
        member received.
    Raises:
        RuntimeError: the backend's, when a peer is gone.
    """
    me = dist.get_rank()
    src = dist.get_global_rank(group, 0)
    if me == src:
        blobs = [torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8) for obj in shards]
        sent = 0
        for g in dist.get_process_group_ranks(group):
            if g == src:
                continue
            data = blobs[replica_of(g)]
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=g, group=group)
            dist.send(data, dst=g, group=group)
            if counted is None or counted(g):
                sent += 8 + data.numel()
        return shards[replica_of(src)], sent
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=src, group=group)
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return loads(data.numpy().tobytes()), 8 + data.numel()
