"""The prewarm-depth rule (warmserve.policy.prewarm_depth) and the prepared engine's charge in
Algorithm 1's memory accounting (ModelSpec.engine_overhead_bytes)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    GiB,
    LoadForecast,
    ModelSpec,
    Node,
    PolicyInputError,
)
from warmserve.policy.evict_aware_placement import apply_plan, plan_prewarm
from warmserve.policy.prewarm_depth import (
    DepthProfile,
    DepthSource,
    choose_depth,
    forward_time_s,
    min_resident_layers,
)

seconds = st.floats(min_value=0.0, max_value=5.0, allow_nan=False, allow_infinity=False)
layers = st.integers(min_value=1, max_value=128)


def recurrence(L: int, r: int, ell: float, c: float, head: float, h: float) -> float:
    """The forward event by event: layer i >= r arrives at max(0, (i - r + 1) l - h) and
    starts when it has arrived and layer i - 1 has finished."""
    finish = 0.0
    for i in range(L):
        arrival = 0.0 if i < r else max(0.0, (i - r + 1) * ell - h)
        finish = max(finish, arrival) + c
    return finish + head


@settings(max_examples=300, deadline=None)
@given(layers, st.data(), seconds, seconds, seconds, seconds)
def test_closed_form_is_the_recurrence(L, data, ell, c, head, h) -> None:
    r = data.draw(st.integers(min_value=0, max_value=L))
    got = forward_time_s(L, r, ell, c, head_s=head, head_start_s=h)
    assert got == pytest.approx(recurrence(L, r, ell, c, head, h), rel=1e-9, abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(layers, seconds, seconds, seconds, seconds, st.floats(min_value=0.0, max_value=0.5))
def test_min_resident_layers_is_the_fewest_that_do_not_wait(L, ell, c, head, h, tol) -> None:
    r = min_resident_layers(L, ell, c, head_s=head, head_start_s=h, tolerance=tol)
    bound = forward_time_s(L, L, ell, c, head_s=head) * (1 + tol) + 1e-12
    times = [forward_time_s(L, k, ell, c, head_s=head, head_start_s=h) for k in range(L + 1)]
    assert all(a >= b for a, b in itertools.pairwise(times))  # non-increasing
    assert 0 <= r <= L
    assert times[r] <= bound
    assert r == 0 or times[r - 1] > bound
    assert r == next(k for k in range(L + 1) if times[k] <= bound)  # same as a linear scan


@settings(max_examples=200, deadline=None)
@given(layers, seconds, seconds, seconds, seconds, st.floats(min_value=1.0, max_value=4.0))
def test_a_slower_load_or_a_shorter_head_start_never_asks_for_fewer_layers(
    L, ell, c, head, h, k
) -> None:
    base = min_resident_layers(L, ell, c, head_s=head, head_start_s=h)
    assert min_resident_layers(L, ell * k, c, head_s=head, head_start_s=h) >= base
    assert min_resident_layers(L, ell, c, head_s=head, head_start_s=h / k) >= base
    # compute slower than loading hides the whole stream: one layer is enough
    if ell <= c and h >= 0:
        assert min_resident_layers(L, ell, c, head_s=head, head_start_s=h) <= 1


def test_hand_computed_depth() -> None:
    # 32 layers, load 10 ms, compute 2 ms, no head start: the forward takes 64 ms resident;
    # with r resident the last layer arrives at (32 - r) * 10 ms, then computes 2 ms:
    # (32 - r) * 10 + 2 <= 64  ->  r >= 25.8  ->  26
    assert min_resident_layers(32, 0.010, 0.002) == 26
    # a 100 ms head start covers 10 more layers
    assert min_resident_layers(32, 0.010, 0.002, head_start_s=0.1) == 16


@settings(max_examples=200, deadline=None)
@given(layers, st.data(), seconds, seconds, seconds)
def test_choose_depth(L, data, ell, c, h) -> None:
    asked = data.draw(st.integers(min_value=1, max_value=L))
    prof = DepthProfile(ell, c, 0.0, h, 256)
    spec = choose_depth(L, asked, prof)
    assert (spec.layers, spec.source) == (asked, DepthSource.SPEC)
    fallback = choose_depth(L, None, None)
    assert (fallback.layers, fallback.source) == (L, DepthSource.FALLBACK)
    assert "no measured profile" in fallback.reason
    auto = choose_depth(L, None, prof)
    if ell == 0:
        assert auto.source == DepthSource.FALLBACK and auto.layers == L
    else:
        assert auto.source == DepthSource.PROFILED
        assert auto.layers == max(1, min_resident_layers(L, ell, c, head_start_s=h))
        assert f"{auto.layers} of {L} layers" in auto.reason


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: min_resident_layers(0, 1.0, 1.0), "num_layers"),
        (lambda: min_resident_layers(8, -1.0, 1.0), "layer_load_s"),
        (lambda: min_resident_layers(8, 1.0, math.nan), "layer_compute_s"),
        (lambda: min_resident_layers(8, 1.0, 1.0, head_start_s=math.inf), "head_start_s"),
        (lambda: min_resident_layers(8, 1.0, 1.0, tolerance=-0.1), "tolerance"),
        (lambda: DepthProfile(math.nan, 1.0), "layer_load_s"),
        (lambda: DepthProfile(1.0, 1.0, prompt_tokens=-1), "prompt_tokens"),
        (lambda: choose_depth(8, 9, None), "prewarm layers"),
        (lambda: choose_depth(8, 0, None), "prewarm layers"),
        (lambda: ModelSpec("m", GiB, engine_overhead_bytes=-1), "engine_overhead_bytes"),
    ],
)
def test_bad_inputs_are_refused_with_the_field(call, field) -> None:
    with pytest.raises(PolicyInputError, match=field):
        call()


# ------------------------------------------------------------- the prepared engine's charge


def _one_gpu(free: int, spec: ModelSpec) -> ClusterState:
    return ClusterState(
        (Node("n", (GPU(0, 80 * GiB, free),)),),
        {spec.name: spec},
        forecasts={spec.name: LoadForecast(10.0, 10.0)},
    )


def test_a_replica_is_charged_its_prepared_engine() -> None:
    weights = ModelSpec("m", 8 * GiB, max_batch=32, num_layers=32, prewarm_layers=16)
    engine = ModelSpec("m", 8 * GiB, max_batch=32, num_layers=32, prewarm_layers=16,
                       engine_overhead_bytes=GiB)
    assert weights.prewarm_bytes_per_gpu == 4 * GiB
    assert engine.prewarm_bytes_per_gpu == 5 * GiB
    # the weights fit, the weights and the engine do not: no replica
    plan = plan_prewarm(_one_gpu(5 * GiB - 1, engine))
    assert not plan.place and plan.unplaced
    plan = plan_prewarm(_one_gpu(5 * GiB - 1, weights))
    assert [r.bytes_per_gpu for r in plan.place] == [4 * GiB]
    # placed, it takes the engine's bytes too
    state = _one_gpu(5 * GiB, engine)
    plan = plan_prewarm(state)
    assert [r.bytes_per_gpu for r in plan.place] == [5 * GiB]
    assert apply_plan(state, plan).nodes[0].gpus[0].free_bytes == 0


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=0, max_value=4 * GiB),
    st.integers(min_value=1, max_value=80),
)
def test_a_larger_engine_never_places_more_replicas(n_gpus, overhead, free_gib) -> None:
    def placed(extra: int) -> int:
        spec = ModelSpec("m", 12 * GiB, max_batch=1, num_layers=40, prewarm_layers=10,
                         engine_overhead_bytes=extra)
        free = min(free_gib * GiB, 80 * GiB)
        node = Node("n", tuple(GPU(i, 80 * GiB, free) for i in range(n_gpus)))
        state = ClusterState((node,), {"m": spec}, forecasts={"m": LoadForecast(16.0, 32.0)})
        return len(plan_prewarm(state).place)

    assert placed(overhead) <= placed(0)
