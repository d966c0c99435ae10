"""Load predictors (WarmServe §5.1): the registry, the default, and the forecast the policy uses.

Every predictor maps a contiguous per-window history (oldest first) to the next window's value.
``windows_per_day`` is the seasonal period in windows; for windows of a day or longer pass 1
(each window is then its own "day", see :func:`season_length`).

Registered predictors (``PREDICTORS``):

- ``warm`` (the default) — :class:`~warmserve.policy.warm_predictor.WarmPredictor`: a robust
  point forecast of the average, an upper-quantile forecast of the peak calibrated to cover
  92 % of windows (:mod:`warmserve.policy.peak_forecast`).
- ``warm-point`` — the same with a point forecast of the peak (the default before the
  coverage-oriented peak).
- ``csp`` / ``csp-printed`` — Eq. 2-4, the text's and the printed weighting
  (:mod:`warmserve.policy.seasonal`).
- ``seasonal`` — Eq. 2 alone; ``persistence`` — the last window.
- ``holt-winters`` — additive damped Holt-Winters (:mod:`warmserve.policy.holt_winters`).

A predictor may also forecast the peak differently from the average: if it has
``predict_peak(history, windows_per_day)`` (and optionally ``predict_peak_all``),
:func:`forecast` and :func:`evaluate` with ``peak=True`` use it; otherwise the peak is
predicted like the average, as in the paper.  All return finite values ``>= 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from warmserve.policy.cluster import LoadForecast, PolicyInputError
from warmserve.policy.forecast_quality import ForecastQuality, forecast_quality
from warmserve.policy.holt_winters import HoltWintersPredictor
from warmserve.policy.seasonal import (
    DAY_S,
    DEFAULT_LOOKBACK,
    DEFAULT_MAX_DAYS,
    CorrectiveSeasonalPredictor,
    PersistencePredictor,
    Predictor,
    SeasonalPredictor,
    as_history,
    check_period,
    recent_weights,
    season_length,
    seasonal_mean,
)
from warmserve.policy.warm_predictor import WarmPredictor

__all__ = [
    "DAY_S",
    "DEFAULT_LOOKBACK",
    "DEFAULT_MAX_DAYS",
    "DEFAULT_PREDICTOR",
    "PREDICTORS",
    "CorrectiveSeasonalPredictor",
    "Evaluation",
    "HoltWintersPredictor",
    "PersistencePredictor",
    "Predictor",
    "SeasonalPredictor",
    "WarmPredictor",
    "evaluate",
    "forecast",
    "make_predictor",
    "predict_peak_series",
    "predict_series",
    "recent_weights",
    "season_length",
    "seasonal_mean",
]

PREDICTORS: dict[str, Callable[[], Predictor]] = {
    "warm": WarmPredictor,
    "warm-point": lambda: WarmPredictor(name="warm-point", peak_coverage=None),
    "csp": CorrectiveSeasonalPredictor,
    "csp-printed": lambda: CorrectiveSeasonalPredictor(name="csp-printed", recent_first=False),
    "seasonal": SeasonalPredictor,
    "persistence": PersistencePredictor,
    "holt-winters": HoltWintersPredictor,
}
DEFAULT_PREDICTOR = "warm"


def make_predictor(name: str | None = None) -> Predictor:
    """A fresh predictor by registry name (default: ``DEFAULT_PREDICTOR``)."""
    key = DEFAULT_PREDICTOR if name is None else name
    if key not in PREDICTORS:
        raise PolicyInputError(
            f"unknown predictor {name!r} (available: {', '.join(PREDICTORS)})"
        )
    return PREDICTORS[key]()


def _finite(out: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(out) & (out > 0), out, 0.0)


def predict_series(
    predictor: Predictor, series: Sequence[float], windows_per_day: int
) -> np.ndarray:
    """``out[t]`` = the prediction for window ``t`` made from ``series[:t]`` only.

    Uses the predictor's ``predict_all`` when it has a faster equivalent, else calls
    ``predict`` once per window.
    """
    h = as_history(series)
    p = check_period(windows_per_day)
    fast: Callable[[np.ndarray, int], np.ndarray] | None = getattr(predictor, "predict_all", None)
    if fast is not None:
        return _finite(np.asarray(fast(h, p), dtype=float))
    return _finite(np.array([predictor.predict(h[:t], p) for t in range(h.size)], dtype=float))


def predict_peak_series(
    predictor: Predictor, series: Sequence[float], windows_per_day: int
) -> np.ndarray:
    """Like :func:`predict_series` for a peak series: uses ``predict_peak`` where there is one."""
    one = getattr(predictor, "predict_peak", None)
    if one is None:
        return predict_series(predictor, series, windows_per_day)
    h = as_history(series)
    p = check_period(windows_per_day)
    fast: Callable[[np.ndarray, int], np.ndarray] | None = getattr(
        predictor, "predict_peak_all", None
    )
    if fast is not None:
        return _finite(np.asarray(fast(h, p), dtype=float))
    return _finite(np.array([one(h[:t], p) for t in range(h.size)], dtype=float))


def forecast(
    avg_history: Sequence[float],
    peak_history: Sequence[float],
    windows_per_day: int,
    predictor: Predictor | str | None = None,
) -> LoadForecast:
    """Next window's :class:`LoadForecast` for one model (§5.1), the input of Eq. 5-8.

    The average is the predictor's point forecast; the peak its ``predict_peak`` if it has one
    (``warm``: an upper quantile, so that burst replicas cover the peak in most windows), else
    the point forecast of the peak history, as in the paper.  The peak is raised to the average
    if it falls below it: a window's peak can never be below its average, and the placement
    (Eq. 5-6) relies on ``peak >= avg``.
    """
    pred = predictor if predictor is not None and not isinstance(predictor, str) else None
    if pred is None:
        pred = make_predictor(predictor if isinstance(predictor, str) else None)
    if len(avg_history) != len(peak_history):
        raise PolicyInputError("avg_history and peak_history must have the same length")
    avg = pred.predict(avg_history, windows_per_day)
    peak_fn = getattr(pred, "predict_peak", None)
    peak = (peak_fn or pred.predict)(peak_history, windows_per_day)
    return LoadForecast(avg=avg, peak=max(peak, avg))


@dataclass(frozen=True)
class Evaluation:
    """Accuracy of one predictor on one series (windows ``start..end``)."""

    rel_error: float  # mean |pred - actual| / actual over windows with actual > 0 (nan if none)
    under_rate: float  # fraction of evaluated windows with pred < actual
    windows: int  # windows evaluated
    predictions: np.ndarray = field(repr=False)  # one per window of the series (0 before start)
    quality: ForecastQuality | None = None  # every metric (see forecast_quality)


def evaluate(
    predictor: Predictor,
    series: Sequence[float],
    windows_per_day: int,
    start: int,
    *,
    peak: bool = False,
    floor: Sequence[float] | None = None,
) -> Evaluation:
    """Predict every window from ``start`` on from the windows before it, and score it.

    ``peak=True``: ``series`` is a peak series, forecast with ``predict_peak`` where the
    predictor has one.  ``floor``: per-window lower bounds applied to the predictions (the
    average forecast, as :func:`forecast` raises the peak to it).
    """
    h = as_history(series)
    if start < 1 or start >= h.size:
        raise PolicyInputError(
            f"evaluation start {start} must be in 1..{h.size - 1} (series has {h.size} windows)"
        )
    preds = (predict_peak_series if peak else predict_series)(predictor, h, windows_per_day)
    if floor is not None:
        low = np.asarray(floor, dtype=float)
        if low.shape != preds.shape:
            raise PolicyInputError("floor must have one value per window of the series")
        preds = np.maximum(preds, low)
    preds[:start] = 0.0
    q = forecast_quality(preds[start:], h[start:])
    return Evaluation(q.mean_rel_error, q.under_rate, q.windows, preds, q)
