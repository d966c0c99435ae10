"""Load predictors: the corrective seasonal predictor (WarmServe §5.1, Eq. 2-4), baselines, ours.

Every predictor maps a contiguous per-window history (oldest first) to the next window's value.
``windows_per_day`` is the seasonal period in windows; for windows of a day or longer pass 1
(each window is then its own "day", see :func:`season_length`).

Registered predictors (``PREDICTORS``):

- ``csp`` — Eq. 2-4 with the weighting the paper's *text* describes ("recent errors weigh more"):
  the window ``j`` steps back gets weight ``2^(N-j)``.
- ``csp-printed`` — Eq. 3 exactly as printed, weight ``2^(j-1)``: the *oldest* of the ``N``
  windows weighs most.  Kept to report both readings of the paper.
- ``seasonal`` — Eq. 2 alone (mean of the same window on previous days).
- ``persistence`` — the last window's value.
- ``holt-winters`` — additive Holt-Winters (statsmodels ``ExponentialSmoothing``), refitted once a
  day and forecasting the day ahead from the fit (refitting every window is far too slow).
- ``warm`` (the default) — see :class:`WarmPredictor`.

All return finite values ``>= 0``; with no history they return 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from warmserve.policy.cluster import LoadForecast, PolicyInputError

DAY_S = 86400.0
DEFAULT_LOOKBACK = 10  # N in Eq. 3
DEFAULT_MAX_DAYS = 7  # D in Eq. 2: all previous days up to one week (one of each weekday)


@runtime_checkable
class Predictor(Protocol):
    """Predicts the next window's load from the windows before it."""

    name: str

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        """Next window's value from ``history`` (oldest first); finite and ``>= 0``."""
        ...


def season_length(window_s: float) -> int:
    """Windows per day, the seasonal period; 1 for windows of a day or longer.

    A window must divide a day evenly (or be a whole number of days), otherwise "the same
    window on the previous day" is not a window at all.  For windows of one day or more there
    is no daily pattern to exploit inside a window, so each previous window plays the role of a
    previous day: Eq. 2 becomes a moving average of the last ``D`` windows, and ``warm`` looks for
    weekly seasonality instead (period 7 for daily windows).
    """
    if not math.isfinite(window_s) or window_s <= 0:
        raise PolicyInputError(f"window_s must be positive (got {window_s})")
    if window_s >= DAY_S:
        if abs(window_s / DAY_S - round(window_s / DAY_S)) > 1e-9:
            raise PolicyInputError(
                f"window_s {window_s:g} longer than a day must be a whole number of days"
            )
        return 1
    per_day = DAY_S / window_s
    if abs(per_day - round(per_day)) > 1e-9:
        raise PolicyInputError(f"window_s {window_s:g} must divide a day (86400 s) evenly")
    return round(per_day)


def _as_array(history: Sequence[float]) -> np.ndarray:
    h = np.asarray(history, dtype=float)
    if h.ndim != 1:
        raise PolicyInputError("history must be a 1-D sequence of per-window values")
    if h.size and (not np.all(np.isfinite(h)) or np.any(h < 0)):
        raise PolicyInputError("history values must be finite and >= 0")
    return h


def _check_period(windows_per_day: int) -> int:
    if int(windows_per_day) != windows_per_day or windows_per_day < 1:
        raise PolicyInputError(
            f"windows_per_day must be a positive integer (got {windows_per_day})"
        )
    return int(windows_per_day)


def _clip(value: float) -> float:
    return value if math.isfinite(value) and value > 0 else 0.0


def recent_weights(n: int, recent_first: bool = True) -> np.ndarray:
    """Eq. 3 weights for lags ``j = 1..n`` (index 0 is the most recent window).

    ``recent_first`` (the text's intent): ``2^(n-j)``; otherwise as printed: ``2^(j-1)``.
    """
    j = np.arange(1, n + 1, dtype=float)
    return 2.0 ** (n - j) if recent_first else 2.0 ** (j - 1)


def seasonal_mean(h: np.ndarray, t: int, period: int, max_days: int) -> float | None:
    """Eq. 2: mean of windows ``t - period*j`` for the previous ``D`` days that exist.

    ``D`` is ``min(max_days, days available)``; ``None`` when there is no previous day.
    """
    idx = t - period * np.arange(1, max_days + 1)
    idx = idx[idx >= 0]
    if idx.size == 0:
        return None
    return float(h[idx].mean())


def recent_mean(h: np.ndarray, t: int, lookback: int) -> float:
    """Exponentially recent-weighted mean of the last ``lookback`` windows (day-1 fallback)."""
    n = min(lookback, t)
    if n == 0:
        return 0.0
    w = recent_weights(n)
    return float(np.dot(h[t - n : t][::-1], w) / w.sum())


@dataclass
class CorrectiveSeasonalPredictor:
    """CSP, Eq. 2-4: ``L̂ = P + Δ``, Δ an exponentially weighted mean of the last N errors.

    Windows whose own seasonal term is undefined (no previous day) are left out of Eq. 3 and
    the weights renormalised over the rest; before the first full day of history the prediction
    falls back to :func:`recent_mean`.
    """

    name: str = "csp"
    lookback: int = DEFAULT_LOOKBACK
    max_days: int = DEFAULT_MAX_DAYS
    recent_first: bool = True

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        h = _as_array(history)
        p = _check_period(windows_per_day)
        t = h.size
        seasonal = seasonal_mean(h, t, p, self.max_days)
        if seasonal is None:
            return _clip(recent_mean(h, t, self.lookback))
        return _clip(seasonal + self.correction(h, t, p))

    def correction(self, h: np.ndarray, t: int, period: int) -> float:
        """Eq. 3: weighted mean of ``L[t-j] - P[t-j]`` over ``j = 1..N``."""
        n = min(self.lookback, t)
        weights = recent_weights(self.lookback, self.recent_first)[:n]
        num = den = 0.0
        for j in range(1, n + 1):
            past = seasonal_mean(h, t - j, period, self.max_days)
            if past is None:
                continue
            num += (h[t - j] - past) * weights[j - 1]
            den += weights[j - 1]
        return num / den if den else 0.0


@dataclass
class SeasonalPredictor:
    """Eq. 2 alone; day 1 falls back to recent windows."""

    name: str = "seasonal"
    lookback: int = DEFAULT_LOOKBACK
    max_days: int = DEFAULT_MAX_DAYS

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        h = _as_array(history)
        p = _check_period(windows_per_day)
        seasonal = seasonal_mean(h, h.size, p, self.max_days)
        if seasonal is None:
            return _clip(recent_mean(h, h.size, self.lookback))
        return _clip(seasonal)


@dataclass
class PersistencePredictor:
    """The last window's value (0 with no history)."""

    name: str = "persistence"

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        h = _as_array(history)
        _check_period(windows_per_day)
        return _clip(float(h[-1])) if h.size else 0.0


def _geometric_recent(h: np.ndarray, t: int, k: int = 3) -> float:
    """Geometric mean of the last ``k`` windows (their median if any is 0).

    A geometric mean is the natural "typical value" under multiplicative noise and leans low
    after a one-window spike, which is where relative error punishes over-prediction most.
    """
    x = h[max(0, t - k) : t]
    if x.size == 0:
        return 0.0
    if np.all(x > 0):
        return float(np.exp(np.log(x).mean()))
    return float(np.median(x))


def _seasonal_delta(h: np.ndarray, t: int, period: int, max_days: int) -> float:
    """Last window scaled by the change the same step showed on previous periods.

    ``L[t-1] * mean_d L[t-dP] / mean_d L[t-dP-1]`` over the previous ``max_days`` periods ``P``:
    persistence that knows the daily (or, for day-long windows, weekly) shape.
    """
    if t == 0:
        return 0.0
    idx = t - period * np.arange(1, max_days + 1)
    idx = idx[idx >= 1]
    last = float(h[t - 1])
    if idx.size == 0:
        return last
    before = float(h[idx - 1].mean())
    return last * float(h[idx].mean()) / before if before > 0 else last


def _log_ar_forecasts(
    h: np.ndarray, lags: Sequence[int], fill_gaps: bool, ts: Sequence[int], ridge: float = 1.0
) -> np.ndarray:
    """Online log-AR forecasts for the window indices ``ts`` (each from ``h[:t]`` only).

    Target: ``d[i] = log L[i] - log L[i-1]``; features: ``d[i-l]`` for ``l`` in ``lags`` (short
    lags capture mean reversion after spikes, lags around one period the daily shape).  The
    coefficients are ridge regression (prior 1, i.e. pulled towards 0 = persistence until the
    data says otherwise) on every target before ``t``: recursive least squares, computed in one
    vectorised pass with cumulative sums.  Windows with load 0 have no log: they are never
    targets.  With ``fill_gaps`` the level after a zero run is the last non-zero window (a zero
    window is treated as a gap in the data); without it the forecast after a zero is 0.
    """
    lags = tuple(sorted({lag for lag in lags if lag >= 1}))
    n, k = h.size, len(lags)
    pos = h > 0
    idx = np.arange(n)
    last_pos = np.maximum.accumulate(np.where(pos, idx, -1)) if n else idx
    # level[i]: the log level a forecast made after window i starts from (nan: none)
    if fill_gaps:
        level = np.where(last_pos >= 0, np.log(np.where(last_pos >= 0, h[last_pos], 1.0)), np.nan)
    else:
        level = np.where(pos, np.log(np.where(pos, h, 1.0)), np.nan)
    d = np.zeros(n)
    valid = np.zeros(n, dtype=bool)
    if n > 1:
        valid[1:] = pos[1:] & ~np.isnan(level[:-1])
        log_h = np.log(np.where(pos[1:], h[1:], 1.0))
        d[1:] = np.where(valid[1:], log_h - np.nan_to_num(level[:-1]), 0.0)
    # x[i]: features for target i, i = 0..n (row n is the forecast after the last window)
    x = np.zeros((n + 1, k))
    for c, lag in enumerate(lags):
        src = np.arange(n + 1) - lag
        ok = src >= 1
        x[ok, c] = d[src[ok]]
    w = valid.astype(float)
    outer = (x[:n, :, None] * x[:n, None, :]) * w[:, None, None]
    ata = np.concatenate([np.zeros((1, k, k)), np.cumsum(outer, axis=0)])  # rows before t
    aty = np.concatenate([np.zeros((1, k)), np.cumsum(x[:n] * (d * w)[:, None], axis=0)])
    t_idx = np.asarray(list(ts), dtype=int)
    coef = np.linalg.solve(ata[t_idx] + ridge * np.eye(k), aty[t_idx][..., None])[..., 0]
    step = np.clip(np.einsum("ij,ij->i", x[t_idx], coef), -3.0, 3.0)
    prev = np.array([level[t - 1] if t >= 1 else np.nan for t in t_idx])
    return np.where(np.isnan(prev), 0.0, np.exp(np.nan_to_num(prev) + step))


def _ar_lags(windows_per_day: int) -> tuple[int, ...]:
    period = windows_per_day if windows_per_day > 1 else 7
    return (1, 2, 3, 4, 5, 6, period - 1, period, period + 1)


def predict_series(
    predictor: Predictor, series: Sequence[float], windows_per_day: int
) -> np.ndarray:
    """``out[t]`` = the prediction for window ``t`` made from ``series[:t]`` only.

    Uses the predictor's ``predict_all`` when it has a faster equivalent, else calls
    ``predict`` once per window.
    """
    h = _as_array(series)
    p = _check_period(windows_per_day)
    fast: Callable[[np.ndarray, int], np.ndarray] | None = getattr(predictor, "predict_all", None)
    if fast is not None:
        out = np.asarray(fast(h, p), dtype=float)
    else:
        out = np.array([predictor.predict(h[:t], p) for t in range(h.size)], dtype=float)
    return np.where(np.isfinite(out) & (out > 0), out, 0.0)


@dataclass
class WarmPredictor:
    """``warm``: the median of six simple forecasts — our default.

    Members: persistence; CSP (Eq. 2-4, recent-weighted); the geometric mean of the last 3
    windows; the seasonal delta (last window times the step change seen on previous days, or
    previous weeks for day-long windows); and two online log-AR models (zero windows as gaps or
    as zeros).  Why a median: on these traces no single member wins everywhere — persistence is
    near-optimal on smooth series (ServeGen), the AR models win on noisy ones (Azure LMM,
    BurstGPT), CSP and the seasonal delta help where the daily shape is strong — and each fails
    badly somewhere (after a zero run, on a one-window spike).  The median of an even number of
    members is the mean of the middle two, so one member's blunder never moves it much, and it
    is not biased low: its under-prediction rate stays near 50 % (reported by ``predict``).
    """

    name: str = "warm"
    lookback: int = DEFAULT_LOOKBACK
    max_days: int = DEFAULT_MAX_DAYS

    def _members(self, h: np.ndarray, p: int, ts: Sequence[int]) -> np.ndarray:
        """Each member's forecast for every window index in ``ts`` (rows: members)."""
        csp = CorrectiveSeasonalPredictor(lookback=self.lookback, max_days=self.max_days)
        period = p if p > 1 else 7
        cols = [
            [float(h[t - 1]) if t else 0.0 for t in ts],
            [csp.predict(h[:t], p) for t in ts],
            [_geometric_recent(h, t) for t in ts],
            [_seasonal_delta(h, t, period, self.max_days) for t in ts],
        ]
        for fill in (False, True):
            cols.append(list(_log_ar_forecasts(h, _ar_lags(p), fill, ts)))
        return np.array(cols, dtype=float)

    def predict_all(self, series: Sequence[float], windows_per_day: int) -> np.ndarray:
        h = _as_array(series)
        p = _check_period(windows_per_day)
        return np.median(self._members(h, p, range(h.size)), axis=0)

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        h = _as_array(history)
        p = _check_period(windows_per_day)
        return _clip(float(np.median(self._members(h, p, [h.size])[:, 0])))


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
            fit = model.fit()
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
        h = _as_array(history)
        p = _check_period(windows_per_day)
        par = _fit_holt_winters(h, self._period(p))
        if par is None:
            return _clip(recent_mean(h, h.size, self.lookback))
        return _clip(float(_holt_winters_filter(par, h, h.size + 1)[-1]))

    def predict_all(self, series: Sequence[float], windows_per_day: int) -> np.ndarray:
        h = _as_array(series)
        p = _check_period(windows_per_day)
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


PREDICTORS: dict[str, Callable[[], Predictor]] = {
    "warm": WarmPredictor,
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


def forecast(
    avg_history: Sequence[float],
    peak_history: Sequence[float],
    windows_per_day: int,
    predictor: Predictor | str | None = None,
) -> LoadForecast:
    """Next window's :class:`LoadForecast` for one model (§5.1: average and peak alike).

    The peak forecast is raised to the average forecast if it falls below it: a window's peak
    can never be below its average, and the placement (Eq. 5-6) relies on ``peak >= avg``.
    """
    pred = predictor if predictor is not None and not isinstance(predictor, str) else None
    if pred is None:
        pred = make_predictor(predictor if isinstance(predictor, str) else None)
    if len(avg_history) != len(peak_history):
        raise PolicyInputError("avg_history and peak_history must have the same length")
    avg = pred.predict(avg_history, windows_per_day)
    peak = pred.predict(peak_history, windows_per_day)
    return LoadForecast(avg=avg, peak=max(peak, avg))


@dataclass(frozen=True)
class Evaluation:
    """Accuracy of one predictor on one series (windows ``start..end``)."""

    rel_error: float  # mean |pred - actual| / actual over windows with actual > 0 (nan if none)
    under_rate: float  # fraction of evaluated windows with pred < actual
    windows: int  # windows evaluated
    predictions: np.ndarray = field(repr=False)  # one per window of the series (0 before start)


def evaluate(
    predictor: Predictor, series: Sequence[float], windows_per_day: int, start: int
) -> Evaluation:
    """Predict every window from ``start`` on from the windows before it, and score it."""
    h = _as_array(series)
    if start < 1 or start >= h.size:
        raise PolicyInputError(
            f"evaluation start {start} must be in 1..{h.size - 1} (series has {h.size} windows)"
        )
    preds = predict_series(predictor, h, windows_per_day)
    preds[:start] = 0.0
    act, got = h[start:], preds[start:]
    nz = act > 0
    rel = float(np.mean(np.abs(got[nz] - act[nz]) / act[nz])) if nz.any() else float("nan")
    return Evaluation(rel, float(np.mean(got < act)), int(act.size), preds)
