"""The checks every checked link shares: BLAKE2b-128 digests, CRC-32s and a header's check word.

Two links carry state that must arrive exactly: the sampler's bf16 weight deltas
(``pipeline/delta_codec.py``) and the anchor's weight shipments (``anchor/shipment.py``). Each puts
an int64 header ahead of its payload with the payload's CRC-32, a digest of the state the payload
leads to, and a check word over the header's other fields (a corrupt size must not be trusted);
these are the one definition of those three. Pure functions of a tensor's bytes, no
torch.distributed.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Sequence, Tuple

import torch

__all__ = ["digest128", "digest_words", "digest_hex", "crc32", "check_word"]


def _bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def digest128(t: torch.Tensor) -> bytes:
    """BLAKE2b-128 of ``t``'s bytes (any dtype and shape, CPU; 16 bytes)."""
    return hashlib.blake2b(_bytes(t), digest_size=16).digest()


def digest_words(t: torch.Tensor) -> Tuple[int, int]:
    """:func:`digest128` as two signed little-endian int64: the form a header carries."""
    d = digest128(t)
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


def digest_hex(t: torch.Tensor) -> str:
    """:func:`digest128` as 32 hex characters: the form a start-up message carries."""
    return digest128(t).hex()


def crc32(t: torch.Tensor) -> int:
    """CRC-32 (zlib) of ``t``'s bytes: a payload's checksum."""
    return zlib.crc32(_bytes(t))


def check_word(fields: Sequence[int]) -> int:
    """CRC-32 of ``fields`` as int64 little-endian: the last word of a header, over the others."""
    return zlib.crc32(torch.tensor(list(fields), dtype=torch.int64).numpy().tobytes())
