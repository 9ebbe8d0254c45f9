"""Byte-exact wire payloads: bit packing and the byte <-> wire-dtype view.

megatron-core's p2p layer receives into buffers of ``config.pipeline_dtype`` (fp32 on CPU
here), so a codec whose payload is a byte string (packed b-bit integers, fp16 basis rows,
fp32 scales) reinterprets those bytes as the wire dtype: :func:`bytes_to_wire` pads to a
whole number of elements and views, :func:`wire_to_bytes` views back. Both are bit
reinterpretations (``Tensor.view(dtype)``), never value conversions, so every byte arrives
as sent (gloo and NCCL move bytes, they do no arithmetic on p2p buffers).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

__all__ = ["bit_stream", "pack_stream", "unpack_stream", "stream_values", "packed_nbytes", "bytes_to_wire", "wire_to_bytes", "wire_numel",
           "ByteReader", "tensor_bytes"]


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits take packed: ceil(count * bits / 8)."""
    return (int(count) * int(bits) + 7) // 8


# Issue 10 item 6 (the bit packing is on the critical path of pcaq / rpq / lrq): bits travel as
# uint8 0/1 (not int64), byte <-> bits through a 256-row table, and bits -> integers through an
# fp32 matrix product with powers of two (exact: every partial sum is an integer < 2**24).
_BITS_OF_BYTE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8)  # [256, 8]
_POW2 = 2.0 ** torch.arange(24, dtype=torch.float32)


def bit_stream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The bits of unsigned ints ``q`` (any shape, values in [0, 2**bits), 1 <= bits <= 24),
    each value little-endian, values in row-major order: uint8 0/1 tensor [q.numel() * bits]."""
    bits = int(bits)
    q = q.reshape(-1)
    if bits <= 8:
        return _BITS_OF_BYTE.to(q.device)[q.to(torch.int64), :bits].reshape(-1)
    shifts = torch.arange(bits, device=q.device, dtype=torch.int32)
    return ((q.to(torch.int32)[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)


def pack_stream(stream: torch.Tensor) -> torch.Tensor:
    """Pack a 0/1 stream (any integer dtype) into uint8 [packed_nbytes(len, 1)], bit i of byte
    j = stream[8j + i] (the last byte zero-padded)."""
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    return (stream.view(-1, 8).to(torch.float32) @ _POW2[:8].to(stream.device)).to(torch.uint8)


def unpack_stream(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_stream`: the first ``nbits`` bits of uint8 ``data`` as uint8 0/1.

    Raises:
        ValueError: ``data`` holds fewer than ``nbits`` bits.
    """
    if data.numel() * 8 < nbits:
        raise ValueError(f"need {nbits} bits, got {data.numel() * 8}")
    return _BITS_OF_BYTE.to(data.device)[data.reshape(-1).to(torch.int64)].reshape(-1)[:nbits]


def stream_values(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`bit_stream` (1 <= bits <= 24): int64 values [len(stream) // bits]."""
    bits = int(bits)
    return (stream.reshape(-1, bits).to(torch.float32) @ _POW2[:bits].to(stream.device)).to(torch.int64)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as uint8 [numel * element_size] (a view, no copy)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def wire_numel(nbytes: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that carry ``nbytes`` bytes: ceil(nbytes / element_size)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return math.ceil(int(nbytes) / elem)


def bytes_to_wire(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Concatenate uint8 ``parts``, zero-pad to whole elements of ``dtype`` and view as ``dtype``.

    Returns:
        1-D tensor of ``dtype`` with wire_numel(sum of part sizes, dtype) elements.
    """
    data = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0, dtype=torch.uint8)
    elem = torch.empty((), dtype=dtype).element_size()
    pad = (-data.numel()) % elem
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    return data.view(dtype)


def wire_to_bytes(payload: torch.Tensor) -> torch.Tensor:
    """uint8 view of a received payload (inverse of :func:`bytes_to_wire`, padding included)."""
    return payload.contiguous().reshape(-1).view(torch.uint8)


class ByteReader:
    """Reads consecutive fields out of a uint8 tensor (the receiver's side of bytes_to_wire)."""

    def __init__(self, data: torch.Tensor):
        self.data, self.pos = data, 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` bytes (uint8). Raises ValueError past the end."""
        end = self.pos + int(nbytes)
        if end > self.data.numel():
            raise ValueError(f"payload too short: need byte {end}, have {self.data.numel()}")
        out, self.pos = self.data[self.pos:end], end
        return out

    def take_as(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next field as a tensor of ``shape`` and ``dtype`` (bit copy)."""
        elem = torch.empty((), dtype=dtype).element_size()
        n = math.prod(shape) * elem
        return self.take(n).clone().view(dtype).view(shape)
