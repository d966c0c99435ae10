"""Predictors: Eq. 2-4 by hand, baselines, no look-ahead, invariants, and the default's claim."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import LoadForecast, PolicyInputError
from warmserve.policy.holt_winters import _fit_holt_winters, _holt_winters_filter
from warmserve.policy.predictor import (
    DEFAULT_PREDICTOR,
    PREDICTORS,
    CorrectiveSeasonalPredictor,
    HoltWintersPredictor,
    PersistencePredictor,
    SeasonalPredictor,
    WarmPredictor,
    evaluate,
    forecast,
    make_predictor,
    predict_peak_series,
    predict_series,
    recent_weights,
    season_length,
    seasonal_mean,
)


def test_eq2_seasonal_mean_by_hand() -> None:
    h = np.array([1.0, 2, 3, 4, 5, 6])
    assert seasonal_mean(h, 6, period=2, max_days=7) == pytest.approx(3.0)  # (5+3+1)/3
    assert seasonal_mean(h, 6, period=2, max_days=2) == pytest.approx(4.0)  # (5+3)/2
    assert seasonal_mean(h, 1, period=2, max_days=7) is None
    assert SeasonalPredictor(max_days=2).predict(h, 2) == pytest.approx(4.0)


def test_eq3_weights_both_readings() -> None:
    assert list(recent_weights(4)) == [8, 4, 2, 1]  # text: the most recent window weighs most
    assert list(recent_weights(4, recent_first=False)) == [1, 2, 4, 8]  # Eq. 3 as printed
    assert recent_weights(10).sum() == 2**10 - 1  # the paper's denominator 2^N - 1


def test_eq3_eq4_by_hand() -> None:
    # period 2, N = 2, t = 6: P(6) = (3+1+1)/3 = 5/3; errors: lag 1 -> 5 - 1 = 4, lag 2 -> 3 - 1 = 2
    h = [1.0, 1, 1, 1, 3, 5]
    text = CorrectiveSeasonalPredictor(lookback=2)
    printed = CorrectiveSeasonalPredictor(lookback=2, recent_first=False)
    hh = np.asarray(h)
    assert text.correction(hh, 6, 2) == pytest.approx((4 * 2 + 2 * 1) / 3)
    assert printed.correction(hh, 6, 2) == pytest.approx((4 * 1 + 2 * 2) / 3)
    assert text.predict(h, 2) == pytest.approx(5 / 3 + 10 / 3)  # Eq. 4: P + Δ
    assert printed.predict(h, 2) == pytest.approx(5 / 3 + 8 / 3)


def test_eq3_skips_windows_without_seasonal_history() -> None:
    # period 3, t = 4: lag 1 (window 3) has P = L[0]; lag 2 (window 2) has no previous day.
    h = [2.0, 0, 0, 5]
    csp = CorrectiveSeasonalPredictor(lookback=2)
    assert csp.correction(np.asarray(h), 4, 3) == pytest.approx(5 - 2)
    assert csp.predict(h, 3) == pytest.approx(0 + 3)  # P(4) = L[1] = 0


def test_eq4_never_negative() -> None:
    # A falling trend drives P + Δ below 0: clipped.
    h = [10.0, 10, 10, 10, 0, 0, 0]
    assert CorrectiveSeasonalPredictor(lookback=3).predict(h, 4) == 0.0


def test_day_one_fallback_uses_recent_windows() -> None:
    for pred in (CorrectiveSeasonalPredictor(), SeasonalPredictor()):
        assert pred.predict([2.0, 4.0], 288) == pytest.approx((4 * 2 + 2) / 3)
        assert pred.predict([], 288) == 0.0
    assert PersistencePredictor().predict([3.0, 7.0], 288) == 7.0
    assert WarmPredictor().predict([], 288) == 0.0


def test_season_length() -> None:
    assert season_length(300) == 288
    assert season_length(600) == 144
    assert season_length(86400) == 1
    assert season_length(7 * 86400) == 1
    with pytest.raises(PolicyInputError, match="divide a day"):
        season_length(7000)
    with pytest.raises(PolicyInputError, match="whole number of days"):
        season_length(1.5 * 86400)


def test_registry_and_forecast() -> None:
    assert DEFAULT_PREDICTOR == "warm"
    assert set(PREDICTORS) == {
        "warm", "warm-point", "csp", "csp-printed", "seasonal", "persistence", "holt-winters"
    }
    for name in PREDICTORS:
        assert make_predictor(name).name == name
    printed = make_predictor("csp-printed")
    assert isinstance(printed, CorrectiveSeasonalPredictor) and not printed.recent_first
    assert make_predictor("csp").recent_first
    with pytest.raises(PolicyInputError, match="unknown predictor 'nope'"):
        make_predictor("nope")
    fc = forecast([1.0, 2, 3], [0.5, 0.5, 0.5], 2, "persistence")
    assert fc == LoadForecast(avg=3.0, peak=3.0)  # peak raised to avg
    with pytest.raises(PolicyInputError, match="same length"):
        forecast([1.0], [1.0, 2.0], 2)
    with pytest.raises(PolicyInputError, match="windows_per_day"):
        PersistencePredictor().predict([1.0], 0)
    with pytest.raises(PolicyInputError, match="history"):
        PersistencePredictor().predict([1.0, -1.0], 1)


def test_forecast_uses_the_coverage_peak_of_the_default() -> None:
    """``warm``'s peak is its calibrated upper forecast; ``warm-point``'s the point forecast."""
    h = _series(4, 12, seed=11)
    peak = h * 1.4
    fc = forecast(h, peak, 12)
    warm = make_predictor("warm")
    assert isinstance(warm, WarmPredictor)
    assert fc.avg == pytest.approx(warm.predict(h, 12))
    assert fc.peak == pytest.approx(max(warm.predict_peak(peak, 12), fc.avg))
    point = forecast(h, peak, 12, "warm-point")
    assert point.avg == fc.avg
    assert point.peak == pytest.approx(max(make_predictor("warm").predict(peak, 12), point.avg))
    # on a noisy series the upper forecast sits above the point forecast
    assert fc.peak > point.peak
    assert forecast(h, peak, 12, "csp").peak == pytest.approx(
        max(CorrectiveSeasonalPredictor().predict(peak, 12), forecast(h, peak, 12, "csp").avg)
    )


def test_evaluate_by_hand() -> None:
    ev = evaluate(PersistencePredictor(), [1.0, 2, 4, 0, 2], 1, start=1)
    # predictions 1, 2, 4, 0 for actuals 2, 4, 0 (excluded), 2
    assert ev.rel_error == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert ev.under_rate == pytest.approx(3 / 4)
    assert ev.windows == 4
    assert ev.quality is not None
    assert ev.quality.volume_weighted_error == pytest.approx((1 + 2 + 4 + 2) / 8)
    assert ev.quality.coverage == pytest.approx(1 / 4)  # only the 0 window is covered
    # a floor (the average forecast) raises the predictions before scoring
    ev = evaluate(PersistencePredictor(), [1.0, 2, 4, 0, 2], 1, start=1, floor=[9.0] * 5)
    assert list(ev.predictions) == [0.0, 9.0, 9.0, 9.0, 9.0]
    assert ev.quality is not None and ev.quality.coverage == 1.0
    with pytest.raises(PolicyInputError, match="floor"):
        evaluate(PersistencePredictor(), [1.0, 2, 4], 1, start=1, floor=[1.0])
    with pytest.raises(PolicyInputError, match="evaluation start"):
        evaluate(PersistencePredictor(), [1.0, 2.0], 1, start=2)


def test_holt_winters_filter_reproduces_statsmodels() -> None:
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    rng = np.random.default_rng(1)
    period = 12
    t = np.arange(120)
    h = 10 + 3 * np.sin(2 * np.pi * t / period) + 0.05 * t + rng.normal(0, 0.3, t.size)
    par = _fit_holt_winters(h, period)
    assert par is not None and len(par.seasons) == period
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = ExponentialSmoothing(
            h, trend="add", damped_trend=True, seasonal="add", seasonal_periods=period,
            initialization_method="heuristic",
        ).fit(use_brute=False)
    ours = _holt_winters_filter(par, h, h.size + 1)
    np.testing.assert_allclose(ours[:-1], fit.fittedvalues, rtol=1e-9, atol=1e-9)
    assert ours[-1] == pytest.approx(float(fit.forecast(1)[0]))


def _series(days: int, per_day: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(days * per_day)
    base = 50 + 30 * np.sin(2 * np.pi * t / per_day)
    return np.maximum(0.0, base * rng.lognormal(0, 0.2, t.size))


@pytest.mark.parametrize("series_fn", [predict_series, predict_peak_series])
@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_no_look_ahead(name: str, series_fn: object) -> None:
    """Changing windows t.. never changes the predictions for windows 0..t (average and peak)."""
    assert callable(series_fn)
    h = _series(4, 12, seed=3)
    pred = make_predictor(name)
    base = series_fn(pred, h, 12)
    for cut in (5, 13, 30):
        changed = h.copy()
        changed[cut:] = changed[cut:] * 3 + 7
        again = series_fn(make_predictor(name), changed, 12)
        np.testing.assert_allclose(again[: cut + 1], base[: cut + 1], rtol=1e-12)


@pytest.mark.parametrize(
    "name", ["warm", "warm-point", "csp", "csp-printed", "seasonal", "persistence"]
)
def test_predict_all_matches_predict(name: str) -> None:
    h = _series(3, 8, seed=5)
    pred = make_predictor(name)
    every = predict_series(pred, h, 8)
    peaks = predict_peak_series(pred, h, 8)
    peak_one = getattr(pred, "predict_peak", pred.predict)
    for t in (0, 1, 7, 8, 9, 20, h.size - 1):
        assert every[t] == pytest.approx(pred.predict(h[:t], 8), rel=1e-9, abs=1e-12)
        assert peaks[t] == pytest.approx(peak_one(h[:t], 8), rel=1e-9, abs=1e-12)


def test_holt_winters_predict_all_at_refit_points() -> None:
    h = _series(4, 12, seed=7)
    hw = HoltWintersPredictor()
    every = predict_series(hw, h, 12)
    for t in (24, 36):  # refit points: forecasts equal a fresh fit on history[:t]
        assert every[t] == pytest.approx(hw.predict(h[:t], 12), rel=1e-9)


histories = st.lists(
    st.one_of(
        st.just(0.0),
        st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
    ),
    min_size=0,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(h=histories, per_day=st.integers(min_value=1, max_value=12))
def test_predictions_finite_and_non_negative(h: list[float], per_day: int) -> None:
    for name in ("warm", "warm-point", "csp", "csp-printed", "seasonal", "persistence"):
        value = make_predictor(name).predict(h, per_day)
        assert math.isfinite(value) and value >= 0, name
        series = predict_series(make_predictor(name), h, per_day)
        assert np.all(np.isfinite(series)) and np.all(series >= 0), name
        peaks = predict_peak_series(make_predictor(name), h, per_day)
        assert np.all(np.isfinite(peaks)) and np.all(peaks >= 0), name
        fc = forecast(h, h, per_day, name)
        assert fc.peak >= fc.avg >= 0


@settings(max_examples=10, deadline=None)
@given(h=st.lists(st.floats(min_value=0, max_value=1e4), min_size=0, max_size=30))
def test_holt_winters_finite_and_non_negative(h: list[float]) -> None:
    series = predict_series(HoltWintersPredictor(), h, 4)
    assert np.all(np.isfinite(series)) and np.all(series >= 0)
