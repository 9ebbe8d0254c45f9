"""What crosses between the trainer ranks and the anchor rank, and how it is metered.

Both sides follow one deterministic schedule (DESIGN.md section 4), so no headers are
needed: for iteration t,

- ship (t - 1 = s is a multiple of c): every stage sends theta(s) (a check header, int64,
  ``TAG_PARAMS_HDR``: sequence number, kind, size, CRC-32, the digest of the weights it leads to;
  then its parameters' payload as bytes, tag ``TAG_PARAMS``: fp32, or a delta against the mirror both ends keep,
  ``--anchor-ship``, ``anchor/shipment.py``; a new run's theta(0) is not sent when the start-up
  digests agreed; with ``--anchor-ship-check`` the exact fp32 buffer follows, ``TAG_PARAMS_EXACT``,
  metered apart in ``anchor/bytes_ship_check``) with ``isend`` (the trainer does not wait), and the
  driver sends the rollout batch of iteration t, the one theta(s) generated (``TAG_BATCH``);
- fire (t is a multiple of c): the driver sends batch(t) unless it went out at ship time;
  the anchor answers each stage with a header (``TAG_SIGN_HDR``: bit 0 = signs follow,
  bit 1 = bases follow, bit 2 = a per-tensor "informative" bitmap follows (``TAG_SIGN_INFO``,
  only when M is 0 on a whole tensor: that tensor gets no correction), bit 3 = a shipment of this
  stage was refused, send an fp32 keyframe next), sign(M) packed 8 parameters a byte (``TAG_SIGNS``), with an
  anchor-owned lowrank codec the [d, r] basis of each boundary the stage touches, ascending
  (``TAG_BASIS``, pipeline dtype; ``anchor/basis.py``), and the driver with its statistics
  (``TAG_STATS``);
- save (a checkpoint iteration): the driver sends the checkpoint's temporary directory
  (``TAG_SAVE``), the anchor writes its state there and answers ``"ok"`` or an error
  (``TAG_SAVE_DONE``); the stages' checkpoint collectives never include the anchor, so a
  dead anchor cannot block a save.

Once, at start-up, every stage sends its parameter names and shapes, the digest of the mirror its
weight deltas start from and, on a resume, the fire whose signs it still awaits (``META_TAG``):
the anchor answers the digest with one byte, 1 agreed / 0 not (``TAG_MIRROR_ACK``;
``anchor/shipment.py``: no keyframe when agreed) and sends the awaited signs again.

Every message goes over the anchor group (``DistContext.anchor_group``), whose timeout is
the peers' lifetime (``initialize.PEER_LIFETIME_TIMEOUT``): the anchor waits c iterations
for the next shipment and the stages wait for a fire as long as the other side lives; a
peer that dies closes its connection, and the waiting side gets a ``RuntimeError`` at once.

Python objects travel as ``torch.save`` bytes behind an int64 length; the meter counts
every byte of every message, both ways.
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.pipeline.weight_sync import flatten_params, unflatten  # noqa: F401  (re-exported)

__all__ = ["TAG_PARAMS", "TAG_BATCH", "TAG_SIGN_HDR", "TAG_SIGNS", "TAG_STATS", "META_TAG", "TAG_SAVE",
           "TAG_SAVE_DONE", "TAG_BASIS", "TAG_SIGN_INFO", "TAG_MIRROR_ACK", "TAG_PARAMS_EXACT",
           "TAG_PARAMS_HDR", "is_ship_step", "is_fire_step", "send_object", "recv_object", "recv_tensor",
           "isend_object", "flatten_params", "unflatten"]

TAG_PARAMS, TAG_BATCH, TAG_SIGN_HDR, TAG_SIGNS, TAG_STATS, META_TAG = 11, 12, 13, 14, 15, 16
TAG_SAVE, TAG_SAVE_DONE, TAG_BASIS, TAG_SIGN_INFO, TAG_MIRROR_ACK, TAG_PARAMS_EXACT = 17, 18, 19, 20, 21, 22
TAG_PARAMS_HDR = 23


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


def isend_object(obj: Any, dst: int, tag: int, group=None) -> Tuple[list, int]:
    """Non-blocking send of a picklable-by-torch.save object to global rank ``dst``.

    Returns (works and buffers to keep alive until the works are waited, bytes sent).
    Raises RuntimeError (from the backend) when the peer's connection is gone.
    """
    data = _to_bytes(obj)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    works = [dist.isend(n, dst=dst, tag=tag, group=group), dist.isend(data, dst=dst, tag=tag, group=group)]
    return [works, n, data], n.numel() * 8 + data.numel()


def send_object(obj: Any, dst: int, tag: int, group=None) -> int:
    """Blocking :func:`isend_object`; returns the bytes sent."""
    keep, nbytes = isend_object(obj, dst, tag, group)
    for w in keep[0]:
        w.wait()
    return nbytes


def recv_object(src: int, tag: int, group=None, timeout: Optional[timedelta] = None) -> Tuple[Any, int]:
    """Receive one object sent by :func:`isend_object` from global rank ``src``.

    ``timeout`` bounds the wait (None: the group's timeout); a gloo timeout closes the
    connection, so the caller must treat it like a dead peer. Returns (object, bytes).
    Raises RuntimeError when the peer's connection is gone or the timeout expires.
    """
    n = torch.zeros(1, dtype=torch.int64)
    recv_tensor(n, src, tag, group, timeout)
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    recv_tensor(data, src, tag, group, timeout)
    obj = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    return obj, 8 + data.numel()


def recv_tensor(buf: torch.Tensor, src: int, tag: int, group=None, timeout: Optional[timedelta] = None) -> None:
    """Blocking receive into ``buf`` from global rank ``src``, optionally bounded by ``timeout``."""
    work = dist.irecv(buf, src=src, tag=tag, group=group)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
