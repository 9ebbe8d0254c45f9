"""The anchor circuit's pure pieces (DESIGN.md section 4), no torch.distributed.

- :class:`CheckpointRing`: the newest checkpoints, with the no-peek staleness
  contract (reads fresher than ``t - K`` raise :class:`StalenessError`).
- Forecasts (``secant`` default, ``lsq``, ``matching``): which weights and
  which batch the anchor replays at fire ``t``.
- :class:`AnchorMemory`: ``M <- a M + (1 - a) G_anc`` in fp32, ``sign(M)``.
- Sign packing: 1 bit per parameter, little-endian within a byte, 0 -> +1.
"""

from .forecast import (
    DEFAULT_FORECAST,
    ForecastResult,
    available_forecasts,
    forecast_error,
    get_forecast,
    lsq_forecast,
    matching_forecast,
    register_forecast,
    secant_forecast,
)
from .memory import AnchorMemory
from .ring import CheckpointRing, StalenessError
from .signs import pack_sign_list, pack_signs, packed_nbytes, unpack_sign_list, unpack_signs

__all__ = [
    "DEFAULT_FORECAST",
    "AnchorMemory",
    "CheckpointRing",
    "ForecastResult",
    "StalenessError",
    "available_forecasts",
    "forecast_error",
    "get_forecast",
    "lsq_forecast",
    "matching_forecast",
    "pack_sign_list",
    "pack_signs",
    "packed_nbytes",
    "register_forecast",
    "secant_forecast",
    "unpack_sign_list",
    "unpack_signs",
]
