"""Boundary compression for pipeline-stage links (DESIGN.md section 3).

Pure tensor code (no torch.distributed): the Threefry-2x32 PRF, the exact-k
channel mask derived from it, the boundary codecs (``dense``, ``mask``, ``lowrank``), the
independent forward/backward halves of ``FWD:BWD`` specs (``halves.py``, ``subspace.py``,
``repeat.py``, ``pair.py``; parsed in ``spec.py``) and the byte meter that reports ``comm/bytes_ratio``.
"""

from .codecs import (
    BoundaryCodec,
    BoundaryContext,
    DenseCodec,
    MaskCodec,
    available_codecs,
    get_codec,
    has_precompute,
    register_codec,
)
from .halves import DirectionCodec, available_halves, register_half
from .lowrank import LowRankCodec
from .meter import ByteMeter
from .pair import PairCodec
from . import subspace  # noqa: F401  (registers the pcaq and lrq halves)
from . import repeat  # noqa: F401  (registers the rpq half)
from .spec import build_codec, check_codec_budget, parse_codec_spec
from .prf import exact_k_indices, keep_count, prf_channel_scores, threefry2x32

__all__ = [
    "BoundaryCodec",
    "BoundaryContext",
    "ByteMeter",
    "DenseCodec",
    "DirectionCodec",
    "LowRankCodec",
    "PairCodec",
    "available_halves",
    "check_codec_budget",
    "parse_codec_spec",
    "register_half",
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
