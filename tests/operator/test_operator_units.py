"""Pure pieces of the operator: history encoding, spec parsing, leader rule, request ids,
status documents and the ``warmserve status`` view."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_operator.identity import MAX_ID, orphans, request_id, teardown
from warmserve_operator.leader import LeaseRecord, next_lease
from warmserve_operator.model_spec import CatalogEntry, resolve_model
from warmserve_operator.observe import observation
from warmserve_operator.snapshot import GpuView, InstanceView, NodeSnapshot, SlotView
from warmserve_operator.status import Condition, merge_conditions, node_status

import warmserve.api.history as history_io
from warmserve.api.crd import SpecError, dedupe_models, parse_gpu_node, parse_model_deployment
from warmserve.api.history import F16_MAX
from warmserve.control.history import HistoryError, LoadHistory
from warmserve.policy.cluster import GiB, InstancePhase, WorkerState

# ---------------------------------------------------------------------------- history

loads = st.floats(min_value=0, max_value=1000, allow_nan=False)


@given(st.lists(st.tuples(loads, loads), min_size=1, max_size=60), st.integers(0, 10**7))
@settings(max_examples=60, deadline=None)
def test_history_roundtrip_is_float16_exact(windows: list[tuple[float, float]], start: int) -> None:
    h = LoadHistory(300.0)
    for i, (a, p) in enumerate(windows):
        h.record(start + i, a, p)
    back = history_io.from_data(history_io.to_data(h, "m"), 300.0)
    assert back.end == start + len(windows) and len(back) == len(windows)
    want = np.array([a for a, _ in windows], dtype=np.float16).astype(float)
    assert np.array_equal(back.avg, want)
    assert np.allclose(back.avg, [a for a, _ in windows], rtol=1e-3, atol=1e-3)


def test_history_gaps_are_imputed_and_series_is_contiguous() -> None:
    h = LoadHistory(43200.0)  # 2 windows a day
    h.record(0, 1.0, 2.0)
    h.record(1, 3.0, 4.0)
    h.record(4, 5.0, 6.0)  # windows 2, 3 missed (operator down)
    avg, peak = h.series(until=6, windows_per_day=2)
    # 2 <- same window a day earlier (0), 3 <- (1), 5 <- (3, imputed = 3.0)
    assert avg == [1.0, 3.0, 1.0, 3.0, 5.0, 3.0]
    assert peak == [2.0, 4.0, 2.0, 4.0, 6.0, 4.0]
    h.record(4, 7.0, 8.0)  # re-closing a window overwrites it (idempotent)
    assert h.series()[0][-1] == 7.0


def test_history_is_bounded_and_saturates() -> None:
    h = LoadHistory(300.0, max_windows=10)
    for i in range(25):
        h.record(i, float(i), float(i))
    assert len(h) == 10 and h.start == 15
    h.record(10**6, 1e9, 1e9)  # a gap longer than the history restarts it
    assert len(h) == 1
    back = history_io.from_data(history_io.to_data(h, "m"), 300.0)
    assert back.peak[-1] == F16_MAX


def test_history_bad_data_is_a_clear_error() -> None:
    with pytest.raises(HistoryError, match="format"):
        history_io.from_data({"format": "x"}, 300.0)
    data = history_io.to_data(LoadHistory(300.0), "m")
    data["avg"] = "not base64!"
    with pytest.raises(HistoryError, match="'avg' is not base64"):
        history_io.from_data(data, 300.0)
    with pytest.raises(HistoryError, match="finite"):
        LoadHistory(300.0).record(0, -1.0, 1.0)
    other = LoadHistory(300.0)
    other.record(5, 1.0, 1.0)
    assert len(history_io.from_data(history_io.to_data(other, "m"), 60.0)) == 0, (
        "other window: fresh start"
    )


# ---------------------------------------------------------------------------- spec


def body(**spec: object) -> dict:
    return {
        "metadata": {"name": "x", "namespace": "ns", "uid": "u", "generation": 2},
        "spec": {"model": {"name": "m"}, **spec},
    }


def test_spec_defaults_and_resolution() -> None:
    md = parse_model_deployment(body())
    assert (md.tp, md.max_batch, md.min_instances, md.max_instances, md.prewarm) == (
        1,
        32,
        0,
        8,
        True,
    )
    spec = resolve_model(md, {"m": CatalogEntry("m", 4 * GiB, 32)}, load_bandwidth=2 * GiB)
    assert spec.cold_start_s == 2.0 and spec.num_layers == 32
    md2 = parse_model_deployment(
        body(model={"name": "m", "coldStartSeconds": 9, "weightBytes": 10}, tensorParallel=2)
    )
    spec2 = resolve_model(md2, {"m": CatalogEntry("m", 4 * GiB, 32)})
    assert spec2.cold_start_s == 9 and spec2.weight_bytes == 10 and spec2.tp == 2


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"tensorParallel": 0}, r"spec.tensorParallel must be in \[1, 64\]"),
        ({"minInstances": 3, "maxInstances": 1}, "spec.minInstances"),
        ({"maxBatchSize": "4"}, "spec.maxBatchSize must be an integer"),
        ({"engine": {"args": [1]}}, "spec.engine.args"),
        ({"prewarm": {"enabled": 1}}, "spec.prewarm.enabled"),
        ({"model": {"name": "m", "numLayers": 2}, "prewarm": {"layers": 3}}, "spec.prewarm.layers"),
        ({"model": {}}, "spec.model.name is required"),
    ],
)
def test_spec_errors_name_the_field(spec: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        parse_model_deployment(body(**spec))


def test_missing_weights_and_duplicates() -> None:
    md = parse_model_deployment(body())
    with pytest.raises(SpecError, match="in no node agent's weight cache"):
        resolve_model(md, {})
    a = parse_model_deployment(
        {
            **body(),
            "metadata": {
                "name": "a",
                "namespace": "n",
                "creationTimestamp": "2026-01-02T00:00:00Z",
            },
        }
    )
    b = parse_model_deployment(
        {
            **body(),
            "metadata": {
                "name": "b",
                "namespace": "n",
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
        }
    )
    owners, dups = dedupe_models([a, b])
    assert owners["m"].name == "b" and [d.name for d in dups] == ["a"]
    with pytest.raises(SpecError, match="host:port"):
        parse_gpu_node({"metadata": {"name": "n"}, "spec": {"agentAddress": "nohost"}})


# ---------------------------------------------------------------------------- leader rule


def test_lease_rule() -> None:
    """One holder at a time; a dead leader is replaced within a lease; a higher priority asks
    the holder to hand over and the holder releases before the asker takes it."""
    first = LeaseRecord("a", 100.0, 15.0, 1, transitions=1)
    assert next_lease(None, "a", 1, 100.0, 15.0) == (True, first)
    held = LeaseRecord("a", 100.0, 15.0, 1, resource_version="7")
    lead, w = next_lease(held, "a", 1, 105.0, 15.0)
    assert lead and w is not None and w.renew_s == 105.0 and w.resource_version == "7"
    assert next_lease(held, "b", 1, 110.0, 15.0) == (False, None), "a live equal waits"
    lead, w = next_lease(held, "b", 0, 116.0, 15.0)
    assert lead and w is not None and w.holder == "b", "an expired lease goes to anyone"
    lead, w = next_lease(held, "c", 5, 110.0, 15.0)
    assert not lead and w is not None and w.holder == "a" and w.preempt_by == "c"
    asked = w
    lead, w = next_lease(asked, "a", 1, 111.0, 15.0)
    assert not lead and w is not None and w.holder == "", "the holder releases"
    lead, w = next_lease(w, "c", 5, 112.0, 15.0)
    assert lead and w is not None and w.holder == "c"
    assert next_lease(asked, "c", 5, 111.0, 15.0) == (False, None), "asked once"


# ---------------------------------------------------------------------------- request ids


@given(st.text(min_size=1, max_size=300), st.text(max_size=80), st.integers(0, 2**63))
@settings(max_examples=80, deadline=None)
def test_request_ids_are_valid_and_deterministic(model: str, node: str, gen: int) -> None:
    rid = request_id("prewarm", model, node, "g0.1", "agent", gen)
    assert 1 <= len(rid) <= MAX_ID and re.fullmatch(r"[A-Za-z0-9._:-]+", rid)
    assert rid == request_id("prewarm", model, node, "g0.1", "agent", gen)
    assert rid != request_id("prewarm", model, node, "g0.1", "agent", gen + 1)


# ---------------------------------------------------------------------------- planning


def snap(node: str, slots: tuple = (), instances: tuple = ()) -> NodeSnapshot:
    gpus = tuple(
        GpuView(i, 80 * GiB, 70 * GiB, WorkerState.UNIVERSAL if slots else WorkerState.IDLE)
        for i in range(2)
    )
    return NodeSnapshot(node, "agent", 7, gpus, slots, instances, {})


def test_orphans_and_teardown_actions() -> None:
    slot = SlotView("s1", "gone", (0,), 4, 4, 4, GiB, GiB, "ready", owner="uid-gone")
    failed = SlotView("s2", "m", (1,), 1, 4, 4, GiB, 4 * GiB, "failed")
    inst = InstanceView("i1", "gone", (1,), "http://x", InstancePhase.SERVING, owner="uid-gone")
    snaps = {"n": snap("n", (slot, failed), (inst,))}
    acts = orphans(snaps, {"m": "uid-m"}, {"uid-m"}, 0.0, {}, 30.0)
    # A serving orphan drains through grace first (the agent refuses to end it directly).
    assert sorted(type(a).__name__ for a in acts) == ["Drain", "Evict", "Evict"]
    assert {getattr(a, "reason", "") for a in acts} >= {"loading failed"}
    td, left = teardown("uid-gone", {"n": snap("n", (slot,), (inst,))}, 0.0, {}, 30.0)
    assert [type(a).__name__ for a in td] == ["Drain", "Evict"]
    assert len(left) == 2
    grace = replace(inst, phase=InstancePhase.GRACE, running=1, grace_started_unix=100.0)
    td, _ = teardown("uid-gone", {"n": snap("n", (), (grace,))}, 110.0, {}, 30.0)
    assert td == [], "a grace instance with a request in flight waits..."
    td, _ = teardown("uid-gone", {"n": snap("n", (), (grace,))}, 130.0, {}, 30.0)
    assert [type(a).__name__ for a in td] == ["EndGrace"], "...until its grace is over"
    assert td[0].evict_weights is True
    idle = replace(grace, running=0)
    td, _ = teardown("uid-gone", {"n": snap("n", (), (idle,))}, 101.0, {}, 30.0)
    assert [type(a).__name__ for a in td] == ["EndGrace"], "an idle one ends at once"
    # Identity is the owner UID, not the model name: another owner's slot is never touched.
    td, left = teardown("uid-dup", {"n": snap("n", (slot,), (inst,))}, 0.0, {}, 30.0)
    assert td == [] and left == []


def test_ownership_by_uid() -> None:
    mine = SlotView("s1", "m", (0,), 4, 4, 4, GiB, GiB, "ready", owner="uid-a")
    foreign = SlotView("s2", "m", (1,), 4, 4, 4, GiB, GiB, "ready", owner="uid-old")
    dead = SlotView("s3", "m", (1,), 4, 4, 4, GiB, GiB, "ready", owner="uid-dead")
    snaps = {"n": snap("n", (mine, foreign, dead))}
    obs = observation(0.0, snaps, {"m": "uid-a"}, {"uid-a", "uid-old"})
    assert [s.id for s in obs.slots if not s.foreign] == ["s1"], "only the owner's is a replica"
    gone = orphans(snaps, {"m": "uid-a"}, {"uid-a", "uid-old"}, 0.0, {}, 30.0)
    assert [a.slot_id for a in gone] == ["s3"], "a live UID's slot is no orphan"


# ---------------------------------------------------------------------------- status


def test_conditions_keep_transition_time_until_status_changes() -> None:
    first = merge_conditions(None, [Condition("Ready", True, "Serving")], 1, "t1")
    same = merge_conditions(first, [Condition("Ready", True, "Serving", "m")], 2, "t2")
    flip = merge_conditions(same, [Condition("Ready", False, "Starting")], 2, "t3")
    assert same[0]["lastTransitionTime"] == "t1" and flip[0]["lastTransitionTime"] == "t3"
    assert flip[0]["status"] == "False" and same[0]["observedGeneration"] == 2


def test_node_status_mirrors_the_agent() -> None:
    slot = SlotView("s1", "m", (0,), 2, 4, 2, GiB, 2 * GiB, "ready")
    st_ = node_status(snap("n", (slot,)), True, "ok", None, "now", 5.0)
    assert st_["gpuCount"] == 2 and st_["workers"]["universal"] == 2
    assert st_["gpus"][0]["slots"][0]["model"] == "m"
    lost = node_status(None, False, "agent down", st_, "later", 5.0)
    assert lost["conditions"][0]["status"] == "False" and "gpus" not in lost


def test_status_cli_view_and_table() -> None:
    from warmserve.cli.status import render, summarize

    node = {
        "metadata": {"name": "gpu-a"},
        "spec": {"agentAddress": "1.2.3.4:5"},
        "status": {
            "conditions": [{"type": "Reachable", "status": "True"}],
            "gpus": [
                {
                    "index": 0,
                    "state": "dedicated",
                    "freeBytes": 0,
                    "slots": [{"model": "m", "state": "active"}],
                },
                {
                    "index": 1,
                    "state": "universal",
                    "freeBytes": 70 * GiB,
                    "slots": [
                        {"model": "m", "layersResident": 2, "layersTotal": 4, "state": "ready"}
                    ],
                },
            ],
            "instances": [
                {"model": "m", "gpus": [0], "phase": "serving", "running": 3, "prewarmHit": True}
            ],
        },
    }
    md = {
        "metadata": {"name": "chat", "namespace": "ns"},
        "spec": {"model": {"name": "m"}, "tensorParallel": 1},
        "status": {
            "load": {"predictedAverage": 2.5, "predictedPeak": 4, "observedAverage": 3},
            "instances": [{"node": "gpu-a", "gpus": [0], "phase": "serving", "running": 3}],
            "prewarmedReplicas": [
                {
                    "node": "gpu-a",
                    "gpus": [1],
                    "kind": "basic",
                    "state": "ready",
                    "layersResident": 2,
                }
            ],
            "prewarm": {"hits": 1, "misses": 1, "hitRatio": 0.5},
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "Degraded", "status": "True", "reason": "NoCapacity", "message": "full"},
            ],
        },
    }
    view = summarize({"nodes": [node], "models": [md]})
    assert view["models"][0]["hitRatio"] == 0.5 and view["nodes"][0]["gpus"][1]["resident"]
    text = render(view)
    assert "m[2/4]" in text and "m (serving, 3 in flight, hit)" in text
    assert "2.5/4.0" in text and "50% (1/2)" in text and "NoCapacity: full" in text
    assert math.isfinite(len(text))


def test_cli_errors_are_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    from warmserve.cli import main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("warmserve status: error: no Kubernetes cluster configured")
    assert main(["operator", "--window-seconds", "7"]) == 2
    assert "must divide a day" in capsys.readouterr().err
    assert main(["operator", "--predictor", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["operator", "--agent-token-file", str(tmp_path / "none")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert main(["operator"]) == 2
    assert "no Kubernetes cluster configured" in capsys.readouterr().err


def test_operator_cli_defaults_are_safe_outside_the_chart() -> None:
    """Metrics bind loopback unless asked (the chart passes 0.0.0.0); a lease, not kopf's
    peering lifetime, bounds a leader handover."""
    import argparse

    from warmserve_operator import cli as operator_cmd

    parser = argparse.ArgumentParser()
    operator_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["operator"])
    assert args.metrics_address == "127.0.0.1"
    assert args.lease_seconds <= 10 and args.peering_lifetime <= 20


def test_kopf_api_retries_never_run_out() -> None:
    """With etcd down for long the operator used to exit once kopf's retries ran out."""
    import itertools

    from warmserve_operator.handlers import RetryForever

    delays = RetryForever()
    first = list(itertools.islice(iter(delays), 200))
    assert first[:3] == [1, 1, 2] and max(first) == 30 and len(first) == 200
    assert list(itertools.islice(iter(delays), 3)) == [1, 1, 2], "re-iterable per request"
    assert not hasattr(delays, "__len__"), "unsized: kopf counts no last attempt"
