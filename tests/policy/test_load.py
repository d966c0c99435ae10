"""Load accounting: event sweep, count series, and the incremental tracker (§2.2, §5.1)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.load import (
    WindowLoad,
    WindowLoadTracker,
    inflight_load,
    request_durations,
    series_load,
)


def test_sweep_hand_computed() -> None:
    # Requests occupy [0,2), [1,4), [2.5,3.5).
    loads = inflight_load([0.0, 1.0, 2.5], [2.0, 3.0, 1.0], window_s=2.0, end_s=4.0)
    assert loads == [WindowLoad(0.0, 1.5, 2.0), WindowLoad(2.0, 1.5, 2.0)]


def test_sweep_back_to_back_requests_do_not_overlap() -> None:
    # One leaves at t=2 exactly when the next arrives: in flight is 1 throughout, never 2.
    (load,) = inflight_load([0.0, 2.0], [2.0, 2.0], window_s=4.0, end_s=4.0)
    assert load.avg == pytest.approx(1.0)
    assert load.peak == 1.0


def test_sweep_carries_requests_across_windows_and_idle_windows() -> None:
    loads = inflight_load([0.5], [10.0], window_s=3.0, end_s=12.0)
    assert [x.start_s for x in loads] == [0.0, 3.0, 6.0, 9.0]
    assert [x.avg for x in loads] == pytest.approx([2.5 / 3, 1.0, 1.0, 1.5 / 3])
    assert [x.peak for x in loads] == [1.0, 1.0, 1.0, 1.0]
    idle = inflight_load([0.0], [1.0], window_s=1.0, end_s=3.0)
    assert [(x.avg, x.peak) for x in idle] == [(1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]


def test_sweep_zero_duration_request_is_not_in_flight() -> None:
    (load,) = inflight_load([1.0], [0.0], window_s=2.0, end_s=2.0)
    assert (load.avg, load.peak) == (0.0, 0.0)


def test_request_durations() -> None:
    d = request_durations([5000, 0], [30, 60], prefill_tok_s=5000, decode_tok_s=30)
    assert list(d) == pytest.approx([2.0, 2.0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_tokens": [-1], "output_tokens": [1]}, "input_tokens"),
        ({"input_tokens": [1], "output_tokens": [1, 2]}, "same length"),
        ({"input_tokens": [1], "output_tokens": [1], "decode_tok_s": 0}, "decode_tok_s"),
        ({"input_tokens": [1], "output_tokens": [1], "prefill_tok_s": -5}, "prefill_tok_s"),
    ],
)
def test_request_durations_bad_input(kwargs: dict, field: str) -> None:
    with pytest.raises(PolicyInputError, match=field):
        request_durations(**kwargs)


def test_sweep_bad_input() -> None:
    with pytest.raises(PolicyInputError, match="window_s"):
        inflight_load([0.0], [1.0], window_s=0)
    with pytest.raises(PolicyInputError, match="durations"):
        inflight_load([0.0], [-1.0], window_s=1)
    with pytest.raises(PolicyInputError, match="end_s"):
        inflight_load([0.0], [1.0], window_s=1, start_s=5, end_s=5)


def test_series_load_units_and_partial_window() -> None:
    # 60 s steps, 180 s windows: counts per step -> requests per second.
    loads = series_load([60, 120, 0, 6, 6, 6, 600], step_s=60, window_s=180)
    assert len(loads) == 2  # the trailing single step is dropped
    assert loads[0] == WindowLoad(0.0, pytest.approx(1.0), 2.0)
    assert loads[1] == WindowLoad(180.0, pytest.approx(0.1), pytest.approx(0.1))
    rates = series_load([1.0, 3.0], step_s=60, window_s=120, values_are_rates=True)
    assert rates == [WindowLoad(0.0, 2.0, 3.0)]


def test_series_load_bad_window() -> None:
    with pytest.raises(PolicyInputError, match="multiple"):
        series_load([1, 2, 3], step_s=60, window_s=90)
    with pytest.raises(PolicyInputError, match="shorter than one window"):
        series_load([1, 2], step_s=60, window_s=300)
    with pytest.raises(PolicyInputError, match="counts"):
        series_load([1, -2], step_s=60, window_s=60)


def test_tracker_hand_computed_and_advance() -> None:
    tr = WindowLoadTracker(window_s=2.0)
    tr.update(0.0, 1)
    tr.update(1.0, 2)
    tr.update(2.0, 1)
    first = tr.close(2.0)
    assert first == WindowLoad(0.0, 1.5, 2.0)
    tr.update(2.5, 2)
    tr.update(3.5, 5)  # a momentary value replaced at the same instant is not a peak
    tr.update(3.5, 1)
    closed = tr.advance(6.0)
    assert closed == [WindowLoad(2.0, 1.5, 2.0), WindowLoad(4.0, 1.0, 1.0)]
    assert tr.window_start == 6.0


def test_tracker_bad_input() -> None:
    tr = WindowLoadTracker(window_s=1.0, start_s=10.0)
    with pytest.raises(PolicyInputError, match="backwards"):
        tr.update(9.0, 1)
    with pytest.raises(PolicyInputError, match="inflight"):
        tr.update(11.0, -1)
    with pytest.raises(PolicyInputError, match="after the window start"):
        tr.close(10.0)
    with pytest.raises(PolicyInputError, match="window_s"):
        WindowLoadTracker(window_s=-1)


requests = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=400).map(lambda x: x / 4),
        st.integers(min_value=0, max_value=80).map(lambda x: x / 4),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(reqs=requests, window=st.sampled_from([1.0, 2.5, 7.0, 30.0]))
def test_tracker_equals_sweep(reqs: list[tuple[float, float]], window: float) -> None:
    reqs = sorted(reqs)
    arrivals = [a for a, _ in reqs]
    durations = [d for _, d in reqs]
    end = window * math.ceil((max(arrivals) + 1e-9) / window)
    expected = inflight_load(arrivals, durations, window_s=window, end_s=end)

    events: list[tuple[float, int]] = [(a, +1) for a in arrivals]
    events += [(a + d, -1) for a, d in zip(arrivals, durations, strict=True)]
    events.sort(key=lambda e: e[0])
    tr = WindowLoadTracker(window_s=window)
    got: list[WindowLoad] = []
    level = 0
    for t, delta in events:
        if t >= end:
            break
        got += tr.advance(t)
        level += delta
        tr.update(t, level)
    got += tr.advance(end)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.start_s == pytest.approx(e.start_s)
        assert g.avg == pytest.approx(e.avg, abs=1e-9)
        assert g.peak == e.peak
        assert 0 <= e.avg <= e.peak + 1e-12
