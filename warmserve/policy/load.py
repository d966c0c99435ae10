"""Per-window average and peak load (WarmServe §2.2, §5.1).

WarmServe predicts, for every model and every window of ``W`` seconds, the *average* and the
*peak* number of requests in flight (§2.2: "the average and maximum number of concurrent
requests within a given time window").  This module turns raw observations into those two
numbers, exactly rather than by sampling:

- :func:`inflight_load` — from request arrivals and durations, an event sweep of the piecewise
  constant in-flight count.  A request occupies the half-open interval
  ``[arrival, arrival + duration)``, so a request that finishes at ``t`` and one that arrives at
  ``t`` never overlap, and events at one instant are applied together before anything is
  measured (a zero-length blip is not a peak).
- :func:`request_durations` — the paper (§2.2) derives a request's running time from its input
  and output lengths; we use ``input / prefill_tok_s + output / decode_tok_s``.
- :func:`series_load` — for count series (requests per fixed step), the window's mean rate and
  its largest per-step rate, both in requests per second, so ``peak >= avg`` always.
- :class:`WindowLoadTracker` — the incremental form of the sweep, for the simulator, the node
  agent and the operator, which see the in-flight count change one event at a time.

Pure: no I/O; inputs are sequences of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from warmserve.policy.cluster import PolicyInputError

# Default speed profile.  5000 prefill tokens/s and 30 decode tokens/s per request are typical of
# a 7-13B model on one A100/H100 under vLLM at moderate batch (docs/prediction.md gives sources);
# they only scale durations, so the shape of the load over a day is what matters for prediction.
DEFAULT_PREFILL_TOK_S = 5000.0
DEFAULT_DECODE_TOK_S = 30.0


@dataclass(frozen=True, slots=True)
class WindowLoad:
    """Load of one window ``[start_s, start_s + W)``: time-average and peak."""

    start_s: float
    avg: float
    peak: float


def _finite_nonneg(values: np.ndarray, name: str) -> None:
    if values.size and not np.all(np.isfinite(values)):
        raise PolicyInputError(f"{name} must be finite")
    if values.size and np.any(values < 0):
        raise PolicyInputError(f"{name} must be >= 0 (found {float(values.min())})")


def _positive(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise PolicyInputError(f"{name} must be a positive number (got {value})")
    return value


def request_durations(
    input_tokens: Sequence[float],
    output_tokens: Sequence[float],
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S,
    decode_tok_s: float = DEFAULT_DECODE_TOK_S,
) -> np.ndarray:
    """Seconds each request is in flight: prefill time plus decode time (§2.2)."""
    prefill = _positive(prefill_tok_s, "prefill_tok_s")
    decode = _positive(decode_tok_s, "decode_tok_s")
    inp = np.asarray(input_tokens, dtype=float)
    out = np.asarray(output_tokens, dtype=float)
    if inp.shape != out.shape or inp.ndim != 1:
        raise PolicyInputError("input_tokens and output_tokens must be 1-D and the same length")
    _finite_nonneg(inp, "input_tokens")
    _finite_nonneg(out, "output_tokens")
    return inp / prefill + out / decode


def _window_edges(start_s: float, end_s: float, window_s: float) -> np.ndarray:
    n = max(1, math.ceil((end_s - start_s) / window_s - 1e-9))
    return start_s + window_s * np.arange(n + 1, dtype=float)


def inflight_load(
    arrivals: Sequence[float],
    durations: Sequence[float],
    window_s: float,
    start_s: float = 0.0,
    end_s: float | None = None,
) -> list[WindowLoad]:
    """Exact per-window time-average and peak of requests in flight (event sweep).

    Windows are ``[start_s + k*W, start_s + (k+1)*W)`` for as many ``k`` as needed to cover
    ``[start_s, end_s)`` (``end_s`` default: the last arrival), each averaged over its full
    length ``W``.  Every request counts wherever it overlaps a window (requests that arrived
    before ``start_s`` carry in).  With the default ``end_s`` the last window may extend past
    the last arrival and so under-state the load; callers that want only complete windows pass
    an ``end_s`` on a window boundary (``warmserve predict`` does).
    """
    w = _positive(window_s, "window_s")
    arr = np.asarray(arrivals, dtype=float)
    dur = np.asarray(durations, dtype=float)
    if arr.shape != dur.shape or arr.ndim != 1:
        raise PolicyInputError("arrivals and durations must be 1-D and the same length")
    _finite_nonneg(dur, "durations")
    if arr.size and not np.all(np.isfinite(arr)):
        raise PolicyInputError("arrivals must be finite")
    if end_s is None:
        end_s = float(arr.max()) if arr.size else start_s + w
    if end_s <= start_s:
        raise PolicyInputError(f"end_s ({end_s}) must be after start_s ({start_s})")
    edges = _window_edges(float(start_s), float(end_s), w)
    if arr.size == 0:
        return [WindowLoad(float(e), 0.0, 0.0) for e in edges[:-1]]

    # Piecewise-constant in-flight count: value after applying all events at each distinct time.
    times = np.concatenate([arr, arr + dur])
    delta = np.concatenate([np.ones(arr.size), -np.ones(arr.size)])
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    # np.unique(times, return_index=True) of the sorted times, without sorting them again
    is_first = np.empty(times.size, dtype=bool)
    is_first[0] = True
    np.not_equal(times[1:], times[:-1], out=is_first[1:])
    first = np.flatnonzero(is_first)
    uniq = times[first]
    cum = np.cumsum(delta)
    last = np.append(first[1:], times.size) - 1
    level_at_uniq = cum[last] if times.size else np.zeros(0)

    # Breakpoints: event times inside the span plus every window edge.
    inside = uniq[(uniq > edges[0]) & (uniq < edges[-1])]
    # np.union1d(inside, edges), both sorted: merge the few edges in instead of sorting again
    merged = np.insert(inside, np.searchsorted(inside, edges), edges)
    keep = np.empty(merged.size, dtype=bool)
    keep[0] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    points = merged[keep]
    pos = np.searchsorted(uniq, points, side="right") - 1
    levels = np.where(pos >= 0, level_at_uniq[np.clip(pos, 0, None)], 0.0)
    seg_len = np.diff(points)
    seg_level = levels[:-1]
    seg_win = np.searchsorted(edges, points[:-1], side="right") - 1
    nwin = edges.size - 1
    area = np.bincount(seg_win, weights=seg_level * seg_len, minlength=nwin)
    peak = np.zeros(nwin)
    held = seg_len > 0
    np.maximum.at(peak, seg_win[held], seg_level[held])
    return [
        WindowLoad(float(edges[k]), float(area[k] / w), float(peak[k])) for k in range(nwin)
    ]


def series_load(
    values: Sequence[float],
    step_s: float,
    window_s: float,
    start_s: float = 0.0,
    values_are_rates: bool = False,
) -> list[WindowLoad]:
    """Per-window mean rate and peak per-step rate of a contiguous count series.

    ``values[i]`` is the count of requests arriving in step ``[start_s + i*step_s, ...)`` (or, with
    ``values_are_rates``, already a per-second rate such as BurstGPT's ``tokens_per_s``).  Both
    outputs are per second: ``avg`` = window total / ``window_s``; ``peak`` = the largest step's
    count / ``step_s``.  Hence ``peak >= avg``.  ``window_s`` must be a whole multiple of
    ``step_s``; a trailing partial window is dropped (it would under-state the load).
    """
    step = _positive(step_s, "step_s")
    w = _positive(window_s, "window_s")
    ratio = w / step
    k = round(ratio)
    if k < 1 or abs(ratio - k) > 1e-9 * max(1.0, ratio):
        raise PolicyInputError(
            f"window ({w:g} s) must be a whole multiple of the series step ({step:g} s)"
        )
    vals = np.asarray(values, dtype=float)
    if vals.ndim != 1:
        raise PolicyInputError("values must be 1-D")
    _finite_nonneg(vals, "counts")
    rates = vals if values_are_rates else vals / step
    nwin = vals.size // k
    if nwin == 0:
        raise PolicyInputError(
            f"series spans {vals.size * step:g} s, shorter than one window ({w:g} s)"
        )
    blocks = rates[: nwin * k].reshape(nwin, k)
    avg = blocks.mean(axis=1)
    peak = blocks.max(axis=1)
    return [
        WindowLoad(float(start_s + i * w), float(min(avg[i], peak[i])), float(peak[i]))
        for i in range(nwin)
    ]


class WindowLoadTracker:
    """Incremental per-window load: the same result as :func:`inflight_load`, one event at a time.

    Call :meth:`update` whenever the in-flight count changes (several updates at the same ``t``
    are fine: only the last one is held over time, exactly like the sweep, so a momentary value
    is never a peak).  Call :meth:`close` at a window boundary to get that window's
    :class:`WindowLoad`, or :meth:`advance` to close every boundary up to ``t``.  The average is
    over the time actually elapsed in the window, so a window closed early is not diluted.
    """

    def __init__(self, window_s: float, start_s: float = 0.0, inflight: float = 0.0) -> None:
        self.window_s = _positive(window_s, "window_s")
        if not math.isfinite(start_s):
            raise PolicyInputError("start_s must be finite")
        self._check_level(inflight)
        self._window_start = float(start_s)
        self._last_t = float(start_s)
        self._level = float(inflight)
        self._area = 0.0
        self._peak = 0.0

    @staticmethod
    def _check_level(inflight: float) -> None:
        if not math.isfinite(inflight) or inflight < 0:
            raise PolicyInputError(f"inflight must be a finite number >= 0 (got {inflight})")

    @property
    def window_start(self) -> float:
        """Start of the window currently being measured."""
        return self._window_start

    @property
    def peak_so_far(self) -> float:
        """The current window's peak up to now (the level held now included)."""
        return max(self._peak, self._level)

    @property
    def inflight(self) -> float:
        """The in-flight count most recently reported."""
        return self._level

    def _hold_until(self, t: float) -> None:
        if not math.isfinite(t):
            raise PolicyInputError("t must be finite")
        if t < self._last_t:
            raise PolicyInputError(f"time went backwards: {t} < {self._last_t}")
        if t > self._last_t:
            self._area += self._level * (t - self._last_t)
            self._peak = max(self._peak, self._level)
            self._last_t = t

    def update(self, t: float, inflight: float) -> None:
        """The in-flight count became ``inflight`` at time ``t`` (seconds, non-decreasing)."""
        if not (inflight >= 0 and inflight != math.inf):  # _check_level, inline (per request)
            self._check_level(inflight)
        last = self._last_t
        if t > last and t != math.inf:  # _hold_until's common case, inline
            level = self._level
            self._area += level * (t - last)
            if level > self._peak:
                self._peak = level
            self._last_t = t
        else:
            self._hold_until(t)
        self._level = float(inflight)

    def close(self, t: float) -> WindowLoad:
        """End the current window at ``t``; the next window starts at ``t``."""
        self._hold_until(t)
        length = t - self._window_start
        if length <= 0:
            raise PolicyInputError(
                f"close({t}) must be after the window start ({self._window_start})"
            )
        avg = self._area / length
        result = WindowLoad(self._window_start, avg, max(self._peak, avg))
        self._window_start = t
        self._area = 0.0
        self._peak = 0.0
        return result

    def advance(self, t: float) -> list[WindowLoad]:
        """Close every window whose end ``window_start + window_s`` is at or before ``t``."""
        closed: list[WindowLoad] = []
        while self._window_start + self.window_s <= t:
            closed.append(self.close(self._window_start + self.window_s))
        self._hold_until(t)
        return closed
