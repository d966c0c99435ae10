"""Nonlinear forecasters for the bounds behind the predictor's goals
(``bench/predictor_bounds.py``).

Gradient-boosted trees (scikit-learn's ``HistGradientBoostingRegressor``) on the log change of
the load, with the features a linear model on lags would miss: ``warm``'s six members, lags of
the average and the peak, the same time 1, 2 and 7 days back, time of day, and for a ServeGen
model the other models' series and their sum (cross-series).  Two protocols:

- walk-forward (:func:`boosted`): refitted once a day on every window before that day,
  predicting the day's windows one step ahead from the windows before each: the protocol of
  ``warmserve predict --compare`` (no look-ahead), a candidate for the default;
- day-blocked cross-validation (``blocked=True``): each day predicted by a model fitted on
  *every other* day, later days included: more training data than any forecaster has
  (optimistic), but never scored on a window it was fitted on (so it cannot overfit its way
  below the bound, as an in-sample flexible model could).

Windows without a history for a feature carry NaN (the trees route missing values).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from warmserve.policy.warm_predictor import EnsembleState

BOOST_PARAMS = {
    "max_iter": 150,
    "learning_rate": 0.05,
    "max_leaf_nodes": 15,
    "min_samples_leaf": 20,
    "l2_regularization": 1.0,
    "random_state": 0,
}
MIN_TRAIN = 100  # windows; fewer (BurstGPT daily: 60 in all) and the model is not fitted


def _lag(x: np.ndarray, k: int) -> np.ndarray:
    out = np.full(x.size, np.nan)
    if k < x.size:
        out[k:] = x[: x.size - k]
    return out


def _log(x: np.ndarray, floor: float) -> np.ndarray:
    return np.log(np.maximum(x, floor))


def warm_members(series: np.ndarray, windows_per_day: int) -> np.ndarray:
    """``out[t]``: the six members of ``warm``'s median for window ``t`` (from ``series[:t]``)."""
    state = EnsembleState(windows_per_day, 10, 7)
    out = np.empty((series.size, 6))
    for t in range(series.size):
        out[t] = state.members(series[:t])[0]
        state.forecast(series[:t])
        state.observe(series[: t + 1])
    return out


def features(
    target: np.ndarray,
    other: np.ndarray,
    windows_per_day: int,
    cross: Sequence[np.ndarray] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """(feature matrix, log target) for predicting ``target[t]`` from windows before ``t``.

    ``other``: the companion series (the peak for the average, the average for the peak);
    ``cross``: other series of the same trace (other models, their sum).
    """
    floor = 0.01 * target[target > 0].mean()
    lt, lo = _log(target, floor), _log(other, floor)
    p = windows_per_day
    season = p if p > 1 else 7
    last = _lag(lt, 1)
    members = _log(warm_members(target, p), floor) - last[:, None]
    cols = [last, *members.T]
    cols += [_lag(lt, k) - last for k in range(2, 13)]
    cols += [_lag(lo, k) - last for k in (1, 2, 3)]
    for d in (1, 2, 7):
        cols += [_lag(lt, d * season - o) - _lag(lt, d * season + 1) for o in (0, 1)]
        cols.append(_lag(lt, d * season) - last)
    if p > 1:
        phase = 2 * np.pi * (np.arange(target.size) % p) / p
        cols += [np.sin(phase), np.cos(phase), np.sin(2 * phase), np.cos(2 * phase)]
    for series in cross:
        ls = _log(series, 0.01 * series[series > 0].mean())
        cols += [_lag(ls, 1) - _lag(ls, 2), _lag(ls, 1) - _lag(ls, 1 + season), _lag(ls, 1) - last]
    return np.column_stack(cols), lt


def _fit_predict(
    x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray, quantile: float | None
) -> np.ndarray:
    from sklearn.ensemble import HistGradientBoostingRegressor

    usable = np.isfinite(x[train]).sum(axis=0) >= 20  # a column never seen cannot be binned
    params: dict[str, object] = dict(BOOST_PARAMS)
    if quantile is None:
        params["loss"] = "absolute_error"
    else:
        params.update(loss="quantile", quantile=quantile)
    model = HistGradientBoostingRegressor(**params).fit(x[train][:, usable], y[train])
    return model.predict(x[test][:, usable])


def boosted(
    target: np.ndarray,
    other: np.ndarray,
    windows_per_day: int,
    fallback: np.ndarray,
    cross: Sequence[np.ndarray] = (),
    quantile: float | None = None,
    blocked: bool = False,
) -> np.ndarray:
    """One-step forecasts of ``target`` by trees refitted once a day (``fallback`` where fewer
    than ``MIN_TRAIN`` windows can train them).  ``quantile=None``: the median (absolute loss).

    ``blocked=False``: walk-forward, each day's trees fitted on the days before it (no
    look-ahead); ``blocked=True``: day-blocked cross-validation, fitted on every *other* day.
    """
    x, lt = features(target, other, windows_per_day, cross)
    last = _lag(lt, 1)
    y = lt - last
    usable = np.isfinite(y) & (target > 0)
    usable[0] = False
    step = windows_per_day if windows_per_day > 1 else 7
    out = np.asarray(fallback, dtype=float).copy()
    if target.size < MIN_TRAIN:
        return out
    for start in range(step, target.size, step):
        test = np.arange(start, min(target.size, start + step))
        before = np.arange(start)
        pool = np.concatenate([before, np.arange(test[-1] + 1, target.size)]) if blocked else before
        train = pool[usable[pool]]
        if train.size < MIN_TRAIN:
            continue
        pred = np.exp(last[test] + _fit_predict(x, y, train, test, quantile))
        out[test] = np.where(np.isfinite(pred), pred, out[test])
    return out
