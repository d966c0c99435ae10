"""Spare burst replicas (:mod:`warmserve.policy.scoring`, docs/policy.md)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmserve.control.controller import ControlConfig, Controller, ModelEntry
from warmserve.control.decisions import Prewarm, Start
from warmserve.control.observation import GpuObs, InstanceObs, Observation, SlotObs
from warmserve.policy.cluster import (
    GiB,
    InstancePhase,
    LoadForecast,
    ModelSpec,
    PolicyInputError,
    ReplicaKind,
)
from warmserve.policy.scoring import model_replicas, priority_key, replica_counts

SPEC = ModelSpec("m", 10 * GiB, 1, 32, 5.0)


def test_eq6_asks_for_one_spare_beyond_the_predicted_peak() -> None:
    # 5 instances already cover ceil(100/32) = 4: Eq. 6 asks for nothing; a spare keeps the
    # sixth start warm (the measured misses: demand above the forecast peak)
    assert replica_counts(LoadForecast(40, 100), 32, 5) == (0, 0)
    assert replica_counts(LoadForecast(40, 100), 32, 5, spare=1) == (0, 1)
    # a peak just below one batch: Eq. 6 gives nothing beyond the one instance
    assert replica_counts(LoadForecast(7, 30), 32, 1, spare=1) == (0, 1)
    assert replica_counts(LoadForecast(40, 100), 32, 1, spare=2) == (1, 4)


def test_no_spare_for_a_model_with_nothing_predicted_and_no_instance() -> None:
    assert replica_counts(LoadForecast(0, 0), 32, 0, spare=1) == (0, 0)
    assert replica_counts(LoadForecast(0, 0), 32, 1, spare=1) == (0, 1)
    with pytest.raises(PolicyInputError):
        replica_counts(LoadForecast(0, 0), 32, 1, spare=-1)
    with pytest.raises(PolicyInputError):
        ControlConfig(spare_replicas=-1)


@given(
    avg=st.floats(0, 500),
    peak=st.floats(0, 500),
    active=st.integers(0, 20),
    spare=st.integers(0, 3),
)
def test_spares_add_exactly_and_score_last(
    avg: float, peak: float, active: int, spare: int
) -> None:
    fc = LoadForecast(avg, peak)
    base = model_replicas(SPEC, fc, active)
    more = model_replicas(SPEC, fc, active, spare)
    extra = spare if (peak > 0 or active > 0) else 0
    assert len(more) == len(base) + extra
    assert [r.kind for r in more[: len(base)]] == [r.kind for r in base]
    spares = more[len(base):]
    assert all(r.kind == ReplicaKind.BURST for r in spares)
    # the replicas Eq. 5-6 ask for keep their Eq. 7-8 scores; spares score 0 and come last
    assert more[: len(base)] == base
    assert all(s.score == 0.0 for s in spares)
    assert all(priority_key(r) < priority_key(s) for r in base for s in spares)


@given(
    fcs=st.lists(st.tuples(st.floats(0, 300), st.floats(0, 300), st.integers(0, 5)),
                 min_size=1, max_size=4),
)
def test_no_spare_outranks_any_models_asked_for_replica(
    fcs: list[tuple[float, float, int]],
) -> None:
    """Across models: a spare never takes memory a replica Eq. 5-6 asks for could get."""
    asked, spares = [], []
    for k, (avg, peak, active) in enumerate(fcs):
        spec = ModelSpec(f"m{k}", 10 * GiB, 1, 32, 5.0 + k)
        base = model_replicas(spec, LoadForecast(avg, peak), active)
        asked += [r for r in base if r.score > 0]
        spares += model_replicas(spec, LoadForecast(avg, peak), active, 1)[len(base):]
    assert all(priority_key(r) < priority_key(s) for r in asked for s in spares)


def _setup(spare: int, overshoot: int = 0) -> tuple[Controller, tuple[GpuObs, ...]]:
    """``overshoot`` (ControlConfig.overshoot_spares, headroom 0.25): off unless a test is
    about it (the overshoot spares, warmserve.policy.overshoot, below)."""
    cfg = ControlConfig(window_s=300.0, spare_replicas=spare, overshoot_spares=overshoot,
                        overshoot_headroom=0.25)
    ctl = Controller(cfg)
    ctl.set_models({"m": ModelEntry(SPEC)}, 0.0)
    return ctl, tuple(GpuObs("n0", g, 80 * GiB) for g in range(4))


def _serving(n: int, in_flight: int) -> tuple[InstanceObs, ...]:
    return tuple(
        InstanceObs(f"i{g}", "m", "n0", (g,), InstancePhase.SERVING, in_flight=in_flight,
                    running=in_flight)
        for g in range(n)
    )


def test_controller_keeps_a_spare_warm_behind_each_start_that_uses_one() -> None:
    """One instance, no forecast: the spare is prewarmed; when the load needs a second
    instance it starts on the spare (a hit) and the same decision prewarms the next spare."""
    ctl, gpus = _setup(spare=1)
    obs = Observation(10.0, gpus, (), _serving(1, 10), {})
    ctl.observe(obs)
    first = [d for d in ctl.decide(obs).items if isinstance(d, Prewarm)]
    assert [(d.model, d.gpus) for d in first] == [("m", (1,))]
    slot = SlotObs("s1", "m", "n0", (1,), first[0].bytes_per_gpu, priority=(
        first[0].kind, first[0].rank, first[0].score))
    obs = Observation(20.0, gpus, (slot,), _serving(1, 40), {})
    ctl.observe(obs)
    out = ctl.decide(obs)
    starts = [d for d in out.items if isinstance(d, Start)]
    assert [(d.gpus, d.hit) for d in starts] == [((1,), True)]
    behind = [d for d in out.items if isinstance(d, Prewarm)]
    assert [(d.model, d.gpus) for d in behind] == [("m", (2,))]


def test_controller_without_spares_is_the_papers_eq6() -> None:
    """The old behaviour (``spare_replicas=0``): no forecast, nothing prewarmed, the second
    instance is a cold start."""
    ctl, gpus = _setup(spare=0)
    obs = Observation(10.0, gpus, (), _serving(1, 10), {})
    ctl.observe(obs)
    assert not [d for d in ctl.decide(obs).items if isinstance(d, Prewarm)]
    obs = Observation(20.0, gpus, (), _serving(1, 40), {})
    ctl.observe(obs)
    starts = [d for d in ctl.decide(obs).items if isinstance(d, Start)]
    assert [d.hit for d in starts] == [False]


# ---------------------------------------------------------------- overshoot spares


def test_controller_prewarms_a_spare_once_demand_passes_the_forecast_peak() -> None:
    """No history: the forecast peak is 0, so one instance with 10 requests in flight has
    passed it; the overshoot spare is prewarmed, the next start hits it and the same decision
    prewarms the spare behind it.  With ``overshoot_spares=0`` (Eq. 6) nothing is prewarmed
    and the start is cold."""
    ctl, gpus = _setup(spare=0, overshoot=1)
    obs = Observation(10.0, gpus, (), _serving(1, 10), {})
    ctl.observe(obs)
    out = ctl.decide(obs)
    assert ctl.forecast_of("m") is not None and ctl.forecast_of("m").peak < 10
    first = [d for d in out.items if isinstance(d, Prewarm)]
    assert [(d.model, d.gpus, d.score) for d in first] == [("m", (1,), 0.0)]
    slot = SlotObs("s1", "m", "n0", (1,), first[0].bytes_per_gpu, priority=(
        first[0].kind, first[0].rank, first[0].score))
    obs = Observation(20.0, gpus, (slot,), _serving(1, 40), {})
    ctl.observe(obs)
    out = ctl.decide(obs)
    assert [(d.gpus, d.hit) for d in out.items if isinstance(d, Start)] == [((1,), True)]
    assert [(d.model, d.gpus) for d in out.items if isinstance(d, Prewarm)] == [("m", (2,))]

    ctl, gpus = _setup(spare=0, overshoot=0)
    obs = Observation(10.0, gpus, (), _serving(1, 10), {})
    ctl.observe(obs)
    assert not [d for d in ctl.decide(obs).items if isinstance(d, Prewarm)]
    obs = Observation(20.0, gpus, (), _serving(1, 40), {})
    ctl.observe(obs)
    assert [d.hit for d in ctl.decide(obs).items if isinstance(d, Start)] == [False]


def test_controller_drops_the_spare_after_the_hold() -> None:
    """Flagged in window 0, the spare holds through window 1 and is gone in window 2 when the
    demand (0 from t = 300 s on) never passed the forecast peak since."""
    ctl, gpus = _setup(spare=0, overshoot=1)
    obs = Observation(10.0, gpus, (), _serving(1, 10), {})
    ctl.observe(obs)
    ctl.decide(obs)
    assert ctl.spares() == {"m": 1}
    for t, want in ((300.0, 1), (450.0, 1), (600.0, 0), (750.0, 0)):
        obs = Observation(t, gpus, (), _serving(1, 0), {})
        ctl.observe(obs)
        ctl.decide(obs)
        assert ctl.spares() == {"m": want}, t


def test_controller_headroom_gives_a_spare_before_any_overshoot() -> None:
    """``overshoot_headroom``: a model whose forecast peak sits just under a batch boundary
    gets its spare at the window's plan, before its demand passes the forecast."""
    ctl, gpus = _setup(spare=0, overshoot=1)
    obs = Observation(10.0, gpus, (), _serving(1, 0), {})
    ctl.observe(obs)
    ctl.decide(obs)
    ctl.models["m"].forecast = LoadForecast(7, 30.3)
    assert ctl.spares() == {"m": 1}
    ctl.models["m"].forecast = LoadForecast(7, 20.0)
    assert ctl.spares() == {"m": 0}
