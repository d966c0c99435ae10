"""Simulator invariants: conservation, determinism, capacity, cold-start cost, engine arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sim.conftest import make_doc
from warmserve.sim import result_rows, runner
from warmserve.sim.model import DROP_QUEUE_TIMEOUT
from warmserve.sim.scenario import parse

AUTOSCALING = [
    "warmserve",
    "warmserve-no-proactive",
    "warmserve-no-evict-aware",
    "reactive",
    "sllm-gpu",
]


def _run(doc, system):
    prep = runner.prepare(parse(doc))
    out, wall = runner.run_system(prep, system, record=True)
    names = [m.spec.name for m in prep.models]
    row = result_rows.summarize(out, names, wall)
    return prep, out, row


@pytest.fixture(scope="module")
def busy_prep():
    """Bursty load on a small node so that instances start and stop."""
    doc = make_doc(**{"workload.total_rps": 12, "cluster.gpus_per_node": 4})
    return runner.prepare(parse(doc))


@pytest.mark.parametrize("system", [*AUTOSCALING, "dedicated"])
def test_conservation_every_request_served_or_dropped(busy_prep, system):
    out, wall = runner.run_system(busy_prep, system, check=True, record=True)
    names = [m.spec.name for m in busy_prep.models]
    row = result_rows.summarize(out, names, wall)
    result_rows.check_conservation(row)
    served = ~np.isnan(out.finish)
    dropped = np.array([d is not None for d in out.drop])
    assert not (served & dropped).any()
    assert (served | dropped).all()
    # Causality for every served request: arrival <= assigned <= first token <= finish.
    arr = busy_prep.requests.arrival
    assert (out.assigned[served] >= arr[served] - 1e-9).all()
    assert (out.first_token[served] >= out.assigned[served] - 1e-9).all()
    assert (out.finish[served] >= out.first_token[served] - 1e-9).all()


def test_drops_carry_reasons_when_the_queue_times_out():
    # One GPU, two models: the second model can only run when the first lets go.
    doc = make_doc(
        **{
            "cluster.gpus_per_node": 1,
            "models": [
                {"name": "a", "arch": "llama2-7b", "tp": 1, "trace_day": 3},
                {"name": "c", "arch": "llama2-7b", "tp": 1, "trace_day": 4},
            ],
            "workload.total_rps": 20,
            "policy.queue_timeout_s": 5,
            "policy.drain_s": 60,
        }
    )
    _, _, row = _run(doc, "reactive")
    result_rows.check_conservation(row)
    assert row["dropped"] > 0
    assert set(row["drop_reasons"]) <= {DROP_QUEUE_TIMEOUT, "unfinished-at-end"}
    assert row["drop_reasons"].get(DROP_QUEUE_TIMEOUT, 0) > 0


def test_same_seed_same_results_and_other_seed_differs(tiny_doc):
    rows = []
    for seed in (7, 7, 8):
        tiny_doc["seed"] = seed
        _, out, row = _run(tiny_doc, "warmserve")
        for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s", "sim_requests_per_cpu_s",
                    "setup_cpu_s"):
            row.pop(key, None)
        rows.append((row, out.first_token))
    assert rows[0][0] == rows[1][0]
    np.testing.assert_array_equal(rows[0][1], rows[1][1])
    assert rows[0][0]["requests"] != rows[2][0]["requests"] or not np.array_equal(
        rows[0][1], rows[2][1]
    )


@pytest.mark.parametrize("system", ["warmserve", "reactive", "sllm-gpu"])
def test_unlimited_gpus_nothing_waits_for_capacity(system):
    doc = make_doc(**{"cluster.nodes": 16, "workload.total_rps": 12})
    prep, out, row = _run(doc, system)
    assert row["start_failures"] == 0
    assert row["dropped"] == 0
    # A request waits at most for the slowest start plus the prefill batch ahead of it.
    worst_start = max((s.latency_s for s in out.starts), default=0.0)
    wait = out.assigned - prep.requests.arrival
    assert np.nanmax(wait) <= worst_start + 1.0


def test_dedicated_with_room_to_spare_never_queues():
    doc = make_doc(**{"cluster.nodes": 4, "workload.total_rps": 2})
    prep, out, row = _run(doc, "dedicated")
    wait = out.assigned - prep.requests.arrival
    assert row["dropped"] == 0
    assert np.nanmax(wait) == pytest.approx(0.0, abs=1e-9)


def test_without_prewarming_every_start_pays_the_full_cold_start(busy_prep):
    out, _ = runner.run_system(busy_prep, "reactive")
    assert out.starts, "the busy scenario must scale"
    cold = {m.spec.name: m.engine.cold_start_s() for m in busy_prep.models}
    for s in out.starts:
        assert not s.hit
        assert s.latency_s >= cold[s.model] - 1e-9


def test_warmserve_hits_pay_only_activation(busy_prep):
    out, _ = runner.run_system(busy_prep, "warmserve")
    hits = [s for s in out.starts if s.hit]
    assert hits, "warmserve should start some instances on prewarmed replicas"
    act = busy_prep.profile.startup.activation_s
    assert min(s.latency_s for s in hits) == pytest.approx(act, rel=1e-6)
    cold = min(m.engine.cold_start_s() for m in busy_prep.models)
    assert max(s.latency_s for s in hits) < cold


def test_single_request_matches_hand_calculation():
    # A dedicated instance, requests far apart: TTFT = prefill, decode = (out-1) equal steps.
    doc = make_doc(**{"workload.total_rps": 0.02, "cluster.nodes": 2})
    prep, out, _ = _run(doc, "dedicated")
    m = prep.models
    checked = 0
    for i in range(len(prep.requests)):
        arr = prep.requests.arrival[i]
        neighbours = np.abs(prep.requests.arrival - arr)
        neighbours[i] = math.inf
        neighbours[prep.requests.model != prep.requests.model[i]] = math.inf
        if neighbours.min() < 40:
            continue
        eng = m[prep.requests.model[i]].engine
        n_in = int(prep.requests.input_tokens[i])
        n_out = int(prep.requests.output_tokens[i])
        ttft = out.first_token[i] - arr
        assert ttft == pytest.approx(eng.prefill_s(n_in), rel=1e-9)
        if n_out > 1:
            step = eng.decode_step_s(1, n_in)
            assert out.finish[i] - out.first_token[i] == pytest.approx((n_out - 1) * step, rel=1e-6)
        checked += 1
    assert checked >= 1


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rps=st.floats(0.5, 25.0),
    alpha=st.floats(0.0, 2.5),
    gpus=st.sampled_from([2, 4, 8]),
    system=st.sampled_from([*AUTOSCALING, "dedicated"]),
)
def test_conservation_holds_for_any_small_scenario(seed, rps, alpha, gpus, system):
    doc = make_doc(
        **{
            "seed": seed,
            "workload.total_rps": rps,
            "workload.alpha": alpha,
            "workload.duration_s": 300,
            "cluster.gpus_per_node": gpus,
            "policy.drain_s": 120,
        }
    )
    _, out, row = _run(doc, system)
    result_rows.check_conservation(row)
    served = ~np.isnan(out.finish)
    assert all((d is None) == s for d, s in zip(out.drop, served, strict=True))
    assert row["gpu_hours"] <= gpus * 300 / 3600 + 1e-9


@pytest.fixture(scope="module")
def lending_prep():
    """Load high enough that instances drain while others scale up: grace lending happens."""
    doc = make_doc(**{"workload.total_rps": 30, "workload.duration_s": 1200})
    return runner.prepare(parse(doc))


def test_proactive_prewarming_lends_grace_memory_and_ablation_does_not(lending_prep):
    with_lending, _ = runner.run_system(lending_prep, "warmserve", check=True)
    without, _ = runner.run_system(lending_prep, "warmserve-no-proactive", check=True)
    assert with_lending.lent_placements > 0
    assert without.lent_placements == 0


@pytest.mark.parametrize("system", ["warmserve-no-evict-aware", "sllm-gpu"])
def test_state_invariants_hold_for_other_systems(lending_prep, system):
    out, _ = runner.run_system(lending_prep, system, check=True)
    assert out.events > 0
