"""Boundary compression for pipeline-stage links (DESIGN.md section 3).

Pure tensor code (no torch.distributed): the Threefry-2x32 PRF, the exact-k
channel mask derived from it, the boundary codecs (``dense``, ``mask``, ``lowrank``) and the
byte meter that reports ``comm/bytes_ratio``.
"""

from .codecs import (
    BoundaryCodec,
    BoundaryContext,
    DenseCodec,
    MaskCodec,
    available_codecs,
    build_codec,
    get_codec,
    has_precompute,
    register_codec,
)
from .lowrank import LowRankCodec
from .meter import ByteMeter
from .prf import exact_k_indices, keep_count, prf_channel_scores, threefry2x32

__all__ = [
    "BoundaryCodec",
    "BoundaryContext",
    "ByteMeter",
    "DenseCodec",
    "LowRankCodec",
    "MaskCodec",
    "available_codecs",
    "build_codec",
    "exact_k_indices",
    "get_codec",
    "has_precompute",
    "keep_count",
    "prf_channel_scores",
    "register_codec",
    "threefry2x32",
]
