"""Per-model load history that survives operator restarts.

The predictor (WarmServe §5.1, Eq. 2-4) needs days of per-window average and peak load: Eq. 2
averages the same window over the previous D days.  An operator restart must not lose that, so
the history lives in the cluster, not in the operator's memory.

Where and why: one ConfigMap per ModelDeployment, ``warmserve-history-<deployment UID>`` in
the *operator's own namespace* (the chart's release namespace), with the two series as base64
of little-endian float16 arrays.  Least privilege (issue 16, H3): the operator may write
ConfigMaps only there (a namespaced Role), never in the namespaces its users own; the UID
names it uniquely across namespaces.  No ownerReference can cross namespaces, so the teardown
deletes it with the deployment and the loop removes any whose UID no deployment has.

* Compact: 8 days of 5-minute windows are 2 x 2,304 values x 2 bytes = 9 KiB (12 KiB as base64),
  far below the 1 MiB object limit; float16 keeps ~3 significant digits, plenty for "requests in
  flight", and saturates at 65,504 (documented; a model that hot needs a larger float).
* Not the ModelDeployment itself: writing an annotation every window would bump the object's
  resourceVersion, wake every watcher and (for kopf) look like a change to handle; status is
  for what a person reads, and is rewritten wholesale.  A separate object is written once a
  window by one writer (the leader), and it is deleted with the deployment.
* Windows are aligned to wall-clock time (index = floor(unix_time / W)), so a restarted operator
  knows exactly which windows it missed.  Missed windows are stored as NaN and imputed at
  prediction time (same window the previous day, else the last known value) because the
  predictors require a contiguous series.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMAT = "warmserve.io/load-history/v1"
DEFAULT_DAYS = 8
F16_MAX = float(np.finfo(np.float16).max)


class HistoryError(ValueError):
    """A stored history that cannot be read; the message says which key is wrong."""


def _encode(values: np.ndarray) -> str:
    arr = np.clip(values.astype(np.float64), 0.0, F16_MAX).astype("<f2")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def _decode(text: str, key: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise HistoryError(f"history key {key!r} is not base64: {exc}") from exc
    if len(raw) % 2:
        raise HistoryError(f"history key {key!r} has an odd byte count ({len(raw)})")
    return np.frombuffer(raw, dtype="<f2").astype(np.float64)


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

    # ------------------------------------------------------------------ ConfigMap (de)serialise

    def to_data(self, model: str) -> dict[str, str]:
        return {
            "format": FORMAT,
            "model": model,
            "windowSeconds": repr(float(self.window_s)),
            "endWindow": str(int(self.end)),
            "avg": _encode(self.avg),
            "peak": _encode(self.peak),
        }

    @classmethod
    def from_data(cls, data: dict[str, Any], window_s: float) -> LoadHistory:
        """Read ConfigMap data; a different window length starts a fresh history."""
        if data.get("format") != FORMAT:
            raise HistoryError(f"history format {data.get('format')!r} is not {FORMAT!r}")
        try:
            stored_w = float(data["windowSeconds"])
            end = int(data["endWindow"])
        except (KeyError, ValueError) as exc:
            raise HistoryError(f"history is missing windowSeconds/endWindow: {exc}") from exc
        if abs(stored_w - window_s) > 1e-9:
            return cls(window_s=window_s)
        avg = _decode(str(data.get("avg", "")), "avg")
        peak = _decode(str(data.get("peak", "")), "peak")
        if avg.shape != peak.shape:
            raise HistoryError("history avg and peak differ in length")
        return cls(window_s=window_s, end=end, avg=avg.copy(), peak=peak.copy())


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


HISTORY_PREFIX = "warmserve-history-"
OWNER_LABEL = "warmserve.io/owner-uid"


def configmap_name(uid: str) -> str:
    """Name of the history ConfigMap of the deployment with this UID (DNS-1123)."""
    return f"{HISTORY_PREFIX}{uid}"[:253]
