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

__all__ = ["bit_stream", "pack_stream", "unpack_stream", "stream_values", "pack_values", "unpack_values", "packed_nbytes",
           "bytes_to_wire", "wire_to_bytes", "wire_numel", "ByteReader", "tensor_bytes"]


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


# The word packers below write the same bytes as pack_stream(cat(bit_stream(v_i, w_i))) without
# expanding every value into w uint8 bits (issue 10 item 6: the bit table's gathers were a third
# of a basis codec's critical path). A run of L = lcm(w, 8) / w values is one integer of lcm(w, 8)
# bits, i.e. a whole number of bytes, built with shifts in int64; widths whose lcm(w, 8) exceeds 56
# bits (odd w > 7) take the bit-table path.
_WORD_BITS = 56


def _word_layout(bits: int) -> Tuple[int, int]:
    """(values per word L, bytes per word) for the word packers, or (0, 0) for the bit-table path."""
    lcm = bits * 8 // math.gcd(bits, 8)
    return (lcm // bits, lcm // 8) if lcm <= _WORD_BITS else (0, 0)


def _pack_one(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [packed_nbytes(q.numel(), bits)]: the values of ``q`` (row-major, each in
    [0, 2**bits)) as pack_stream(bit_stream(q, bits))."""
    n, (per, nb) = q.numel(), _word_layout(bits)
    if not per:
        return pack_stream(bit_stream(q, bits))
    if bits == 8:
        return q.reshape(-1).to(torch.uint8)
    wdt = torch.int32 if per * bits <= 24 else torch.int64
    q = q.reshape(-1).to(wdt)
    pad = (-n) % per
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    shifts = torch.arange(per, device=q.device, dtype=wdt) * bits
    words = (q.view(-1, per) << shifts).sum(dim=1, dtype=wdt)  # disjoint bit fields: sum == or
    if nb == 1:
        return words.to(torch.uint8)[:packed_nbytes(n, bits)]
    out = (words[:, None] >> (torch.arange(nb, device=q.device, dtype=wdt) * 8)) & 255
    return out.to(torch.uint8).reshape(-1)[:packed_nbytes(n, bits)]


def _shift_in(carry_bits: int, carry: torch.Tensor, data: torch.Tensor, nbits: int) -> Tuple[torch.Tensor, int, torch.Tensor]:
    """Append the first ``nbits`` bits of uint8 ``data`` (zero beyond) to a stream whose last
    ``carry_bits`` (0..7) bits sit in the uint8 byte ``carry`` [1]. Returns (whole bytes done,
    new carry_bits, new carry)."""
    if carry_bits == 0:
        whole = nbits // 8
        left = nbits % 8
        return data[:whole], left, (data[whole:whole + 1] if left else data.new_zeros(1))
    d16 = data.to(torch.int32) << carry_bits
    merged = torch.zeros(data.numel() + 1, dtype=torch.int32, device=data.device)
    merged[:-1] = d16 & 255
    merged[1:] |= d16 >> 8
    merged[0] |= carry.to(torch.int32)[0]
    total = carry_bits + nbits
    merged = merged.to(torch.uint8)
    whole, left = total // 8, total % 8
    return merged[:whole], left, (merged[whole:whole + 1] if left else data.new_zeros(1))


def pack_values(groups: Sequence[Tuple[torch.Tensor, int]]) -> torch.Tensor:
    """One bit stream of several runs of unsigned ints, packed: for ``groups`` = [(q_i, w_i)],
    each q_i (any shape, row-major, values in [0, 2**w_i), 1 <= w_i <= 24) in order, every value
    little-endian. Returns uint8 [packed_nbytes(1, sum numel_i * w_i)], byte for byte
    pack_stream(cat(bit_stream(q_i, w_i))) (tests/compression/test_wire_pack.py)."""
    out, carry_bits = [], 0
    device = groups[0][0].device if groups else "cpu"
    carry = torch.zeros(1, dtype=torch.uint8, device=device)
    for q, w in groups:
        done, carry_bits, carry = _shift_in(carry_bits, carry, _pack_one(q, int(w)), q.numel() * int(w))
        out.append(done)
    if carry_bits:
        out.append(carry)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8, device=device)


def _unpack_one(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """int64 [count]: the values packed by :func:`_pack_one` at the start of uint8 ``data``."""
    per, nb = _word_layout(bits)
    if not per:
        return stream_values(unpack_stream(data, count * bits), bits)
    need = -(-count // per) * nb
    wdt = torch.int32 if per * bits <= 24 else torch.int64
    b = data.reshape(-1)[:need].to(wdt)
    if b.numel() < need:
        b = torch.cat([b, b.new_zeros(need - b.numel())])
    if nb == 1:
        words = b
    else:
        words = (b.view(-1, nb) << (torch.arange(nb, device=b.device, dtype=wdt) * 8)).sum(dim=1, dtype=wdt)
    if per == 1:
        return words[:count].to(torch.int64)
    shifts = torch.arange(per, device=b.device, dtype=wdt) * bits
    return ((words[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count].to(torch.int64)


def unpack_values(data: torch.Tensor, groups: Sequence[Tuple[int, int]]) -> list:
    """Inverse of :func:`pack_values`: for ``groups`` = [(count_i, w_i)], the int64 [count_i]
    values of each run, read from uint8 ``data``.

    Raises:
        ValueError: ``data`` holds fewer bits than the groups need.
    """
    total = sum(int(n) * int(w) for n, w in groups)
    if data.numel() * 8 < total:
        raise ValueError(f"need {total} bits, got {data.numel() * 8}")
    data, out, pos = data.reshape(-1), [], 0
    for n, w in groups:
        n, w = int(n), int(w)
        start, off = pos // 8, pos % 8
        seg = data[start:start + packed_nbytes(1, off + n * w)]
        if off:
            s32 = seg.to(torch.int32)
            nxt = torch.zeros_like(s32)
            nxt[:-1] = s32[1:]
            seg = ((s32 >> off) | (nxt << (8 - off))) & 255
        out.append(_unpack_one(seg, n, w))
        pos += n * w
    return out


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
