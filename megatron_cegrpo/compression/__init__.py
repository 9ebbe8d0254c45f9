"""Boundary compression for pipeline-stage links (DESIGN.md section 3).

Pure tensor code (no torch.distributed): the Threefry-2x32 PRF, the one codec class
(:class:`BoundaryCodec`, ``codecs.py``: a forward and a backward half), the one registry of
halves (``halves.py``: ``dense``; ``mask.py``: the exact-k PRF mask; ``lowrank.py``;
``subspace.py``: ``pcaq``, ``lrq``; ``repeat.py``: ``rpq``), the one constructor
(``spec.build_codec``, parsing ``--boundary-codec``) and the byte meter that reports
``comm/bytes_ratio``.
"""

from .codecs import BoundaryCodec, BoundaryContext
from .halves import DenseHalf, DirectionCodec, available_halves, register_half
from .mask import MaskHalf
from .lowrank import LowRankHalf
from .meter import ByteMeter
from . import subspace  # noqa: F401  (registers the pcaq and lrq halves)
from . import repeat  # noqa: F401  (registers the rpq half)
from .spec import available_codecs, build_codec, check_codec_budget, parse_codec_spec
from .prf import exact_k_indices, keep_count, prf_channel_scores, threefry2x32

__all__ = [
    "BoundaryCodec",
    "BoundaryContext",
    "ByteMeter",
    "DenseHalf",
    "DirectionCodec",
    "LowRankHalf",
    "MaskHalf",
    "available_codecs",
    "available_halves",
    "build_codec",
    "check_codec_budget",
    "exact_k_indices",
    "keep_count",
    "parse_codec_spec",
    "prf_channel_scores",
    "register_half",
    "threefry2x32",
]
