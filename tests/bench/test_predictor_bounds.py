"""bench/predictor_bounds.py and its oracles (bench/predictor_oracles.py) and trees
(bench/predictor_boosting.py): the exact coverage bound, the oracles' samples, no look-ahead in
the walk-forward trees, and the script's tables and JSON."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

oracles = importlib.import_module("predictor_oracles")
boosting = importlib.import_module("predictor_boosting")
bounds = importlib.import_module("predictor_bounds")


def test_coverage_bound_on_a_uniform_window():
    # a = 0..9 equally likely: p = 8 covers 90 % at E(8 - a)+ = 3.6, E a = 4.5
    samples = np.tile(np.arange(10.0), (3, 1))
    b = oracles.coverage_bound(samples, 0.9)
    assert b.over_forecast == pytest.approx(3.6 / 4.5)
    assert np.all(b.forecasts == 8.0)


def test_coverage_bound_shares_coverage_unevenly():
    # a certain window costs nothing to cover; the noisy one can then be covered less (80 %)
    certain = np.full(10, 5.0)
    noisy = np.arange(10.0)
    b = oracles.coverage_bound(np.vstack([certain, noisy]), 0.9)
    # p = 7 on the noisy window: coverage (1 + 0.8) / 2, over (7+6+...+0)/10 = 2.8
    assert b.over_forecast == pytest.approx(2.8 / (5.0 + 4.5))


def sample_rows(high: int, draws: int, windows: int) -> st.SearchStrategy[np.ndarray]:
    """(windows, draws) arrays of integer values in 0..high, not all 0."""
    row = st.lists(st.integers(0, high), min_size=draws, max_size=draws)
    return (
        st.lists(row, min_size=1, max_size=windows)
        .map(lambda rows: np.asarray(rows, dtype=float))
        .filter(lambda a: a.sum() > 0)
    )


@settings(max_examples=60, deadline=None)
@given(sample_rows(50, 8, 6), st.sampled_from([0.5, 0.75, 0.9, 0.95]))
def test_coverage_bound_is_below_every_quantile_rule(samples, target):
    b = oracles.coverage_bound(samples, target)
    assert b.over_forecast >= -1e-12
    volume = samples.mean(axis=1).sum()
    # any deterministic forecast per window whose expected coverage reaches the target costs
    # at least the bound: try the same empirical quantile in every window
    for level in np.linspace(0, 1, 21):
        p = np.quantile(samples, level, axis=1, method="higher")
        cov = np.mean(samples <= p[:, None], axis=1).mean()
        if cov >= target:
            over = np.maximum(p[:, None] - samples, 0).mean(axis=1).sum() / volume
            assert b.over_forecast <= over + 1e-9
    # and more coverage never costs less
    if target < 0.95:
        assert oracles.coverage_bound(samples, 0.95).over_forecast >= b.over_forecast - 1e-9


def _brute_force(samples: np.ndarray, target: float) -> float:
    """Least expected over-forecast at expected coverage >= target over every deterministic
    choice of a candidate (0 or a sample value) per window, mixed in pairs (randomised)."""
    import itertools

    cands = [np.concatenate([[0.0], row]) for row in samples]
    points = []
    for choice in itertools.product(*cands):
        p = np.asarray(choice)[:, None]
        points.append(
            (np.mean(samples <= p, axis=1).mean(), np.maximum(p - samples, 0).mean(axis=1).sum())
        )
    best = min((o for c, o in points if c >= target - 1e-12), default=np.inf)
    for (c1, o1), (c2, o2) in itertools.combinations(points, 2):
        if (c1 - target) * (c2 - target) < 0:
            w = (target - c1) / (c2 - c1)
            best = min(best, o1 + w * (o2 - o1))
    return best / samples.mean(axis=1).sum()


@settings(max_examples=40, deadline=None)
@given(sample_rows(9, 3, 3), st.sampled_from([0.3, 0.5, 0.7, 0.9]))
def test_coverage_bound_is_the_exact_optimum(samples, target):
    assert oracles.coverage_bound(samples, target).over_forecast == pytest.approx(
        _brute_force(samples, target), abs=1e-9
    )


def test_coverage_bound_rejects_bad_input():
    with pytest.raises(ValueError, match="target"):
        oracles.coverage_bound(np.ones((2, 3)), 1.0)
    with pytest.raises(ValueError, match="samples"):
        oracles.coverage_bound(-np.ones((2, 3)), 0.9)


def test_median_error_floor():
    assert oracles.median_error_floor(np.full((4, 5), 3.0)) == 0.0
    # 0, 1, 2 equally likely: median 1, E|a - 1| = 2/3, E a = 1
    assert oracles.median_error_floor(np.array([[0.0, 1.0, 2.0]])) == pytest.approx(2 / 3)


def test_known_average_samples():
    avg = np.array([0.0, 1.0, 2.0, 4.0, 8.0])
    peak = np.array([0.0, 2.0, 3.0, 4.0, 8.0])
    s = oracles.known_average_samples(avg, peak, k=2)
    assert np.all(s[0] == 0)  # no load, no peak
    # window 1 (level log 1) draws the ratios of its two nearest other windows: 2 and 4
    assert sorted(s[1]) == [1.0, 1.5]
    assert np.all(s[1:] >= avg[1:, None])  # ratios >= 1 here


def test_smooth_rate_oracle_of_a_constant_series_is_exact():
    values = np.full(60, 7.0)
    peaks, avgs, level = oracles.smooth_rate_samples(values, 5, 11, k=5)
    assert peaks.shape == (12, 5) and np.allclose(peaks, 7.0) and np.allclose(avgs, 7.0)
    assert oracles.coverage_bound(peaks, 0.9).over_forecast == pytest.approx(0.0)
    assert np.allclose(level, 7.0)
    peaks, _, _ = oracles.smooth_rate_samples(values, 5, 11, k=5, given_previous=True)
    assert peaks.shape == (12, 5) and np.allclose(peaks, 7.0)


def test_smooth_rate_oracle_given_the_previous_step_draws_alike_blocks():
    # windows alternate A, B, A, ...: the step before a window tells which one comes (14 before
    # a B, 6 before an A), so the oracle that knows it draws the right block and needs little
    # over-forecast; the one that does not mixes the two
    a, b = [10.0, 10.0, 10.0, 10.0, 14.0], [11.0, 11.0, 11.0, 11.0, 6.0]
    values = np.array([(b if i % 2 else a) for i in range(60)]).ravel()
    # a bandwidth over the whole series: one rate, so every window is at the same level
    plain, _, _ = oracles.smooth_rate_samples(values, 5, 601, k=10)
    given, _, _ = oracles.smooth_rate_samples(values, 5, 601, k=10, given_previous=True)
    cost = [oracles.coverage_bound(x[2:-2], 0.9).over_forecast for x in (plain, given)]
    assert cost[1] < 0.01 < cost[0]


def test_smooth_rate_is_centred():
    x = np.arange(10.0)
    r = oracles.smooth_rate(x, 3)
    assert r[5] == pytest.approx(5.0) and r[0] == pytest.approx(0.5)


def test_walk_forward_trees_never_look_ahead():
    rng = np.random.default_rng(1)
    n, per_day = 260, 24
    avg = np.exp(np.sin(np.arange(n) * 2 * np.pi / per_day) + 0.2 * rng.standard_normal(n)) + 1
    peak = avg * 1.3
    fallback = np.full(n, avg.mean())
    out = boosting.boosted(avg, peak, per_day, fallback)
    assert np.all(np.isfinite(out)) and np.all(out > 0)
    assert not np.allclose(out[150:], fallback[150:])  # fitted once 100 windows exist
    cut = 200
    changed = avg.copy()
    changed[cut:] *= 5
    out2 = boosting.boosted(changed, peak, per_day, fallback)
    assert np.array_equal(out[: cut + 1], out2[: cut + 1])
    # day-blocked cross-validation does train on later days (that is its point)
    blocked = boosting.boosted(avg, peak, per_day, fallback, blocked=True)
    blocked2 = boosting.boosted(changed, peak, per_day, fallback, blocked=True)
    assert not np.array_equal(blocked[:cut], blocked2[:cut])


def test_shift_to_coverage():
    actual = np.array([1.0, 2.0, 3.0, 4.0, 0.0])
    pred = np.ones(5)
    shifted = bounds.shift_to_coverage(pred, actual, 0.8)
    assert np.mean(actual <= shifted) >= 0.8
    assert np.mean(actual <= shifted * 0.999) < 0.8


def test_script_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["--rows", "burstgpt daily 61 d", "--skip-boosting", "--json", str(out)]
    assert bounds.main(argv) == 0
    text = capsys.readouterr().out
    assert "2. oracles" in text and "burstgpt daily 61 d" in text
    (row,) = json.loads(out.read_text())
    assert row["trace"] == "burstgpt daily 61 d"
    assert row["rate7_over"] > 0
    assert 0 < row["rate7_vwe_floor"] < 1
    with pytest.raises(SystemExit):
        bounds.main(["--rows", "no such trace"])
