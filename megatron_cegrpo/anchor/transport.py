"""What crosses between the trainer ranks and the anchor rank, and how it is metered.

Both sides follow one deterministic schedule (DESIGN.md section 4), so no headers are
needed: for iteration t,

- ship (t - 1 = s is a multiple of c): every stage sends theta(s) (its parameters, one
  flat fp32 buffer, tag ``TAG_PARAMS``) with ``isend`` (the trainer does not wait), and the
  driver sends the rollout batch of iteration t, the one theta(s) generated (``TAG_BATCH``);
- fire (t is a multiple of c): the driver sends batch(t) unless it went out at ship time;
  the anchor answers each stage with a header (``TAG_SIGN_HDR``: 1 = signs follow) and
  sign(M) packed 8 parameters a byte (``TAG_SIGNS``), and the driver with its statistics
  (``TAG_STATS``).

Python objects travel as ``torch.save`` bytes behind an int64 length; the meter counts
every byte of every message, both ways.
"""

from __future__ import annotations

import io
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.pipeline.weight_sync import flatten_params, unflatten  # noqa: F401  (re-exported)

__all__ = ["TAG_PARAMS", "TAG_BATCH", "TAG_SIGN_HDR", "TAG_SIGNS", "TAG_STATS", "META_TAG",
           "is_ship_step", "is_fire_step", "send_object", "recv_object", "isend_object",
           "flatten_params", "unflatten"]

TAG_PARAMS, TAG_BATCH, TAG_SIGN_HDR, TAG_SIGNS, TAG_STATS, META_TAG = 11, 12, 13, 14, 15, 16


def is_ship_step(t: int, c: int) -> bool:
    """Iteration t ships theta(t - 1) (checkpoints at s = 0, c, 2c, ...)."""
    return (t - 1) % c == 0


def is_fire_step(t: int, c: int) -> bool:
    """The anchor fires at t = c, 2c, ..."""
    return t % c == 0


def _to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def isend_object(obj: Any, dst: int, tag: int) -> Tuple[list, int]:
    """Non-blocking send; returns (works and buffers to keep alive, bytes sent)."""
    data = _to_bytes(obj)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    works = [dist.isend(n, dst=dst, tag=tag), dist.isend(data, dst=dst, tag=tag)]
    return [works, n, data], n.numel() * 8 + data.numel()


def send_object(obj: Any, dst: int, tag: int) -> int:
    keep, nbytes = isend_object(obj, dst, tag)
    for w in keep[0]:
        w.wait()
    return nbytes


def recv_object(src: int, tag: int) -> Tuple[Any, int]:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=src, tag=tag)
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(data, src=src, tag=tag)
    obj = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    return obj, 8 + data.numel()
