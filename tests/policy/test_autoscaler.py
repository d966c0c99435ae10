"""Tests of the autoscaler (hysteresis, delay, grace periods) and of Eq. 1 lending."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.autoscaler import (
    AutoscalerConfig,
    ScaleMemory,
    decide,
    desired_instances,
    fair_demand_counts,
    grace_done,
    lendable_for,
    lendable_per_gpu,
    reservation_for,
)
from warmserve.policy.cluster import (
    PAGE_BYTES,
    GiB,
    Instance,
    InstancePhase,
    ModelSpec,
    PolicyInputError,
)
from warmserve.policy.proactive import lendable_bytes, reservation_target

CFG = AutoscalerConfig(scale_up_utilization=1.0, scale_down_utilization=0.5, scale_down_delay_s=30)
SPEC = ModelSpec("m", 10**9, 1, 32, 1.0)


# --------------------------------------------------------------------------- Eq. 1


def test_eq1_hand_computed() -> None:
    # R=3, C=32, M=60 GiB, K=4 GiB: M*R/C = 5.625 GiB < K + M/C = 5.875 GiB.
    assert reservation_target(3, 32, 60 * GiB, 4 * GiB) == int(5.875 * GiB)
    assert lendable_bytes(3, 32, 60 * GiB, 4 * GiB) == int(54.125 * GiB)
    # R=16, C=32, M=64 GiB, K=1 GiB: M*R/C = 32 GiB > K + M/C = 3 GiB.
    assert reservation_target(16, 32, 64 * GiB, 1 * GiB) == 32 * GiB
    # The target never exceeds M (deviation documented in proactive.py).
    assert reservation_target(32, 32, 10 * GiB, 10 * GiB) == 10 * GiB
    assert lendable_bytes(32, 32, 10 * GiB, 10 * GiB) == 0
    # Lendable memory is whole pages.
    assert lendable_bytes(0, 3, 10 * PAGE_BYTES + 1, 0) % PAGE_BYTES == 0
    with pytest.raises(PolicyInputError, match="exceeds kv_capacity"):
        reservation_target(1, 32, GiB, 2 * GiB)


def test_lending_helpers_only_for_grace_instances() -> None:
    inst = Instance("m", "n", (0, 1), 3, 60 * GiB, 4 * GiB, InstancePhase.GRACE, "i")
    assert reservation_for(inst, SPEC) == int(5.875 * GiB)
    assert lendable_for(inst, SPEC) == int(54.125 * GiB)
    per = lendable_per_gpu(inst, SPEC)
    assert per % PAGE_BYTES == 0 and per * 2 <= lendable_for(inst, SPEC)
    assert per == int(54.125 * GiB) // 2 // PAGE_BYTES * PAGE_BYTES
    serving = Instance("m", "n", (0,), 3, 60 * GiB, 4 * GiB, InstancePhase.SERVING, "s")
    assert lendable_for(serving, SPEC) == 0


# --------------------------------------------------------------------------- desired_instances


def test_desired_instances_band() -> None:
    assert desired_instances(100, 32, 0, CFG) == 4  # ceil(100/32)
    assert desired_instances(40, 32, 4, CFG) == 3  # ceil(40/16) = 3 keeps utilisation <= 0.5
    assert desired_instances(60, 32, 3, CFG) == 3  # n_up 2 <= 3 <= n_down 4: hold
    assert desired_instances(0, 32, 3, CFG) == 0
    assert desired_instances(0, 32, 3, CFG, min_instances=1) == 1
    assert desired_instances(1000, 32, 0, CFG, max_instances=5) == 5


def test_config_and_argument_validation() -> None:
    with pytest.raises(PolicyInputError, match="scale_down_utilization < scale_up_utilization"):
        AutoscalerConfig(scale_up_utilization=0.5, scale_down_utilization=0.5)
    with pytest.raises(PolicyInputError):
        AutoscalerConfig(max_grace_s=-1)
    with pytest.raises(PolicyInputError, match="load"):
        desired_instances(-1, 32, 0, CFG)
    with pytest.raises(PolicyInputError, match="max_batch"):
        desired_instances(1, 0, 0, CFG)
    with pytest.raises(PolicyInputError, match="running"):
        grace_done(-1, 0, 0, CFG)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 64),  # B
    st.floats(0.3, 1.0),  # u
    st.floats(0.1, 0.95),  # d as a fraction of u
    st.floats(0.0, 500.0),  # L_lo
    st.lists(st.floats(0.0, 1.0), min_size=2, max_size=60),  # position in the band
    st.integers(0, 30),  # initial instances
)
def test_no_flapping_inside_the_band(b, u, frac, lo, xs, n0) -> None:
    """Loads in [L_lo, L_hi] with L_hi*d <= L_lo*u never make the count reverse direction."""
    d = u * frac
    cfg = AutoscalerConfig(scale_up_utilization=u, scale_down_utilization=d, scale_down_delay_s=0)
    hi = lo * u / d
    n, direction = n0, 0
    for x in xs:
        nxt = desired_instances(lo + (hi - lo) * x, b, n, cfg)
        step = (nxt > n) - (nxt < n)
        if step:
            assert direction in (0, step), "scaled up then down (or down then up) inside the band"
            direction = step
        n = nxt


def test_boundary_hover_does_not_flap() -> None:
    # Load hovering around 64 = 2 instances' worth: 63.9, 64.1, 63.9 ... stays at 3 after the
    # first step up (3 instances keep utilisation <= 0.5 only below 48, so never scales down).
    n = 2
    seen = []
    for load in [64.1, 63.9] * 20:
        n = desired_instances(load, 32, n, CFG)
        seen.append(n)
    assert set(seen) == {3}


# --------------------------------------------------------------------------- decide


def inst(name: str, running: int, phase: InstancePhase = InstancePhase.SERVING) -> Instance:
    return Instance("m", "n", (int(name[1:]),), running, 40 * GiB, 0, phase, name)


def test_decide_scales_up_immediately() -> None:
    d = decide(SPEC, 100, [inst("i0", 30)], CFG, now_s=0.0)
    assert (d.current, d.desired, d.scale_up, d.drain) == (1, 4, 3, ())


@given(
    held=st.integers(1, 10_000),
    b=st.integers(1, 512),
    hi=st.integers(0, 64),
    low_since=st.one_of(st.none(), st.floats(0, 1e6)),
    grace=st.integers(0, 3),
)
def test_demand_at_zero_instances_starts_at_once(held, b, hi, low_since, grace) -> None:
    """Scale from zero: demand held at the gateways while a model has no active
    instance (grace ones do not count) starts min(ceil(demand / B), maxInstances) instances in
    the same decision: no hysteresis band or delay holds a start back, whatever the memory."""
    spec = ModelSpec("m", 10**9, 1, b, 1.0)
    draining = [
        Instance("m", "n", (k,), running=1, phase=InstancePhase.GRACE, name=f"g{k}")
        for k in range(grace)
    ]
    mem = ScaleMemory(low_since)
    d = decide(spec, float(held), draining, CFG, 1e6 + 1, mem, min_instances=0, max_instances=hi)
    assert d.current == 0
    assert d.scale_up == min(-(-held // b), hi) and not d.drain


def test_decide_waits_the_delay_then_drains_least_running_first() -> None:
    pool = [inst("i0", 9), inst("i1", 2), inst("i2", 5), inst("i3", 2)]
    d1 = decide(SPEC, 20, pool, CFG, now_s=100.0)  # wants ceil(20/16) = 2
    assert d1.drain == () and d1.memory == ScaleMemory(100.0) and d1.desired == 4
    d2 = decide(SPEC, 20, pool, CFG, now_s=120.0, memory=d1.memory)
    assert d2.drain == () and d2.memory == ScaleMemory(100.0)
    d3 = decide(SPEC, 20, pool, CFG, now_s=130.0, memory=d2.memory)
    assert [i.name for i in d3.drain] == ["i1", "i3"] and d3.desired == 2
    assert d3.memory == ScaleMemory()


def test_decide_resets_delay_when_load_returns() -> None:
    pool = [inst("i0", 9), inst("i1", 2)]
    d1 = decide(SPEC, 10, pool, CFG, now_s=0.0)
    assert d1.memory.low_since_s == 0.0
    d2 = decide(SPEC, 40, pool, CFG, now_s=20.0, memory=d1.memory)  # back in band
    assert d2.memory == ScaleMemory()
    d3 = decide(SPEC, 10, pool, CFG, now_s=40.0, memory=d2.memory)
    assert d3.drain == () and d3.memory.low_since_s == 40.0


def test_grace_instances_do_not_count_and_grace_ends() -> None:
    pool = [inst("i0", 9), inst("i1", 0, InstancePhase.GRACE), inst("i2", 4, InstancePhase.GRACE)]
    d = decide(SPEC, 20, pool, CFG, now_s=500.0, grace_started_s={"i1": 490.0, "i2": 490.0})
    assert d.current == 1 and d.scale_up == 0
    assert [i.name for i in d.grace_ended] == ["i1"]  # finished its requests
    d = decide(SPEC, 20, pool, CFG, now_s=790.0, grace_started_s={"i1": 490.0, "i2": 490.0})
    assert [i.name for i in d.grace_ended] == ["i1", "i2"]  # i2 hit max_grace_s = 300


def test_grace_done_rules() -> None:
    assert grace_done(0, 10.0, 10.0, CFG)
    assert not grace_done(3, 10.0, 309.9, CFG)
    assert grace_done(3, 10.0, 310.0, CFG)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0, 500, allow_nan=False), st.integers(1, 64), st.integers(0, 12),
    st.sampled_from([(1.0, 0.5), (0.8, 0.3), (0.9, 0.6)]), st.integers(0, 3),
    st.one_of(st.none(), st.integers(3, 10)), st.integers(0, 2),
)
def test_fair_demand_counts_are_the_three_desired_counts(
    load: float, batch: int, current: int, ud: tuple[float, float], lo: int,
    hi: int | None, cfg_lo: int,
) -> None:
    """The fair share's one-pass counts are exactly the three desired_instances calls they
    replace: with the current instances, without, and unbounded without."""
    cfg = AutoscalerConfig(scale_up_utilization=ud[0], scale_down_utilization=ud[1],
                           min_instances=cfg_lo)
    for bounds in ((lo, hi), (None, None)):
        want = desired_instances(load, batch, current, cfg, *bounds)
        need = desired_instances(load, batch, 0, cfg, *bounds)
        weight = desired_instances(load, batch, 0, cfg, 0, None)
        assert fair_demand_counts(load, batch, current, cfg, *bounds) == (want, need, weight)
