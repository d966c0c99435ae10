"""The corrective seasonal predictor (WarmServe §5.1, Eq. 2-4) and the simple baselines.

Every predictor maps a contiguous per-window history (oldest first) to the next window's value.
``windows_per_day`` is the seasonal period in windows; for windows of a day or longer pass 1
(each window is then its own "day", see :func:`season_length`).

- :class:`CorrectiveSeasonalPredictor` (``csp``) — Eq. 2-4 with the weighting the paper's *text*
  describes ("recent errors weigh more"): the window ``j`` steps back gets weight ``2^(N-j)``;
  with ``recent_first=False`` (``csp-printed``) Eq. 3 exactly as printed, weight ``2^(j-1)``, so
  the *oldest* of the ``N`` windows weighs most.  Kept to report both readings of the paper.
- :class:`SeasonalPredictor` (``seasonal``) — Eq. 2 alone (mean of the same window on previous
  days).
- :class:`PersistencePredictor` (``persistence``) — the last window's value.

All return finite values ``>= 0``; with no history they return 0.  The registry, the default
and :func:`~warmserve.policy.predictor.forecast` live in :mod:`warmserve.policy.predictor`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from warmserve.policy.cluster import PolicyInputError

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


def as_history(history: Sequence[float]) -> np.ndarray:
    """``history`` as a float array, checked: 1-D, finite, ``>= 0``."""
    h = np.asarray(history, dtype=float)
    if h.ndim != 1:
        raise PolicyInputError("history must be a 1-D sequence of per-window values")
    if h.size and (not np.all(np.isfinite(h)) or np.any(h < 0)):
        raise PolicyInputError("history values must be finite and >= 0")
    return h


def check_period(windows_per_day: int) -> int:
    """``windows_per_day`` checked to be a positive integer."""
    if int(windows_per_day) != windows_per_day or windows_per_day < 1:
        raise PolicyInputError(
            f"windows_per_day must be a positive integer (got {windows_per_day})"
        )
    return int(windows_per_day)


def clip_forecast(value: float) -> float:
    """A forecast made safe: finite and ``>= 0`` (NaN, inf and negatives become 0)."""
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
        h = as_history(history)
        p = check_period(windows_per_day)
        t = h.size
        seasonal = seasonal_mean(h, t, p, self.max_days)
        if seasonal is None:
            return clip_forecast(recent_mean(h, t, self.lookback))
        return clip_forecast(seasonal + self.correction(h, t, p))

    def correction(self, h: np.ndarray, t: int, period: int) -> float:
        """Eq. 3: weighted mean of ``L[t-j] - P[t-j]`` over ``j = 1..N``."""
        n = min(self.lookback, t)
        pasts = [seasonal_mean(h, t - j, period, self.max_days) for j in range(1, n + 1)]
        return eq3_correction(h, t, pasts, recent_weights(self.lookback, self.recent_first))


def eq3_correction(
    h: np.ndarray, t: int, pasts: Sequence[float | None], weights: np.ndarray
) -> float:
    """Eq. 3's weighted mean of ``L[t-j] - P[t-j]``, ``pasts[j-1]`` being ``P[t-j]``.

    Windows whose ``P`` is ``None`` (no previous day) are left out and the weights renormalised
    over the rest; 0 when none is left.  Shared by ``csp`` and ``warm``'s CSP member so that both
    compute bit-identical values.
    """
    num = den = 0.0
    for j, past in enumerate(pasts, start=1):
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
        h = as_history(history)
        p = check_period(windows_per_day)
        seasonal = seasonal_mean(h, h.size, p, self.max_days)
        if seasonal is None:
            return clip_forecast(recent_mean(h, h.size, self.lookback))
        return clip_forecast(seasonal)


@dataclass
class PersistencePredictor:
    """The last window's value (0 with no history)."""

    name: str = "persistence"

    def predict(self, history: Sequence[float], windows_per_day: int) -> float:
        h = as_history(history)
        check_period(windows_per_day)
        return clip_forecast(float(h[-1])) if h.size else 0.0
