"""Oracle lower bounds for the predictor's goals (used by ``bench/predictor_bounds.py``).

Every function here is an *optimistic* forecaster: it is handed information no forecaster has
when the window starts (the window's own average, or the load's smooth rate computed from the
future as well as the past).  What such an oracle cannot reach, no forecaster built from the
history can reach either, as long as the stated assumption holds; docs/prediction.md ("Why the
unmet goals are out of reach") says which assumption each bound rests on and how it was checked.

- :func:`coverage_bound`: given each window's conditional distribution of the actual value (as
  equally likely samples), the least expected over-forecast ``sum E(p - a)+ / sum E a`` of *any*
  forecast ``p_t`` (randomised ones included) whose expected coverage ``mean P(a_t <= p_t)`` is at
  least the target.  Exact: a Lagrangian sweep over the per-window trade-off curves, mixed at the
  boundary, so the windows can share the coverage unevenly (cover the cheap ones, give up on the
  costly ones) — better than any fixed quantile.
- :func:`known_average_samples`: the oracle that knows each window's *actual average* and draws
  its peak from the peak/average ratios of the windows nearest in level.
- :func:`smooth_rate_samples`: the oracle that knows the *smooth rate* (a centred moving average
  over past and future steps) and draws each step's deviation from it from the deviations seen
  at the nearest rate levels; gives the window's peak and average.
- :func:`median_error_floor`: the least expected volume-weighted error ``sum E|p - a| / sum E a``
  of any forecast given those distributions (each window's median).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CoverageBound:
    """The least over-forecast at a coverage (expected under the samples), and the forecasts."""

    coverage: float  # expected coverage reached (the target, up to the mixing)
    over_forecast: float  # sum E(p - a)+ / sum E a at that coverage
    forecasts: np.ndarray  # per window, the deterministic solution just above the target


def _tradeoffs(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per window and candidate forecast (each sample value, and 0): coverage, over, value."""
    s = np.sort(np.asarray(samples, dtype=float), axis=1)
    t, k = s.shape
    cand = np.concatenate([np.zeros((t, 1)), s], axis=1)
    # number of samples <= each sample value (ties: the end of the run), and <= 0
    n_le = np.broadcast_to(np.arange(1, k + 1), (t, k)).copy()
    for j in range(k - 2, -1, -1):
        n_le[:, j] = np.where(s[:, j] == s[:, j + 1], n_le[:, j + 1], n_le[:, j])
    n_le = np.concatenate([(s <= 0).sum(axis=1, keepdims=True), n_le], axis=1)
    csum = np.concatenate([np.zeros((t, 1)), np.cumsum(s, axis=1)], axis=1)
    below = np.take_along_axis(csum, n_le, axis=1)
    cov = n_le / k
    over = (n_le * cand - below) / k
    return cov, over, cand


def coverage_bound(samples: np.ndarray, target: float = 0.9) -> CoverageBound:
    """Least expected over-forecast of any forecast with expected coverage >= ``target``.

    ``samples[t]``: equally likely values of window ``t``'s actual (>= 0).  For a multiplier
    ``mu`` each window picks the candidate maximising ``mu * P(a <= p) - E(p - a)+`` (an optimal
    forecast is always a sample value or 0: between two, coverage is flat and the cost grows);
    the total coverage grows with ``mu``; bisection brackets the target and the two solutions
    are mixed (a randomised forecaster reaches any point between them, and nothing reaches
    below that segment: it is the lower convex hull of the achievable set).
    """
    if not 0 < target < 1:
        raise ValueError(f"target must be in (0, 1) (got {target})")
    samples = np.asarray(samples, dtype=float)
    if samples.ndim != 2 or samples.size == 0 or np.any(samples < 0):
        raise ValueError("samples must be a non-empty (windows, draws) array of values >= 0")
    cov, over, cand = _tradeoffs(samples)
    rows = np.arange(cov.shape[0])
    volume = samples.mean(axis=1).sum()

    def solve(mu: float) -> tuple[float, float, np.ndarray]:
        pick = np.argmax(mu * cov - over, axis=1)  # ties: the lowest candidate
        return cov[rows, pick].mean(), over[rows, pick].sum(), cand[rows, pick]

    lo, hi = 0.0, 1.0
    while solve(hi)[0] < target:
        hi *= 2.0
        if hi > 1e18:
            raise ValueError("target coverage unreachable")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if solve(mid)[0] >= target:
            hi = mid
        else:
            lo = mid
    c_lo, o_lo, _ = solve(lo)
    c_hi, o_hi, p_hi = solve(hi)
    if c_hi - c_lo > 1e-12:
        w = (target - c_lo) / (c_hi - c_lo)
        cost = o_lo + w * (o_hi - o_lo)
    else:
        cost = o_hi
    return CoverageBound(
        coverage=target,
        over_forecast=float(cost / volume) if volume > 0 else 0.0,
        forecasts=p_hi,
    )


def median_error_floor(samples: np.ndarray) -> float:
    """``sum_t E|m_t - a_t| / sum_t E a_t``, ``m_t`` the median: the least VWE of any forecast."""
    samples = np.asarray(samples, dtype=float)
    med = np.median(samples, axis=1, keepdims=True)
    return float(np.abs(samples - med).mean(axis=1).sum() / samples.mean(axis=1).sum())


def nearest_rows(
    level: np.ndarray, pool_level: np.ndarray, k: int, exclude_self: bool
) -> np.ndarray:
    """Indices (into ``pool_level``) of the ``k`` pool entries nearest each ``level``."""
    order = np.argsort(pool_level)
    sorted_level = pool_level[order]
    n = sorted_level.size
    out = np.empty((level.size, k), dtype=np.int64)
    for i, x in enumerate(level):
        pos = int(np.searchsorted(sorted_level, x))
        lo, hi = max(0, pos - k - 1), min(n, pos + k + 1)
        idx = order[lo:hi]
        dist = np.abs(pool_level[idx] - x)
        if exclude_self:
            dist = np.where(idx == i, np.inf, dist)
        out[i] = idx[np.argsort(dist, kind="stable")[:k]]
    return out


def known_average_samples(avg: np.ndarray, peak: np.ndarray, k: int = 100) -> np.ndarray:
    """Samples of each window's peak for an oracle that knows the window's actual average.

    Window ``t`` with average ``A_t > 0``: ``A_t`` times the peak/average ratios of the ``k``
    other windows whose ``log A`` is nearest (ratios shrink as load grows, so they are taken at
    the same level); a window with ``A_t = 0`` has peak 0.
    """
    avg, peak = np.asarray(avg, dtype=float), np.asarray(peak, dtype=float)
    busy = np.flatnonzero(avg > 0)
    ratio = peak[busy] / avg[busy]
    level = np.log(avg[busy])
    out = np.zeros((avg.size, k))
    rows = nearest_rows(level, level, min(k, busy.size - 1), exclude_self=True)
    out[busy, : rows.shape[1]] = avg[busy, None] * ratio[rows]
    if rows.shape[1] < k:
        out[busy, rows.shape[1] :] = out[busy, :1]
    return out


def smooth_rate(values: np.ndarray, bandwidth: int) -> np.ndarray:
    """Centred moving average over ``bandwidth`` steps (odd; shorter at the ends)."""
    values = np.asarray(values, dtype=float)
    half = bandwidth // 2
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(values.size)
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, values.size)
    return (csum[hi] - csum[lo]) / (hi - lo)


def smooth_rate_samples(
    values: np.ndarray,
    steps_per_window: int,
    bandwidth: int,
    k: int = 200,
    given_previous: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(peak samples, average samples, rate) per window for an oracle that knows the smooth rate.

    ``values``: the per-step series (the peak of a window is its largest step, its average the
    mean, in the series' own unit).  ``r`` is the centred moving average over ``bandwidth``
    steps (:func:`smooth_rate`: past *and* future steps, an optimistic oracle).  Window ``t``'s
    steps are drawn as ``max(r_t + d_j, 0)`` where ``d_j`` is the whole block of deviations
    ``v - r`` of window ``j``, for each of the ``k`` windows whose mean rate is nearest window
    ``t``'s (itself excluded): blocks keep the deviations' correlation inside a window, so the
    only assumption is that a window's deviations from the smooth rate are not predictable from
    the windows before it (:func:`deviation_autocorrelation` checks it).  ``given_previous``
    weakens that assumption: the oracle also knows the deviation of the step just before the
    window, and draws from the ``k`` of the ``2k`` nearest-level windows whose own previous step
    deviated most alike (closing the lag-1 autocorrelation a forecaster could use).
    """
    values = np.asarray(values, dtype=float)
    m = steps_per_window
    n = values.size // m
    values = values[: n * m]
    rate = smooth_rate(values, bandwidth).reshape(n, m)
    dev = values.reshape(n, m) - rate
    level = rate.mean(axis=1)
    if given_previous:
        k = min(k, (n - 1) // 2)
        rows = nearest_rows(level, level, 2 * k, exclude_self=True)
        prev = np.concatenate([[0.0], dev[:-1, -1]])
        near = np.argsort(np.abs(prev[rows] - prev[:, None]), axis=1, kind="stable")[:, :k]
        rows = np.take_along_axis(rows, near, axis=1)
    else:
        rows = nearest_rows(level, level, min(k, n - 1), exclude_self=True)
    sim = np.maximum(rate[:, None, :] + dev[rows], 0.0)  # (window, draw, step)
    return sim.max(axis=2), sim.mean(axis=2), level


def deviation_autocorrelation(values: np.ndarray, bandwidth: int, lags: int = 5) -> np.ndarray:
    """Autocorrelation of the deviations from the smooth rate at lags ``1..lags`` steps.

    Near 0: what the smooth rate leaves is not predictable from the steps just before (the
    oracle's independent draws then lose nothing a forecaster could know).
    """
    values = np.asarray(values, dtype=float)
    dev = values - smooth_rate(values, bandwidth)
    dev = dev - dev.mean()
    var = float(dev @ dev)
    return np.array([float(dev[j:] @ dev[:-j]) / var for j in range(1, lags + 1)])
