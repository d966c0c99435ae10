"""``warm``'s streaming members, the coverage-oriented peak, and the forecast cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy import warm_predictor as wp
from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.peak_forecast import LevelPool, UpperForecaster, linear_quantile
from warmserve.policy.predictor import forecast, make_predictor
from warmserve.policy.seasonal import CorrectiveSeasonalPredictor
from warmserve.policy.streaming import Tail

values = st.one_of(st.just(0.0), st.floats(min_value=0.01, max_value=1e4))
series_st = st.lists(values, min_size=0, max_size=45)


def _batch_log_ar(h: np.ndarray, lags: tuple[int, ...], fill: bool, t: int) -> float:
    """Forecast for window t by refitting the ridge from scratch on every target before t."""
    level = math.nan
    levels, d, valid = [], [], []
    for i, v in enumerate(h[:t]):
        ok = i >= 1 and v > 0 and not math.isnan(level)
        d.append(math.log(v) - level if ok else 0.0)
        valid.append(ok)
        if v > 0:
            level = math.log(v)
        elif not fill:
            level = math.nan
        levels.append(level)
    if t == 0 or math.isnan(levels[-1]):
        return 0.0

    def x(i: int) -> np.ndarray:
        return np.array([d[i - lag] if i - lag >= 1 else 0.0 for lag in lags])

    rows = [i for i in range(t) if valid[i]]
    k = len(lags)
    a = np.eye(k) + sum((np.outer(x(i), x(i)) for i in rows), np.zeros((k, k)))
    b = sum((x(i) * d[i] for i in rows), np.zeros(k))
    step = float(np.clip(x(t) @ np.linalg.solve(a, b), -3, 3))
    return math.exp(levels[-1] + step)


@settings(max_examples=40, deadline=None)
@given(h=series_st, fill=st.booleans(), per_day=st.integers(min_value=1, max_value=6))
def test_streaming_log_ar_equals_batch_ridge(h: list[float], fill: bool, per_day: int) -> None:
    arr = np.asarray(h)
    lags = wp.ar_lags(per_day)
    ar = wp.LogAR(lags, fill)
    for t in range(arr.size + 1):
        assert ar.forecast() == pytest.approx(_batch_log_ar(arr, lags, fill, t), rel=1e-7)
        if t < arr.size:
            ar.observe(float(arr[t]))


@settings(max_examples=40, deadline=None)
@given(h=series_st, per_day=st.integers(min_value=1, max_value=6))
def test_streaming_csp_member_is_eq2_to_eq4(h: list[float], per_day: int) -> None:
    """warm's CSP member is bit-identical to the ``csp`` predictor at every window."""
    arr = np.asarray(h, dtype=float)
    state = wp.EnsembleState(per_day, 10, 7)
    csp = CorrectiveSeasonalPredictor()
    for t in range(arr.size + 1):
        members, _ = state.members(arr[:t])
        assert members[1] == csp.predict(arr[:t], per_day)
        state.forecast(arr[:t])
        if t < arr.size:
            state.observe(arr[: t + 1])


@settings(max_examples=25, deadline=None)
@given(
    h=st.lists(values, min_size=1, max_size=40),
    per_day=st.integers(min_value=1, max_value=5),
    calls=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12),
)
def test_cache_never_changes_a_result(h: list[float], per_day: int, calls: list[int]) -> None:
    """Any order of calls (growing, repeated, shrinking histories) gives the fresh results."""
    arr = np.asarray(h)
    pred = make_predictor("warm")
    assert isinstance(pred, wp.WarmPredictor)
    fresh_avg = pred.predict_all(arr, per_day)
    fresh_peak = pred.predict_peak_all(arr, per_day)
    for n in [*calls, *range(arr.size)]:
        n = min(n, arr.size - 1)
        assert pred.predict(arr[:n], per_day) == pytest.approx(fresh_avg[n], rel=1e-12, abs=0)
        assert pred.predict_peak(arr[:n], per_day) == pytest.approx(
            fresh_peak[n], rel=1e-12, abs=0
        )
    wp.clear_cache()
    assert pred.predict_peak(arr[: arr.size - 1], per_day) == fresh_peak[-1]
    # a second run from the same history starts from the checkpoint (a copy: advancing the
    # first run's state does not change it) and gives the same forecasts
    half = arr.size // 2
    first = [pred.predict(arr[:n], per_day) for n in range(half, arr.size)]
    assert len(wp._checkpoints) >= 1
    again = [pred.predict(arr[:n], per_day) for n in range(half, arr.size)]
    assert again == first == [pytest.approx(v, rel=1e-12, abs=0) for v in fresh_avg[half:]]


def test_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wp, "CACHE_SIZE", 5)
    wp.clear_cache()
    pred = wp.WarmPredictor()
    for i in range(12):
        pred.predict([float(i), 1.0, 2.0], 2)
    assert len(wp._cache) == 5
    wp.clear_cache()


@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(
        st.tuples(st.integers(min_value=-3, max_value=3), st.floats(-1, 1)),
        min_size=0,
        max_size=30,
    ),
    level=st.integers(min_value=-4, max_value=4),
    k=st.integers(min_value=1, max_value=10),
    keep=st.integers(min_value=1, max_value=40),
)
def test_level_pool_nearest_is_brute_force(
    entries: list[tuple[int, float]], level: int, k: int, keep: int
) -> None:
    """The k smallest by (distance, -window) among the last ``keep`` windows (ties forced)."""
    pool = LevelPool(keep)
    for window, (lv, res) in enumerate(entries):
        pool.add(window, None if lv == 3 else float(lv), res)  # level 3: a window left out
    alive = [
        (w, float(lv), r)
        for w, (lv, r) in enumerate(entries)
        if w >= len(entries) - keep and lv != 3
    ]
    assert len(pool) == len(alive)
    brute = sorted(alive, key=lambda e: (abs(e[1] - level), -e[0]))[:k]
    assert sorted(pool.nearest(float(level), k).tolist()) == sorted(r for _, _, r in brute)
    with pytest.raises(ValueError, match="expected"):
        pool.add(len(entries) + 1, 0.0, 0.0)


@given(
    vals=st.lists(st.floats(-100, 100), min_size=1, max_size=50),
    level=st.floats(0, 1),
)
def test_linear_quantile_is_numpys(vals: list[float], level: float) -> None:
    assert linear_quantile(vals, level) == pytest.approx(
        float(np.quantile(vals, level)), rel=1e-9, abs=1e-9
    )


def test_tail_keeps_the_last_values() -> None:
    tail = Tail(3)
    for i in range(50):
        tail.append(float(i))
    assert tail.end == 50
    assert list(tail.last(10)) == [47.0, 48.0, 49.0]
    assert list(tail.get(np.array([47, 49]))) == [47.0, 49.0]
    with pytest.raises(IndexError):
        tail.get(np.array([46]))
    with pytest.raises(ValueError):
        tail.last(2)[0] = 1.0  # a read-only view


def _regimes(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(6 * 48)
    daily = 40 + 30 * np.sin(2 * np.pi * t / 48)
    shift = np.where(t < 150, 10.0, 60.0)
    return {
        "iid lognormal": rng.lognormal(2, 0.5, t.size),
        "daily, noisy": daily * rng.lognormal(0, 0.3, t.size),
        "level shift": shift * rng.lognormal(0, 0.2, t.size),
        "sparse bursts": rng.poisson(0.3, t.size) * rng.lognormal(3, 1, t.size),
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_upper_forecast_covers_the_target_share(seed: int) -> None:
    """The realised coverage stays near the target on very different series (ACI)."""
    for label, h in _regimes(seed).items():
        up = make_predictor("warm")
        peaks = up.predict_peak_all(h, 48)  # type: ignore[attr-defined]
        point = up.predict_all(h, 48)  # type: ignore[attr-defined]
        cov = float(np.mean(h[48:] <= peaks[48:]))
        assert cov >= 0.88, (label, cov)
        assert cov <= 0.99, (label, cov)  # not trivially covering
        assert float(np.mean(h[48:] <= point[48:])) < cov, label


def test_lower_target_lower_forecast() -> None:
    h = _regimes(4)["daily, noisy"]
    hi = wp.WarmPredictor(peak_coverage=0.95).predict_peak_all(h, 48)
    lo = wp.WarmPredictor(peak_coverage=0.6).predict_peak_all(h, 48)
    assert np.mean(h[48:] <= lo[48:]) < np.mean(h[48:] <= hi[48:])
    assert np.sum(lo) < np.sum(hi)


def test_upper_forecaster_zero_history_forecasts_zero() -> None:
    up = UpperForecaster(wp.EnsembleState(4, 10, 7), 4)
    zeros = np.zeros(20)
    for t in range(20):
        assert up.forecast(zeros[:t]) == 0.0
        up.observe(zeros[: t + 1])
    assert forecast([0.0] * 20, [0.0] * 20, 4).peak == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_coverage": 1.0}, "peak coverage target"),
        ({"peak_coverage": 0.2}, "peak coverage target"),
        ({"aci_step": -0.1}, "ACI step"),
        ({"neighbours": 0}, "neighbours"),
        ({"calibration_days": 0}, "calibration days"),
        ({"offset": 0.0}, "offset"),
    ],
)
def test_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(PolicyInputError, match=message):
        wp.WarmPredictor(**kwargs)  # type: ignore[arg-type]


def test_idle_model_asks_for_no_burst_after_the_calibration_pool() -> None:
    """A model idle for the whole pool (7 days) forecasts peak 0, so Eq. 6 asks for no replica."""
    p = 4
    busy = np.random.default_rng(0).lognormal(1, 0.5, 2 * p)
    h = np.r_[busy, np.zeros(8 * p)]
    warm = wp.WarmPredictor()
    assert warm.predict_peak(h, p) == 0.0
    assert forecast(h, h, p) == forecast(np.zeros(3), np.zeros(3), p)
    assert warm.predict_peak(h[: 3 * p], p) > 0  # idle for a day only: still a small peak
