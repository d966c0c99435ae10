"""Additive damped Holt-Winters, a classical baseline for the load predictors (``holt-winters``).

statsmodels' ``ExponentialSmoothing`` fits the parameters; between refits the state follows
each new window with the same recursions (a test checks they reproduce statsmodels' fitted
values exactly), so every forecast is one step ahead and uses only the windows before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from warmserve.policy.seasonal import (
    DEFAULT_LOOKBACK,
    as_history,
    check_period,
    clip_forecast,
    recent_mean,
)


@dataclass(frozen=True)
class _HWParams:
    alpha: float
    beta: float
    gamma: float
    phi: float
    level: float
    trend: float
    seasons: tuple[float, ...]  # initial seasonal states; empty when non-seasonal


def _fit_holt_winters(h: np.ndarray, period: int) -> _HWParams | None:
    """Fit additive damped Holt-Winters with statsmodels; ``None`` if there is too little data.

    Seasonal (period ``period``) once two full periods exist, else Holt's damped trend only.
    Imported here: statsmodels is heavy and only this baseline needs it.
    """
    import warnings

    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    seasonal = h.size >= 2 * period and period > 1
    if h.size < 10:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = ExponentialSmoothing(
                h,
                trend="add",
                damped_trend=True,
                seasonal="add" if seasonal else None,
                seasonal_periods=period if seasonal else None,
                initialization_method="heuristic" if seasonal else "estimated",
            )
            fit = model.fit(use_brute=False)  # no brute-force start grid: 2x faster
        except (ValueError, np.linalg.LinAlgError):  # pragma: no cover - degenerate data
            return None
    par = fit.params
    seasons = tuple(float(x) for x in par["initial_seasons"]) if seasonal else ()
    return _HWParams(
        alpha=float(par["smoothing_level"]),
        beta=float(par["smoothing_trend"]),
        gamma=float(par["smoothing_seasonal"]) if seasonal else 0.0,
        phi=float(par["damping_trend"]),
        level=float(par["initial_level"]),
        trend=float(par["initial_trend"]),
        seasons=seasons,
    )


def _holt_winters_filter(par: _HWParams, h: np.ndarray, upto: int) -> np.ndarray:
    """One-step-ahead forecasts for windows ``0..upto-1`` with fixed parameters.

    The additive damped recursions statsmodels uses (its ``fittedvalues`` are reproduced
    exactly, see the tests), run forward so that a fit made once a day still tracks every new
    window instead of forecasting 288 steps blind.
    """
    level, trend = par.level, par.trend
    seasons = list(par.seasons)
    m = len(seasons)
    out = np.zeros(upto)
    for t in range(upto):
        s = seasons[t] if m else 0.0
        out[t] = level + par.phi * trend + s
        if t >= h.size:
            break
        y = float(h[t])
        new_level = par.alpha * (y - s) + (1 - par.alpha) * (level + par.phi * trend)
        new_trend = par.beta * (new_level - level) + (1 - par.beta) * par.phi * trend
        if m:
            seasons.append(par.gamma * (y - level - par.phi * trend) + (1 - par.gamma) * s)
        level, trend = new_level, new_trend
    return out


@dataclass
class HoltWintersPredictor:
    """Additive damped Holt-Winters; parameters refitted every ``refit_every`` windows.

    ``refit_every`` defaults to one day of windows (one week for day-long windows).  Between
    refits the state is updated with every new window (same equations, fixed parameters), so
    each forecast is one step ahead and uses only data before it.  Fewer than 10 windows:
    recent-window fallback.
    """

    name: str = "holt-winters"
    refit_every: int | None = None
    lookback: int = DEFAULT_LOOKBACK

    def _period(self, p: int) -> int:
        return p if p > 1 else 7

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        h = as_history(history)
        p = check_period(windows_per_day)
        par = _fit_holt_winters(h, self._period(p))
        if par is None:
            return clip_forecast(recent_mean(h, h.size, self.lookback))
        return clip_forecast(float(_holt_winters_filter(par, h, h.size + 1)[-1]))

    def predict_all(self, series: Sequence[float], windows_per_day: int) -> np.ndarray:
        h = as_history(series)
        p = check_period(windows_per_day)
        every = self.refit_every or self._period(p)
        out = np.array([recent_mean(h, t, self.lookback) for t in range(h.size)])
        par: _HWParams | None = None
        for t in range(h.size):
            if t % every == 0 or par is None:
                par = _fit_holt_winters(h[:t], self._period(p))
                if par is None:
                    continue
                block_end = min(h.size, (t // every + 1) * every)
                out[t:block_end] = _holt_winters_filter(par, h[:block_end], block_end)[t:]
        return np.where(np.isfinite(out) & (out > 0), out, 0.0)
