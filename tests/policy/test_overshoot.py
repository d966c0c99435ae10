"""Overshoot spares (:mod:`warmserve.policy.overshoot`, docs/policy.md)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmserve.control.controller import ControlConfig
from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    GiB,
    LoadForecast,
    ModelSpec,
    Node,
    PolicyInputError,
)
from warmserve.policy.evict_aware_placement import plan_prewarm
from warmserve.policy.overshoot import near_batch_boundary, peak_exceeded, spares_for
from warmserve.policy.scoring import replica_counts

SPEC = ModelSpec("m", 10 * GiB, 1, 32, 5.0)


def test_peak_exceeded_only_above_the_forecast_peak() -> None:
    assert peak_exceeded(31.0, LoadForecast(10, 30.3))
    assert not peak_exceeded(30.3, LoadForecast(10, 30.3))
    assert not peak_exceeded(500.0, None)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    last=st.dictionaries(st.sampled_from("abcdef"), st.none() | st.integers(-3, 12)),
    window=st.integers(0, 10),
    base=st.integers(0, 2),
    overshoot=st.integers(0, 2),
    hold=st.integers(0, 3),
)
def test_spares_for_flags_exactly_the_recent_overshoots(
    last: dict[str, int | None], window: int, base: int, overshoot: int, hold: int
) -> None:
    out = spares_for(last, window, base=base, overshoot=overshoot, hold_windows=hold)
    assert set(out) == set(last)
    for m, w in last.items():
        hot = w is not None and window - hold <= w <= window
        assert out[m] == base + (overshoot if hot else 0)
        assert out[m] >= base  # never fewer than every model gets


def test_spares_for_rejects_negative_counts() -> None:
    with pytest.raises(PolicyInputError):
        spares_for({"m": 0}, 0, overshoot=-1)
    with pytest.raises(PolicyInputError):
        ControlConfig(overshoot_spares=-1)


def _state(forecasts: dict[str, LoadForecast], n_nodes: int = 1) -> ClusterState:
    specs = {n: ModelSpec(n, 10 * GiB, 1, 32, 5.0 + k) for k, n in enumerate(sorted(forecasts))}
    gpus = tuple(GPU(g, 80 * GiB, 80 * GiB) for g in range(8))
    nodes = tuple(Node(f"n{k}", gpus) for k in range(n_nodes))
    return ClusterState(nodes, specs, forecasts=forecasts)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fcs=st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100)), min_size=1, max_size=3),
    hot=st.sets(st.integers(0, 2)),
)
def test_per_model_spares_never_fewer_than_eq6_and_score_last(
    fcs: list[tuple[float, float]], hot: set[int]
) -> None:
    """A plan with overshoot spares for some models: every model keeps at least its Eq. 5-6
    replicas (placed or unplaced), the flagged ones get one more, and no spare outranks any
    replica Eq. 5-6 ask for."""
    forecasts = {f"m{k}": LoadForecast(a, p) for k, (a, p) in enumerate(fcs)}
    state = _state(forecasts, n_nodes=4)
    spares = {f"m{k}": 1 for k in hot if k < len(fcs)}
    plan = plan_prewarm(state, spare_replicas=spares)
    for name, fc in forecasts.items():
        asked = sum(replica_counts(fc, 32, 0))
        extra = spares.get(name, 0) if fc.peak > 0 else 0
        got = [r for r in (*plan.keep, *plan.place) if r.model == name]
        missing = [u for u in plan.unplaced if u.model == name]
        assert len(got) + len(missing) == asked + extra
        assert len(got) >= min(asked, len(got) + len(missing))
    reqs = sorted((*plan.keep, *plan.place), key=priority_key_of)
    spare_at = [i for i, r in enumerate(reqs) if _is_spare(r, forecasts)]
    asked_at = [i for i, r in enumerate(reqs) if not _is_spare(r, forecasts)]
    assert not spare_at or not asked_at or max(asked_at) < min(spare_at)


def _is_spare(r, forecasts) -> bool:  # type: ignore[no-untyped-def]
    _, n_burst = replica_counts(forecasts[r.model], 32, 0)
    return r.kind.value == "burst" and r.rank >= n_burst


def test_plan_with_a_mapping_matches_the_same_int_for_the_flagged_model() -> None:
    fc = {"a": LoadForecast(10, 30.3), "b": LoadForecast(10, 30.3)}
    state = _state(fc)
    mixed = plan_prewarm(state, spare_replicas={"a": 1})
    every = plan_prewarm(state, spare_replicas=1)
    none = plan_prewarm(state)
    count = lambda plan, m: sum(1 for r in plan.place if r.model == m)  # noqa: E731
    assert (count(none, "a"), count(none, "b")) == (1, 1)  # Eq. 6: ceil(30.3 / 32) = 1
    assert (count(mixed, "a"), count(mixed, "b")) == (2, 1)
    assert (count(every, "a"), count(every, "b")) == (2, 2)
    spare = [r for r in mixed.place if r.model == "a" and r.score == 0.0]
    asked = [r for r in mixed.place if r.score > 0]
    assert len(spare) == 1
    assert all(priority_key_of(r) < priority_key_of(spare[0]) for r in asked)


def priority_key_of(r) -> tuple:  # type: ignore[no-untyped-def]
    return (0 if r.kind.value == "basic" else 1, -r.score, r.model, r.rank)


def test_near_batch_boundary() -> None:
    # the measured misses: peaks of 25-31 with B = 32 left no burst replica for the 33rd request
    assert near_batch_boundary(LoadForecast(7, 30.3), 32, 0.25)
    assert near_batch_boundary(LoadForecast(7, 25.2), 32, 0.25)
    assert not near_batch_boundary(LoadForecast(7, 24.0), 32, 0.25)  # 8 of room: not < 8
    assert not near_batch_boundary(LoadForecast(7, 33.0), 32, 0.25)  # 31 of room in 2
    assert near_batch_boundary(LoadForecast(50, 64.0), 32, 0.25)  # no room at all
    assert not near_batch_boundary(LoadForecast(0, 0), 32, 0.25)  # nothing predicted
    assert not near_batch_boundary(LoadForecast(7, 30.3), 32, 0.0)
    assert not near_batch_boundary(None, 32, 0.25)
    with pytest.raises(PolicyInputError):
        near_batch_boundary(LoadForecast(7, 30.3), 32, -0.1)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(peak=st.floats(0.01, 500), batch=st.integers(1, 64), h=st.floats(0, 1))
def test_near_batch_boundary_is_monotone_in_headroom(peak: float, batch: int, h: float) -> None:
    fc = LoadForecast(0, peak)
    if near_batch_boundary(fc, batch, h):
        assert near_batch_boundary(fc, batch, min(h + 0.1, 1.0))
    # a whole batch of headroom: always near (the room in ceil(L_P / B) instances is < B)
    assert near_batch_boundary(fc, batch, 1.0)
