"""The driver's rollout batch to every stage, metered (issue 12: the whole-step ledger).

What ``torch.distributed.broadcast_object_list`` moves, written out so that its bytes are
known exactly: the object's pickle bytes behind an int64 length, from the group's rank 0
to each other member. Not a pipeline boundary: token ids, masks, advantages and the
sampler's log-probs, which no codec touches.
"""

from __future__ import annotations

import pickle
from typing import Any, Tuple

import torch
import torch.distributed as dist

__all__ = ["broadcast_metered", "broadcast_nbytes"]


def broadcast_nbytes(payload_bytes: int, group_size: int) -> int:
    """Bytes that cross hosts when ``payload_bytes`` of pickle go from one member to the
    ``group_size - 1`` others: ``(8 + payload_bytes) x (group_size - 1)`` (one copy each,
    the int64 length included)."""
    return (8 + payload_bytes) * (group_size - 1)


def broadcast_metered(obj: Any, group) -> Tuple[Any, int]:
    """Broadcast ``obj`` (given on the group's rank 0, None elsewhere) to every member.

    Returns (the object, :func:`broadcast_nbytes` of its pickle) on every member; the
    count is the same everywhere. Raises RuntimeError (the backend's) when a peer is gone.
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
    return obj, broadcast_nbytes(int(n.item()), group.size())
