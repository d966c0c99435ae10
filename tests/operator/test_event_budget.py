"""The operator's Event budget: a token bucket with a bounded backlog (event_budget.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from warmserve_operator.event_budget import EventBudget


def test_a_burst_then_the_rate() -> None:
    b: EventBudget[int] = EventBudget(0.0, rate=2.0, burst=3.0, backlog=10)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.4)  # 0.8 of a token
    assert b.take(0.5)


def test_the_backlog_drops_its_oldest_and_drains_in_order() -> None:
    b: EventBudget[int] = EventBudget(0.0, rate=1.0, burst=2.0, backlog=3)
    assert [b.queue(i) for i in range(5)] == [True, True, True, False, False]
    assert len(b) == 3
    assert b.drain(0.0) == [2, 3]  # two tokens
    assert b.drain(1.0) == [4]
    assert len(b) == 0 and b.drain(10.0) == []


@pytest.mark.parametrize(
    ("rate", "burst", "backlog"), [(0.0, 1.0, 1), (1.0, 0.5, 1), (1.0, 1.0, 0)]
)
def test_bad_budgets_are_refused(rate: float, burst: float, backlog: int) -> None:
    with pytest.raises(ValueError, match="event budget needs"):
        EventBudget(0.0, rate, burst, backlog)


@given(
    st.floats(0.1, 50.0),
    st.integers(1, 20),
    st.lists(st.floats(0.0, 5.0), min_size=1, max_size=60),
)
def test_never_more_than_the_burst_plus_the_rate(
    rate: float, burst: int, gaps: list[float]
) -> None:
    b: EventBudget[int] = EventBudget(0.0, rate, float(burst), backlog=5)
    now, taken = 0.0, 0
    for gap in gaps:
        now += gap
        taken += b.take(now)
        assert taken <= burst + rate * now + 1e-9
