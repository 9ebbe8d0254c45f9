"""Replay forecasts: which weights the anchor replays at, and which batch.

A forecast is a function ``(ring, t, K, c, **options) -> ForecastResult | None``
registered with :func:`register_forecast`, which declares its options; :func:`get_forecast` binds them
and returns a callable ``(ring, t, K, c)``.  DESIGN.md section 4, system status
appendix A, LA-WARMUP-V2 report sections 3 and 10.

- ``secant`` (default; ``damping`` D, default 1): advance the newest readable
  checkpoint ``s1`` along the secant through the one before it ``s0``,
  ``theta_hat = theta(s1) + D ((t - s1) / (s1 - s0)) (theta(s1) - theta(s0))``,
  which is ``theta(t-K) + D (K/c)(theta(t-K) - theta(t-K-c))`` on schedule.
  Replays the newest batch (``batch_step = t``). D = 1 is the plain secant (bit
  for bit the forecast of earlier versions: the coefficient is multiplied by
  1.0). Source of the damping: the seeds' EXP-42 (status report, issue 31): the
  plain secant overshoots; damping its coefficient to ~0.53 cut the
  forecast-to-true distance ratio (:func:`forecast_error`) from 0.972 to 0.836 at
  horizon K = 10 and from 1.173 to 0.897 at K = 20 (``--anchor-forecast-damping``).
- ``lsq`` (``n_points``, default 4): per-element least-squares line through
  the newest ``n_points`` readable checkpoints (x = step), evaluated at ``t``.
  Replays the newest batch.
- ``matching``: ``theta(s1)`` itself, replaying the batch it generated
  (``batch_step = s1``).

Until a forecast has enough readable checkpoints (2 for ``secant``,
``n_points`` for ``lsq``) it falls back to ``matching`` with
``branch = "fallback"``; with no readable checkpoint every forecast returns
``None`` (the anchor skips that fire and logs it).  ``lsq`` warns when the
ring is full and still short of ``n_points`` readable checkpoints: with
checkpoints put at the step that writes them it needs
``capacity >= n_points + ceil(K / c)`` (5 at the defaults), else it never
leaves the fallback.

Every read goes through the ring, so the no-peek contract holds.  Results are
new fp32 tensors (inputs may be bf16); ring tensors are never modified.  The
extrapolation coefficients are computed in float64 and applied to differences
from the newest checkpoint, which keeps the small weight movement accurate.

:func:`forecast_error` scores a forecast once the true weights of its step are known
(``anchor/forecast_error``, logged by the anchor worker).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .ring import CheckpointRing

__all__ = [
    "DEFAULT_FORECAST",
    "ForecastResult",
    "available_forecasts",
    "forecast_error",
    "get_forecast",
    "lsq_forecast",
    "matching_forecast",
    "register_forecast",
    "secant_forecast",
]

DEFAULT_FORECAST = "secant"

ForecastFn = Callable[..., Optional["ForecastResult"]]
_REGISTRY: Dict[str, ForecastFn] = {}
#: the keyword options each registered forecast declares (register_forecast(options=...))
_OPTIONS: Dict[str, frozenset] = {}


@dataclass
class ForecastResult:
    """What the anchor replays.

    Attributes:
        weights: name -> new fp32 tensor (not aliased with the ring).
        branch: ``"forecast"``, ``"matching"`` or ``"fallback"``.
        source_steps: checkpoint steps used, oldest first.
        batch_step: step whose rollout batch to replay.
    """

    weights: Dict[str, torch.Tensor]
    branch: str
    source_steps: List[int] = field(default_factory=list)
    batch_step: int = 0


def register_forecast(name: str, options: Sequence[str] = ()) -> Callable[[ForecastFn], ForecastFn]:
    """Decorator registering ``fn(ring, t, K, c, **options)`` under ``name``; ``options`` declares
    the keyword options ``fn`` takes (what :func:`get_forecast` accepts).

    Raises:
        ValueError: ``name`` already registered to a different function.
    """

    def deco(fn: ForecastFn) -> ForecastFn:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"forecast name {name!r} already registered to {existing.__name__}")
        _REGISTRY[name] = fn
        _OPTIONS[name] = frozenset(options)
        return fn

    return deco


def available_forecasts() -> List[str]:
    """Sorted names of the registered forecasts."""
    return sorted(_REGISTRY)


def get_forecast(name: str, **options) -> Callable[[CheckpointRing, int, int, int], Optional[ForecastResult]]:
    """The forecast ``name`` with ``options`` bound, as ``(ring, t, K, c) -> ForecastResult | None``.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or an
            option the forecast does not take.
    """
    fn = _REGISTRY.get(name)
    if fn is None:
        raise ValueError(f"unknown anchor forecast {name!r}; valid names: {', '.join(available_forecasts())}")
    if not options:
        return fn
    unknown = sorted(set(options) - _OPTIONS[name])
    if unknown:
        raise ValueError(f"forecast {name!r} does not take options {unknown}; it takes "
                         f"{sorted(_OPTIONS[name]) or 'none'}")
    return functools.partial(fn, **options)


# ---------------------------------------------------------------- helpers
def _check_args(ring: CheckpointRing, t: int, K: int, c: int) -> None:
    if K != ring.delay:
        raise ValueError(f"forecast K={K} differs from the ring's delay {ring.delay}")
    if c < 1:
        raise ValueError(f"anchor interval c must be >= 1, got {c}")


def _fp32_copy(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {name: v.to(torch.float32, copy=True) for name, v in tensors.items()}


def _combine(points: Sequence[Tuple[int, Dict[str, torch.Tensor]]], coefs: Sequence[float]) -> Dict[str, torch.Tensor]:
    """sum_i coefs[i] * theta_i for coefficients summing to 1, computed as
    theta_last + sum_{i < last} coefs[i] * (theta_i - theta_last) in fp32."""
    assert abs(sum(coefs) - 1.0) <= 1e-9 * max(1.0, sum(abs(w) for w in coefs)), coefs
    last = points[-1][1]
    out: Dict[str, torch.Tensor] = {}
    for name, v_last in last.items():
        base = v_last.to(torch.float32)
        acc = base.clone()
        for (_, tensors), coef in zip(points[:-1], coefs[:-1]):
            if coef != 0.0:
                acc.add_(tensors[name].to(torch.float32) - base, alpha=coef)
        out[name] = acc
    return out


def _matching(ring: CheckpointRing, t: int, branch: str) -> Optional[ForecastResult]:
    points = ring.latest_readable(t, 1)
    if not points:
        return None
    step, tensors = points[0]
    return ForecastResult(weights=_fp32_copy(tensors), branch=branch, source_steps=[step], batch_step=step)


# -------------------------------------------------------------- forecasts
@register_forecast("matching")
def matching_forecast(ring: CheckpointRing, t: int, K: int, c: int) -> Optional[ForecastResult]:
    """theta(s1) for the newest readable s1, replaying the batch it generated."""
    _check_args(ring, t, K, c)
    return _matching(ring, t, "matching")


@register_forecast("secant", options=("damping",))
def secant_forecast(ring: CheckpointRing, t: int, K: int, c: int, *, damping: float = 1.0) -> Optional[ForecastResult]:
    """theta(s1) + D ((t - s1)/(s1 - s0)) (theta(s1) - theta(s0)) on the two newest readable,
    D = ``damping`` (>= 0; 1: the plain secant, 0: theta(s1) with the newest batch).

    Raises:
        ValueError: a negative or non-finite ``damping``.
    """
    _check_args(ring, t, K, c)
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not 0.0 <= damping < float("inf"):
        raise ValueError(f"secant damping must be a finite number >= 0, got {damping!r}")
    points = ring.latest_readable(t, 2)
    if len(points) < 2:
        return _matching(ring, t, "fallback")
    (s0, _), (s1, _) = points
    h = (t - s1) / (s1 - s0) * damping  # exact for damping 1.0: the undamped secant, bit for bit
    weights = _combine(points, [-h, 1.0 + h])
    return ForecastResult(weights=weights, branch="forecast", source_steps=[s0, s1], batch_step=t)


@register_forecast("lsq", options=("n_points",))
def lsq_forecast(ring: CheckpointRing, t: int, K: int, c: int, *, n_points: int = 4) -> Optional[ForecastResult]:
    """Per-element least-squares line through the newest ``n_points`` readable checkpoints, at ``t``.

    The prediction is ``sum_i w_i theta(x_i)`` with
    ``w_i = 1/n + (t - xbar)(x_i - xbar) / sum_j (x_j - xbar)^2``.
    """
    _check_args(ring, t, K, c)
    if isinstance(n_points, bool) or not isinstance(n_points, int) or n_points < 2:
        raise ValueError(f"lsq n_points must be an int >= 2, got {n_points!r}")
    if n_points > ring.capacity:
        raise ValueError(f"lsq n_points={n_points} exceeds the ring capacity {ring.capacity}; it could never fire")
    points = ring.latest_readable(t, n_points)
    if len(points) < n_points:
        if len(ring) == ring.capacity:
            warnings.warn(
                f"lsq forecast needs {n_points} readable checkpoints but the full ring (capacity "
                f"{ring.capacity}, held {ring.steps}) has {len(points)} at t={t}; it stays on the "
                f"fallback branch unless the ring capacity is >= n_points + ceil(K / c)",
                stacklevel=2,
            )
        return _matching(ring, t, "fallback")
    xs = [float(s) for s, _ in points]
    xbar = sum(xs) / n_points
    sxx = sum((x - xbar) ** 2 for x in xs)
    coefs = [1.0 / n_points + (t - xbar) * (x - xbar) / sxx for x in xs]
    return ForecastResult(
        weights=_combine(points, coefs), branch="forecast", source_steps=[s for s, _ in points], batch_step=t
    )


@torch.no_grad()
def forecast_error(forecast: Dict[str, torch.Tensor], stale: Dict[str, torch.Tensor],
                   truth: Dict[str, torch.Tensor]) -> Optional[float]:
    """How far a forecast landed from the truth, relative to not forecasting at all:

        ``||theta_hat(t) - theta(t)|| / ||theta(s1) - theta(t)||``

    over every parameter (one L2 norm of the whole model, accumulated in fp64), where
    ``theta_hat(t)`` is the forecast for step t, ``theta(s1)`` the newest stale checkpoint it
    extrapolated from and ``theta(t)`` the true weights of step t. 1.0: no better than replaying
    at ``theta(s1)``; below 1: the forecast helps; above 1: it overshoots. Source: the seeds'
    EXP-42 "forecast-to-true distance ratio" (0.972 undamped / 0.836 damped at horizon 10,
    1.173 / 0.897 at horizon 20; issue 31).

    Args:
        forecast, stale, truth: name -> tensor, the same names and shapes (any float dtype).
    Returns:
        the ratio, or None when ``theta(s1) == theta(t)`` (nothing moved: no scale to compare with).
    Raises:
        ValueError: the three dicts name different parameters.
    """
    if not (forecast.keys() == stale.keys() == truth.keys()):
        raise ValueError(f"forecast_error needs the same parameters in all three: forecast-only "
                         f"{sorted(forecast.keys() - truth.keys())[:4]}, stale-only {sorted(stale.keys() - truth.keys())[:4]}, "
                         f"truth-only {sorted(truth.keys() - forecast.keys())[:4]}")
    num = den = 0.0
    for name, true in truth.items():
        ref = true.double()
        num += float((forecast[name].double() - ref).square().sum())
        den += float((stale[name].double() - ref).square().sum())
    return (num / den) ** 0.5 if den > 0.0 else None
