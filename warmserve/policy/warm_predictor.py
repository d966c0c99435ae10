"""``warm``: warmserve's default load predictor (WarmServe §5.1; where we deviate and why).

**Average** — a point forecast: the median of six simple forecasts.

- persistence (the last window);
- CSP, Eq. 2-4 (:class:`~warmserve.policy.seasonal.CorrectiveSeasonalPredictor`, recent-weighted);
- the geometric mean of the last 3 windows;
- the *seasonal delta*: the last window times the step change seen at that time on previous
  days (previous weeks for day-long windows);
- two online log-AR models: ridge regression of log-load changes on lags 1-6 and around one
  period, zero windows treated as gaps or as zeros.

Why a median: on the bundled traces no single member wins everywhere (persistence on smooth
series, the AR models on noisy ones, CSP and the seasonal delta where the daily shape is
strong) and each fails badly somewhere (after a zero run, on a one-window spike).  The median of
six (the mean of the middle two) never follows one member's blunder and is not biased low.  It
also targets the right thing: the median of the next window's load minimises the
volume-weighted error.

**Peak** — an upper quantile, not a point forecast (deviation from §5.1, which predicts the peak
like the average): the same ensemble on the peak series, widened by an online-calibrated
quantile of its past errors so that the actual peak stays at or below the forecast in
``peak_coverage`` (92 %) of windows (:mod:`warmserve.policy.peak_forecast`).  The peak sizes the
burst replicas (Eq. 6) and weighs their score (Eq. 8); a point forecast leaves them short in
half the windows.  ``warm-point`` is the same predictor with ``peak_coverage=None`` (a point
forecast of the peak, the previous default).

**Streaming.**  Every member is updated one window at a time, so ``predict_all`` is one pass and
a forecast for a history that extends one already seen by one window costs one update:
:func:`cached_forecast` memoises the state per (predictor, history) in a bounded LRU.  The cache
never changes a result (a test compares cached and fresh runs); it only avoids refolding a
week of history every window for every model in the operator and the simulator.
"""

from __future__ import annotations

import copy
import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import numpy as np

from warmserve.policy.peak_forecast import (
    ACI_STEP,
    CALIBRATION_DAYS,
    CALIBRATION_NEIGHBOURS,
    CALIBRATION_OFFSET,
    DEFAULT_PEAK_COVERAGE,
    StreamingForecaster,
    UpperForecaster,
    check_coverage_params,
)
from warmserve.policy.seasonal import (
    DEFAULT_LOOKBACK,
    DEFAULT_MAX_DAYS,
    as_history,
    check_period,
    clip_forecast,
    eq3_correction,
    recent_mean,
    recent_weights,
    seasonal_mean,
)
from warmserve.policy.streaming import Tail

CACHE_SIZE = 1024  # streaming states kept: two per model (average, peak) for 512 models
CHECKPOINTS = 64  # states built by a full fold, kept apart (see cached_forecast)
AR_STEP_CLIP = 3.0  # a log-AR step beyond e^±3 is an artefact of a near-singular early fit


def geometric_recent(h: np.ndarray, t: int, k: int = 3) -> float:
    """Geometric mean of the last ``k`` windows (their median if any is 0).

    The natural "typical value" under multiplicative noise; it leans low after a one-window
    spike.
    """
    x = h[max(0, t - k) : t]
    if x.size == 0:
        return 0.0
    if np.all(x > 0):
        return float(np.exp(np.log(x).mean()))
    return float(np.median(x))


def seasonal_delta(h: np.ndarray, t: int, period: int, max_days: int) -> float:
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


def ar_lags(windows_per_day: int) -> tuple[int, ...]:
    """Lags of the log-AR members: the last 6 windows and the same time one period back."""
    period = windows_per_day if windows_per_day > 1 else 7
    return tuple(sorted({1, 2, 3, 4, 5, 6, period - 1, period, period + 1} - {0}))


class LogAR:
    """One online log-AR member, updated window by window.

    Target ``d[i] = log L[i] - level[i-1]``; features ``d[i-l]`` for ``l`` in ``lags`` (0 before
    window 1 or where ``d`` is undefined).  Coefficients: ridge regression (prior 1, i.e. pulled
    towards 0 = persistence until the data says otherwise) on every earlier target, kept as the
    running normal equations.  Zero windows are never targets (no log).  ``fill_gaps``: the
    level after a zero run is the last non-zero window (a zero is a gap in the data); otherwise
    the forecast after a zero is 0.
    """

    def __init__(self, lags: Sequence[int], fill_gaps: bool, ridge: float = 1.0) -> None:
        self.lags = np.asarray(sorted(set(lags)), dtype=int)
        k = self.lags.size
        self.fill_gaps = fill_gaps
        self.ridge = ridge * np.eye(k)
        self.ata = np.zeros((k, k))
        self.aty = np.zeros(k)
        self.d = Tail(int(self.lags.max()))
        self.level = math.nan  # log level the next forecast starts from (NaN: none)
        self.t = 0
        self._x: np.ndarray | None = None  # features of target t

    def _features(self) -> np.ndarray:
        if self._x is None:
            src = self.t - self.lags
            x = np.zeros(self.lags.size)
            ok = src >= 1
            x[ok] = self.d.get(src[ok])
            self._x = x
        return self._x

    def forecast(self) -> float:
        if math.isnan(self.level):
            return 0.0
        coef = np.linalg.solve(self.ata + self.ridge, self.aty)
        step = float(self._features() @ coef)
        return math.exp(self.level + min(max(step, -AR_STEP_CLIP), AR_STEP_CLIP))

    def observe(self, value: float) -> None:
        positive = value > 0
        valid = self.t >= 1 and positive and not math.isnan(self.level)
        d = math.log(value) - self.level if valid else 0.0
        if valid:
            x = self._features()
            self.ata += np.outer(x, x)
            self.aty += x * d
        self.d.append(d)
        if positive:
            self.level = math.log(value)
        elif not self.fill_gaps:
            self.level = math.nan
        self.t += 1
        self._x = None


class EnsembleState:
    """``warm``'s point forecast (the median of six members) as a streaming state."""

    def __init__(self, period: int, lookback: int, max_days: int) -> None:
        self.period = period
        self.season = period if period > 1 else 7
        self.lookback = lookback
        self.max_days = max_days
        self.weights = recent_weights(lookback)
        self.pasts = Tail(lookback)  # Eq. 2's P[i] of the last N windows (NaN: no previous day)
        self.ars = (LogAR(ar_lags(period), False), LogAR(ar_lags(period), True))
        self.t = 0
        self._memo: tuple[float, float | None] | None = None  # (forecast, P[t])

    def members(self, h: np.ndarray) -> tuple[list[float], float | None]:
        """Each member's forecast for window ``t = len(h)``, and Eq. 2's ``P[t]``."""
        t = self.t
        seasonal = seasonal_mean(h, t, self.period, self.max_days)
        if seasonal is None:
            csp = clip_forecast(recent_mean(h, t, self.lookback))
        else:
            n = min(self.lookback, t)
            back = self.pasts.get(t - np.arange(1, n + 1)) if n else np.zeros(0)
            pasts = [None if math.isnan(v) else float(v) for v in back]
            csp = clip_forecast(seasonal + eq3_correction(h, t, pasts, self.weights))
        return [
            float(h[t - 1]) if t else 0.0,
            csp,
            geometric_recent(h, t),
            seasonal_delta(h, t, self.season, self.max_days),
            self.ars[0].forecast(),
            self.ars[1].forecast(),
        ], seasonal

    def forecast(self, h: np.ndarray) -> float:
        if self._memo is None:
            members, seasonal = self.members(h)
            self._memo = (clip_forecast(float(np.median(members))), seasonal)
        return self._memo[0]

    def observe(self, h: np.ndarray) -> None:
        if self._memo is None:
            self.forecast(h[:-1])
        assert self._memo is not None
        seasonal = self._memo[1]
        self.pasts.append(math.nan if seasonal is None else seasonal)
        value = float(h[-1])
        for ar in self.ars:
            ar.observe(value)
        self.t += 1
        self._memo = None


def fold(state: StreamingForecaster, h: np.ndarray) -> np.ndarray:
    """Feed ``h`` to a fresh ``state``; ``out[t]``: its forecast for window ``t`` from ``h[:t]``."""
    out = np.empty(h.size)
    for t in range(h.size):
        out[t] = state.forecast(h[:t])
        state.observe(h[: t + 1])
    return out


_cache: OrderedDict[tuple[object, ...], StreamingForecaster] = OrderedDict()
_checkpoints: OrderedDict[tuple[object, ...], StreamingForecaster] = OrderedDict()
_cache_lock = threading.Lock()


def cached_forecast(
    key: tuple[object, ...], h: np.ndarray, make: Callable[[], StreamingForecaster]
) -> float:
    """Forecast for window ``len(h)`` from the streaming state ``make()`` fed with ``h``.

    The state for ``h`` is looked up by ``key`` and a 128-bit digest of ``h``; if only the state
    for ``h[:-1]`` is cached it takes in the last window; otherwise it is built from scratch.
    A state built from scratch (a full fold over days of history: most of a short simulation's
    predictor time) is also kept as a *checkpoint*, copied on use, so a second run from the same
    history (the next system of a simulator comparison, an operator restarted on the same
    history) starts from it instead of folding again; the states that advance window by window
    are not copied.
    """
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(np.ascontiguousarray(h[:-1]).tobytes())
    before = hasher.digest()
    hasher.update(np.ascontiguousarray(h[-1:]).tobytes())
    now = (key, h.size, hasher.digest())
    with _cache_lock:
        state = _cache.pop(now, None)
        if state is None:
            state = _cache.pop((key, h.size - 1, before), None) if h.size else None
            if state is not None:
                state.observe(h)
            elif now in _checkpoints:
                _checkpoints.move_to_end(now)
                state = copy.deepcopy(_checkpoints[now])
            else:
                state = make()
                fold(state, h)
                state.forecast(h)  # memoised in the state: the checkpoint carries it
                _checkpoints[now] = copy.deepcopy(state)
                while len(_checkpoints) > CHECKPOINTS:
                    _checkpoints.popitem(last=False)
        value = state.forecast(h)
        _cache[now] = state
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return value


def clear_cache() -> None:
    """Forget every memoised state (tests use it to compare cached and fresh runs)."""
    with _cache_lock:
        _cache.clear()
        _checkpoints.clear()


@dataclass(frozen=True)
class WarmPredictor:
    """``warm``: median-of-six point forecast of the average, coverage-oriented peak.

    ``peak_coverage=None`` forecasts the peak like the average (``warm-point``).  The other
    fields tune the peak calibration (:mod:`warmserve.policy.peak_forecast`).
    """

    name: str = "warm"
    lookback: int = DEFAULT_LOOKBACK
    max_days: int = DEFAULT_MAX_DAYS
    peak_coverage: float | None = DEFAULT_PEAK_COVERAGE
    aci_step: float = ACI_STEP
    calibration_days: int = CALIBRATION_DAYS
    neighbours: int = CALIBRATION_NEIGHBOURS
    offset: float = CALIBRATION_OFFSET

    def __post_init__(self) -> None:
        if self.peak_coverage is not None:
            check_coverage_params(
                self.peak_coverage, self.aci_step, self.calibration_days, self.neighbours,
                self.offset,
            )

    def _point(self, p: int) -> EnsembleState:
        return EnsembleState(p, self.lookback, self.max_days)

    def _peak(self, p: int) -> StreamingForecaster:
        if self.peak_coverage is None:
            return self._point(p)
        return UpperForecaster(
            self._point(p),
            p if p > 1 else 7,
            self.peak_coverage,
            self.aci_step,
            self.calibration_days,
            self.neighbours,
            self.offset,
        )

    def _key(self, kind: str, p: int) -> tuple[object, ...]:
        if kind == "peak" and self.peak_coverage is not None:
            return ("warm-peak", p, *astuple(self)[1:])
        return ("warm-point", p, self.lookback, self.max_days)

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        """Point forecast of the next window (the average)."""
        h = as_history(history)
        p = check_period(windows_per_day)
        return clip_forecast(cached_forecast(self._key("avg", p), h, lambda: self._point(p)))

    def predict_all(self, series: Sequence[float], windows_per_day: int) -> np.ndarray:
        return fold(self._point(check_period(windows_per_day)), as_history(series))

    def predict_peak(self, history: Sequence[float], windows_per_day: int) -> float:
        """Forecast of the next window's peak: an upper quantile (or the point forecast)."""
        h = as_history(history)
        p = check_period(windows_per_day)
        return clip_forecast(cached_forecast(self._key("peak", p), h, lambda: self._peak(p)))

    def predict_peak_all(self, series: Sequence[float], windows_per_day: int) -> np.ndarray:
        return fold(self._peak(check_period(windows_per_day)), as_history(series))
