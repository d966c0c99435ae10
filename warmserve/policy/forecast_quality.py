"""How good a load forecast was: the metrics ``warmserve predict`` reports (§5.1, §7.4).

Pure functions of two equally long arrays, the forecasts and the actual per-window loads.  Why
several metrics (see ``docs/prediction.md`` for the long form):

- **Mean relative error** (MRE), the paper's metric (§7.4): mean ``|p - a| / a`` over windows
  with ``a > 0``.  Every window counts the same, so a near-empty window where 0.2 is forecast
  and 0.1 happens (100 %) outweighs a busy window missed by 30 %.  It punishes over-forecasts
  more than under-forecasts (an over-forecast is unbounded, an under-forecast at most 100 %),
  so it rewards forecasts that are biased low.
- **Volume-weighted error** (VWE, also called WAPE): ``Σ|p - a| / Σa``, the MRE with each
  window weighted by its load, i.e. the mean absolute error as a share of the mean load.  It is
  what the error costs in capacity: a request-weighted view that near-empty windows cannot
  dominate.  The median forecast minimises it.
- **Coverage**: share of windows with ``a <= p``.  For the peak this is what burst replicas
  (Eq. 6, 8) are for: the share of windows whose peak the prewarmed capacity would have met.
- **Over-forecast**: what the coverage costs.  ``over_forecast`` is volume-weighted,
  ``Σ max(p - a, 0) / Σa``: the mean over-forecast as a share of the mean actual load (capacity
  prewarmed beyond need); ``over_forecast_rel`` is per window: the mean of ``(p - a) / a`` over the
  covered windows with ``a > 0`` (how far above the actual a covering forecast sat, each window
  counted once; like MRE it is dominated by near-empty windows).
- **Under-forecast rate**: share of windows with ``p < a`` (``1 - coverage``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from warmserve.policy.cluster import PolicyInputError


@dataclass(frozen=True)
class ForecastQuality:
    """Metrics of one forecast series against the actual load (NaN where undefined)."""

    windows: int  # windows scored
    mean_rel_error: float  # mean |p - a| / a over windows with a > 0 (NaN if none)
    volume_weighted_error: float  # Σ|p - a| / Σa (NaN if Σa = 0)
    under_rate: float  # share of windows with p < a
    coverage: float  # share of windows with a <= p
    over_forecast: float  # Σ max(p - a, 0) / Σa (NaN if Σa = 0)
    over_forecast_rel: float  # mean (p - a) / a over windows with a > 0 and a <= p (NaN if none)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "windows": self.windows,
            "mean_rel_error": self.mean_rel_error,
            "volume_weighted_error": self.volume_weighted_error,
            "under_rate": self.under_rate,
            "coverage": self.coverage,
            "over_forecast": self.over_forecast,
            "over_forecast_rel": self.over_forecast_rel,
        }


def _checked(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise PolicyInputError(f"{what} must be a 1-D sequence")
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr < 0)):
        raise PolicyInputError(f"{what} must be finite and >= 0")
    return arr


def forecast_quality(
    predicted: Sequence[float] | np.ndarray, actual: Sequence[float] | np.ndarray
) -> ForecastQuality:
    """Score ``predicted[i]`` against ``actual[i]`` for every window ``i``."""
    p = _checked(predicted, "predicted")
    a = _checked(actual, "actual")
    if p.size != a.size:
        raise PolicyInputError(f"predicted has {p.size} windows, actual {a.size}")
    if a.size == 0:
        raise PolicyInputError("no windows to score")
    nan = float("nan")
    busy = a > 0
    total = float(a.sum())
    covered = a <= p
    over_rel = covered & busy
    return ForecastQuality(
        windows=int(a.size),
        mean_rel_error=float(np.mean(np.abs(p[busy] - a[busy]) / a[busy])) if busy.any() else nan,
        volume_weighted_error=float(np.abs(p - a).sum() / total) if total > 0 else nan,
        under_rate=float(np.mean(p < a)),
        coverage=float(np.mean(covered)),
        over_forecast=float(np.maximum(p - a, 0.0).sum() / total) if total > 0 else nan,
        over_forecast_rel=(
            float(np.mean((p[over_rel] - a[over_rel]) / a[over_rel])) if over_rel.any() else nan
        ),
    )
