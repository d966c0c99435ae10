"""Per-model load history: per-window average and peak, the predictor's input (§5.1).

The predictor (Eq. 2-4) needs days of per-window average and peak load: Eq. 2 averages the
same window over the previous D days.  Windows are aligned to the clock the executor runs on
(index = floor(time / W)), so a controller restarted later knows exactly which windows it
missed.  Missed windows are stored as NaN and imputed at prediction time (same window the
previous day, else the last known value) because the predictors require a contiguous series.
At most ``DEFAULT_DAYS`` days are kept.

Pure (no I/O): the operator persists it (``warmserve.api.history``: float16 in a
ConfigMap), the simulator seeds it from the trace's history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DEFAULT_DAYS = 8


class HistoryError(ValueError):
    """A stored history that cannot be read; the message says which key is wrong."""


@dataclass
class LoadHistory:
    """Contiguous per-window (avg, peak) of one model, ending at window ``end`` (exclusive)."""

    window_s: float
    end: int = 0  # index of the window after the last stored one
    avg: np.ndarray = field(default_factory=lambda: np.zeros(0))
    peak: np.ndarray = field(default_factory=lambda: np.zeros(0))
    max_windows: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise HistoryError(f"window_s must be > 0, got {self.window_s}")
        if self.avg.shape != self.peak.shape:
            raise HistoryError("avg and peak series differ in length")
        if self.max_windows <= 0:
            self.max_windows = max(round(DEFAULT_DAYS * 86400 / self.window_s), 16)

    @property
    def start(self) -> int:
        return self.end - len(self.avg)

    def __len__(self) -> int:
        return len(self.avg)

    def record(self, index: int, avg: float, peak: float) -> None:
        """Store window ``index``; windows skipped since the last one become NaN (unknown).

        A window at or before the last stored one overwrites it (a re-closed window after a
        restart), so recording is idempotent.
        """
        if not (math.isfinite(avg) and math.isfinite(peak)) or avg < 0 or peak < 0:
            raise HistoryError(f"window {index}: load must be finite and >= 0, got {avg}, {peak}")
        if len(self.avg) == 0:
            self.avg = np.array([avg], dtype=np.float64)
            self.peak = np.array([peak], dtype=np.float64)
            self.end = index + 1
        elif index < self.start:
            return  # older than what we keep
        elif index < self.end:
            self.avg[index - self.start] = avg
            self.peak[index - self.start] = peak
        else:
            gap = index - self.end
            if gap >= self.max_windows:
                self.avg = np.zeros(0)
                self.peak = np.zeros(0)
                self.record(index, avg, peak)
                return
            pad = np.full(gap, np.nan)
            self.avg = np.concatenate([self.avg, pad, [avg]])
            self.peak = np.concatenate([self.peak, pad, [peak]])
            self.end = index + 1
        if len(self.avg) > self.max_windows:
            self.avg = self.avg[-self.max_windows :]
            self.peak = self.peak[-self.max_windows :]

    def series(
        self, until: int | None = None, windows_per_day: int = 0
    ) -> tuple[list[float], list[float]]:
        """(avg, peak) up to window ``until`` (exclusive), NaN imputed, for the predictor.

        Windows between the last stored one and ``until`` (operator down or just started) are
        imputed too, so the predictor sees a series that ends right before the predicted window.
        """
        if len(self.avg) == 0:
            return [], []
        until = self.end if until is None else until
        gap = max(until - self.end, 0)
        if gap >= self.max_windows:
            return [], []
        avg = np.concatenate([self.avg, np.full(gap, np.nan)])
        peak = np.concatenate([self.peak, np.full(gap, np.nan)])
        return _impute(avg, windows_per_day).tolist(), _impute(peak, windows_per_day).tolist()


def _impute(values: np.ndarray, windows_per_day: int) -> np.ndarray:
    """Fill NaN with the same window a day earlier (if known), else the last known value, else 0."""
    out = values.copy()
    last = 0.0
    for i in range(len(out)):
        if math.isnan(out[i]):
            j = i - windows_per_day
            out[i] = out[j] if windows_per_day > 0 and j >= 0 and not math.isnan(out[j]) else last
        last = out[i]
    return out
