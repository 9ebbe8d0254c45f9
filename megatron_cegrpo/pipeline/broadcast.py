"""The driver's rollout batch to every stage, metered (issue 12: the whole-step ledger).

What ``torch.distributed.broadcast_object_list`` moves, written out so that its bytes are
known exactly: the object's pickle bytes behind an int64 length, from the group's rank 0
to each other member. Not a pipeline boundary: token ids, masks, advantages and the
sampler's log-probs, which no codec touches.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["broadcast_metered", "broadcast_nbytes", "scatter_metered"]


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
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    if group.rank() != 0:
        data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    if group.rank() != 0:
        obj = pickle.loads(data.numpy().tobytes())
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
        blobs = [torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) for obj in shards]
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
    return pickle.loads(data.numpy().tobytes()), 8 + data.numel()
