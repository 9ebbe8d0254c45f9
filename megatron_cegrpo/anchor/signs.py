"""sign(M) on the wire: 1 bit per parameter (DESIGN.md section 4).

Encoding: bit = 1 where the value is >= 0 (so 0 and -0.0 map to +1), bit = 0
where it is < 0 (NaN compares false and also maps to 0, i.e. -1).  Bit order is
little-endian within a byte: element ``8*i + j`` of the flattened tensor is
bit ``j`` (value ``1 << j``) of byte ``i``.  The last byte's unused high bits
are 0.  The packed buffer is a 1-D ``uint8`` tensor of ``ceil(numel / 8)``
bytes on the input's device.

:func:`pack_sign_list` packs a whole stage into one flat buffer: the tensors
are flattened and concatenated in the given order, with no padding between
tensors, so the buffer is ``ceil(sum(numel) / 8)`` bytes.

Vectorised torch: the only Python loop is over the 8 bit positions.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

__all__ = ["pack_bits", "unpack_bits", "pack_sign_list", "pack_signs", "packed_nbytes", "unpack_sign_list", "unpack_signs"]


def packed_nbytes(numel: int) -> int:
    """Bytes needed for ``numel`` signs: ``ceil(numel / 8)``."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    return (numel + 7) // 8


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[n] bool -> [ceil(n/8)] uint8, little-endian within a byte."""
    n = bits.numel()
    nbytes = packed_nbytes(n)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    lanes = padded.view(nbytes, 8)
    packed = lanes[:, 0].clone()
    for j in range(1, 8):
        packed |= lanes[:, j] << j
    return packed


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """[ceil(numel/8)] uint8 -> [numel] uint8 in {0, 1}."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed signs must be a 1-D uint8 tensor, got {getattr(packed, 'dtype', type(packed))}")
    expected = packed_nbytes(numel)
    if packed.numel() != expected:
        raise ValueError(f"{numel} signs need {expected} bytes, got {packed.numel()}")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:numel]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool -> ``[ceil(n/8)]`` uint8, the signs' bit order (the anchor's per-tensor
    "informative" bitmap, ``anchor/worker.py``)."""
    return _pack_bits(bits.reshape(-1))


def unpack_bits(packed: torch.Tensor, numel: int) -> List[bool]:
    """Inverse of :func:`pack_bits` as a list of ``numel`` bools.

    Raises:
        ValueError: wrong buffer dtype/size.
    """
    return [bool(b) for b in _unpack_bits(packed, numel).tolist()]


def _bits_to_signs(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.to(dtype) * 2 - 1


def pack_signs(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Pack ``sign(t)`` (0 -> +1) into ``(uint8 [ceil(numel/8)], numel)``."""
    return _pack_bits((t.detach() >= 0).reshape(-1)), t.numel()


def unpack_signs(
    packed: torch.Tensor, numel: int, shape: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a ``shape`` tensor of -1/+1 in ``dtype``.

    Raises:
        ValueError: wrong buffer dtype/size, or ``shape`` does not hold ``numel`` elements.
    """
    shape = tuple(int(d) for d in shape)
    if math.prod(shape) != numel:
        raise ValueError(f"shape {shape} does not hold {numel} elements")
    return _bits_to_signs(_unpack_bits(packed, numel), dtype).reshape(shape)


def pack_sign_list(tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
    """Pack the signs of several tensors into one flat buffer; returns ``(packed, sizes)``.

    ``sizes`` are the tensors' ``numel`` in order.  The signs are concatenated
    as one byte each before packing (one byte per parameter transiently, not
    the tensors' own dtype).
    """
    tensors = list(tensors)
    sizes = [t.numel() for t in tensors]
    if not tensors:
        return torch.zeros(0, dtype=torch.uint8), sizes
    bits = torch.cat([(t.detach() >= 0).reshape(-1) for t in tensors])
    return _pack_bits(bits), sizes


def unpack_sign_list(
    packed: torch.Tensor, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32
) -> List[torch.Tensor]:
    """Inverse of :func:`pack_sign_list`: one -1/+1 tensor per shape, in order.

    Raises:
        ValueError: the buffer size does not match ``ceil(sum(numel(shape)) / 8)``.
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    signs = _bits_to_signs(_unpack_bits(packed, sum(sizes)), dtype)
    return [chunk.reshape(s) for chunk, s in zip(torch.split(signs, sizes), shapes)]
