"""Forecast quality metrics: by hand, invariants, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.forecast_quality import forecast_quality


def test_by_hand() -> None:
    # actual 10, 1, 0, 4; predicted 12, 0.5, 1, 4
    q = forecast_quality([12.0, 0.5, 1.0, 4.0], [10.0, 1.0, 0.0, 4.0])
    assert q.windows == 4
    assert q.mean_rel_error == pytest.approx((0.2 + 0.5 + 0.0) / 3)  # the 0 window left out
    assert q.volume_weighted_error == pytest.approx((2 + 0.5 + 1 + 0) / 15)
    assert q.under_rate == pytest.approx(1 / 4)
    assert q.coverage == pytest.approx(3 / 4)
    assert q.over_forecast == pytest.approx((2 + 1) / 15)
    assert q.over_forecast_rel == pytest.approx((0.2 + 0.0) / 2)  # covered, actual > 0
    assert set(q.as_dict()) == {
        "windows", "mean_rel_error", "volume_weighted_error", "under_rate", "coverage",
        "over_forecast", "over_forecast_rel",
    }


def test_near_empty_windows_dominate_mre_not_vwe() -> None:
    """The reason for the volume-weighted error: one quiet window outweighs a busy one in MRE."""
    actual = [100.0, 0.1]
    q = forecast_quality([100.0, 0.3], actual)
    assert q.mean_rel_error == pytest.approx(1.0)  # (0 + 200 %) / 2
    assert q.volume_weighted_error == pytest.approx(0.2 / 100.1)


def test_undefined_metrics_are_nan() -> None:
    q = forecast_quality([1.0, 0.0], [0.0, 0.0])
    assert math.isnan(q.mean_rel_error) and math.isnan(q.volume_weighted_error)
    assert math.isnan(q.over_forecast) and math.isnan(q.over_forecast_rel)
    assert q.coverage == 1.0 and q.under_rate == 0.0


@pytest.mark.parametrize(
    ("pred", "act", "message"),
    [
        ([1.0], [1.0, 2.0], "1 windows, actual 2"),
        ([], [], "no windows"),
        ([-1.0], [1.0], "predicted must be finite and >= 0"),
        ([1.0], [float("nan")], "actual must be finite"),
        ([[1.0]], [[1.0]], "1-D"),
    ],
)
def test_bad_input(pred: list[float], act: list[float], message: str) -> None:
    with pytest.raises(PolicyInputError, match=message):
        forecast_quality(pred, act)


pairs = st.lists(
    st.tuples(
        st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), st.one_of(st.just(0.0), st.floats(1e-6, 1e6))
    ),
    min_size=1,
    max_size=60,
)


@given(pairs=pairs)
def test_invariants(pairs: list[tuple[float, float]]) -> None:
    p = np.array([x for x, _ in pairs])
    a = np.array([y for _, y in pairs])
    q = forecast_quality(p, a)
    assert q.coverage + q.under_rate == pytest.approx(1.0)
    if a.sum() > 0:
        assert 0 <= q.over_forecast <= q.volume_weighted_error + 1e-12
        # raising every forecast never lowers coverage nor the over-forecast
        q2 = forecast_quality(p * 2 + 1, a)
        assert q2.coverage >= q.coverage
        assert q2.over_forecast >= q.over_forecast - 1e-12
    perfect = forecast_quality(a, a)
    assert perfect.coverage == 1.0
    assert perfect.volume_weighted_error in (0.0,) or math.isnan(perfect.volume_weighted_error)
