"""Unit tests of the local stack (``warmserve up``): plan, pods' translation, state records,
processes, history seed, classification and the report — no control plane needed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from warmserve.local import procs
from warmserve.local.history import history_configmap
from warmserve.local.kubelet import _expand, translate_arg
from warmserve.local.model_mix import (
    UpConfigError,
    load_default,
    model_deployments,
    parse,
    parse_gpus,
    simulated_gpus_flag,
    write_weights,
)
from warmserve.local.observe import ModelSample, NodeSample, model_sample
from warmserve.local.replay import CAPPED, DROPPED, OK, Result, classify
from warmserve.local.report import RunData, headline, write
from warmserve.local.state import Stack, StackError, check_can_start
from warmserve.local.summary import rows
from warmserve.local.workload import PlanError, operator_times, plan
from warmserve.policy.predictor import season_length


# ---- scenario ----------------------------------------------------------------------------------
def test_default_scenario_is_a_tp_1_2_4_mix() -> None:
    sc = load_default()
    assert sorted({m.tp for m in sc.models}) == [1, 2, 4]
    assert len(sc.models) >= 3
    # 1/1024 byte scale: an 80 GiB GPU is 80 MiB, a load takes the real time at 2 GiB/s
    assert simulated_gpus_flag(8, 80, sc.byte_scale) == "8x80MiB"
    seven_b = sc.models[0]
    assert sc.cold_start_s(seven_b) == pytest.approx(12.55 / 2.0, rel=0.01)


def test_parse_gpus() -> None:
    assert parse_gpus("2x8x80GiB") == (2, 8, 80.0)
    assert parse_gpus("1x4x40") == (1, 4, 40.0)
    for bad in ("8x80GiB", "2x8x", "0x8x80GiB", "2x99x80GiB", "axbxc"):
        with pytest.raises(UpConfigError):
            parse_gpus(bad)


def test_scenario_errors_name_the_field() -> None:
    good = load_default().models[0].__dict__
    with pytest.raises(UpConfigError, match=r"models\[0\]\.tp must be a number > 0, got 0"):
        parse({"byte_scale": 1024, "copy_gib_per_s": 2, "models": [{**good, "tp": 0}]})
    with pytest.raises(UpConfigError, match="no models"):
        parse({"byte_scale": 1024, "copy_gib_per_s": 2, "models": []})


def test_model_deployments_reactive_differs_only_in_prewarm() -> None:
    sc = load_default()
    on = model_deployments(sc, "ns", prewarm=True)
    off = model_deployments(sc, "ns", prewarm=False)
    for a, b in zip(on, off, strict=True):
        assert a["spec"]["prewarm"] == {"enabled": True}
        assert b["spec"]["prewarm"] == {"enabled": False}
        a["spec"].pop("prewarm")
        b["spec"].pop("prewarm")
        assert a == b


def test_stand_in_weights_have_the_scaled_size_and_real_layers(tmp_path: Path) -> None:
    from warmserve_agent.store import WeightStore

    sc = load_default()
    write_weights(sc, tmp_path)
    store = WeightStore(tmp_path)
    for m in sc.models:
        entry = store.model(m.name)
        assert entry.num_layers == m.layers
        assert entry.weight_bytes == pytest.approx(sc.weight_bytes(m), rel=0.02)
    stamp = (tmp_path / sc.models[0].name / "model.safetensors").stat().st_mtime_ns
    write_weights(sc, tmp_path)  # unchanged configuration: not rewritten
    assert (tmp_path / sc.models[0].name / "model.safetensors").stat().st_mtime_ns == stamp


# ---- plan --------------------------------------------------------------------------------------
def test_operator_times_compress_window_and_day() -> None:
    sc = load_default()
    assert operator_times(sc, 20) == (15.0, 4320.0)
    w, d = operator_times(sc, 20)
    # the predictor's season is still a trace day of 5-minute windows
    assert season_length(w, d) == 288 == season_length(300)
    with pytest.raises(PlanError, match="divide"):
        operator_times(sc, 7)
    with pytest.raises(PlanError, match="between 1 and 1000"):
        operator_times(sc, 0)


def test_count_series_plan_rate_history_and_determinism() -> None:
    sc = load_default()
    p = plan(sc, sc.arrivals, 20, 30)
    assert p.window_s == 15 and p.day_s == 4320
    assert p.duration_s == 90 and p.warmup_s == sc.warmup_windows * 15
    assert np.all(np.diff(p.arrival) >= 0)
    assert p.arrival.min() >= -p.warmup_s and p.arrival.max() < p.duration_s
    rate = len(p) / (p.warmup_s + p.duration_s)
    assert rate == pytest.approx(sc.rps, rel=0.25)  # Poisson around the target rate
    for m in sc.models:
        avg, peak = p.history[m.name]
        assert len(avg) == sc.history_days * 288  # trace days of 5-minute windows
        assert all(pk >= a for a, pk in zip(avg, peak, strict=True))
        assert len(p.planned[m.name][0]) == math.ceil((p.warmup_s + p.duration_s) / 15)
    q = plan(sc, sc.arrivals, 20, 30)
    assert np.array_equal(p.arrival, q.arrival) and np.array_equal(p.model, q.model)


def test_request_level_plan_thins_to_the_rate_and_has_no_history() -> None:
    sc = load_default()
    p = plan(sc, "azure_conv_2023_1h", 20, 30)
    assert len(p) / (p.warmup_s + p.duration_s) == pytest.approx(sc.rps, rel=0.25)
    assert all(not a for a, _ in p.history.values())
    with pytest.raises(PlanError, match="spans 58 trace minutes"):
        plan(sc, "azure_conv_2023_1h", 20, 60)


def test_plan_bad_traces_are_one_line() -> None:
    sc = load_default()
    with pytest.raises(PlanError) as e:
        plan(sc, "no-such-trace", 20, 30)
    assert "trace not found" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PlanError, match="600 s steps"):
        plan(sc, "servegen_language_14d_10min_per_model", 20, 30)
    with pytest.raises(PlanError, match="not a request-count series"):
        plan(sc, "burstgpt1_week1_tokens_per_s_per_minute", 20, 30)


# ---- pods --------------------------------------------------------------------------------------
def test_expand_like_the_kubelet() -> None:
    env = {"POD_IP": "127.1.0.2", "NODE_NAME": "n1"}
    assert _expand("--advertise-host=$(POD_IP)", env) == "--advertise-host=127.1.0.2"
    assert _expand("$$(POD_IP) $(UNKNOWN)", env) == "$(POD_IP) $(UNKNOWN)"


def test_translate_arg_mounts_addresses_and_ports() -> None:
    mounts = {
        "/etc/warmserve/agent-tls": "/tmp/state/pods/op/volumes/agent-tls",
        "/tmp": "/tmp/state/pods/op/volumes/tmp",
        "/models": "/var/models",
        "/dev/shm": "/dev/shm",
    }
    remap = {"8000": "18000", "9092": "19092"}
    t = lambda a: translate_arg(a, "127.9.0.4", mounts, remap)  # noqa: E731
    # a translated path is never translated again (its /tmp prefix is not the /tmp mount)
    assert t("--agent-ca=/etc/warmserve/agent-tls/ca.crt") == (
        "--agent-ca=/tmp/state/pods/op/volumes/agent-tls/ca.crt"
    )
    assert t("--model-dir=/models") == "--model-dir=/var/models"
    assert t("--listen=0.0.0.0:50051") == "--listen=127.9.0.4:50051"
    assert t("--liveness=http://0.0.0.0:8080/healthz") == "--liveness=http://127.9.0.4:8080/healthz"
    assert t("--port=8000") == "--port=18000"
    assert t("--admin-port=9092") == "--admin-port=19092"
    assert t("--max-held=10000") == "--max-held=10000"
    assert t("--modelsx=/modelsx") == "--modelsx=/modelsx"


# ---- state and processes -----------------------------------------------------------------------
def test_check_can_start_refuses_a_running_and_a_stale_stack(tmp_path: Path) -> None:
    check_can_start(tmp_path)  # nothing recorded
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        st = Stack(tmp_path)
        st.add(procs.record_of("sleeper", p.pid))
        with pytest.raises(StackError, match="already running"):
            check_can_start(tmp_path)
    finally:
        p.kill()
        p.wait()
    with pytest.raises(StackError, match="stale") as e:
        check_can_start(tmp_path)
    assert "warmserve down" in str(e.value) and "\n" not in str(e.value)


def test_stack_record_round_trip_and_damage(tmp_path: Path) -> None:
    st = Stack(tmp_path, info={"gateway": "http://127.0.0.1:8000"})
    st.add(procs.ProcRecord("x", 1, 2, "log"))
    back = Stack.load(tmp_path)
    assert back is not None and back.processes == st.processes and back.info == st.info
    (tmp_path / "stack.json").write_text("{not json")
    with pytest.raises(StackError, match="unreadable"):
        Stack.load(tmp_path)


def test_spawned_processes_are_stopped_and_found_by_marker(tmp_path: Path) -> None:
    env = {**os.environ, procs.MARKER_ENV: "unit-test-" + str(os.getpid())}
    # the child starts a grandchild that leaves the group: only the marker finds it
    code = (
        "import subprocess, sys, time;"
        "subprocess.Popen([sys.executable, '-c', 'import os,time; os.setsid(); time.sleep(60)']);"
        "time.sleep(60)"
    )
    _, rec = procs.spawn(
        "parent", [sys.executable, "-c", code], env=env, cwd=tmp_path, log=tmp_path / "log"
    )

    def left_group() -> bool:  # both run, and the grandchild has called setsid()
        pids = procs.marked(env[procs.MARKER_ENV])
        return len(pids) == 2 and any(os.getpgid(p) != rec.pid for p in pids)

    deadline = time.monotonic() + 20
    while not left_group() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left_group()
    assert procs.alive(rec)
    assert procs.stop([rec], timeout_s=5) == []
    assert not procs.alive(rec)
    assert len(procs.marked(env[procs.MARKER_ENV])) == 1  # the one that left the group
    procs.kill_marked(env[procs.MARKER_ENV])
    assert procs.marked(env[procs.MARKER_ENV]) == []
    # a record whose PID now belongs to another process is not alive (start time differs)
    assert not procs.alive(procs.ProcRecord("other", os.getpid(), 1))


def test_port_free() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not procs.port_free("0.0.0.0", port)
    assert procs.port_free("0.0.0.0", port)


# ---- history seed ------------------------------------------------------------------------------
def test_history_seed_is_read_back_by_the_operator() -> None:
    from warmserve.api.history import configmap_name, from_data

    avg = [1.0, 2.5, 0.0, 4.25]
    peak = [2.0, 3.0, 1.0, 6.0]
    cm = history_configmap("ns", "uid-1", "m", 15.0, 1000, avg, peak)
    assert cm["metadata"]["name"] == configmap_name("uid-1")
    h = from_data(cm["data"], 15.0)
    assert h.end == 1000 and len(h) == 4
    a, p = h.series(1000)
    assert a == avg and p == peak


# ---- replay outcomes and the report ------------------------------------------------------------
def _r(status: int, code: str, latency: float = 0.2) -> Result:
    return Result(0, "m", 1.0, 1.0, 0, status=status, code=code, latency_s=latency, ttft_s=0.1)


def test_classify() -> None:
    assert classify(_r(200, "done"), 120) == OK
    assert classify(_r(200, "incomplete_stream"), 120) == DROPPED
    assert classify(_r(429, "queue_full"), 120) == CAPPED
    assert classify(_r(503, "hold_timeout", latency=120.1), 120) == CAPPED
    assert classify(_r(503, "hold_timeout", latency=3.0), 120) == DROPPED  # before the cap
    assert classify(_r(502, "upstream_error"), 120) == DROPPED
    assert classify(_r(0, "ClientConnectorError"), 120) == DROPPED


def _sample(t: float, model: str, hits: int, misses: int, ws: float) -> ModelSample:
    md = {
        "metadata": {"name": model},
        "spec": {"model": {"name": model}},
        "status": {
            "load": {
                "windowStart": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ws)),
                "predictedAverage": 2.0,
                "predictedPeak": 3.0,
                "observedAverage": 1.5,
                "observedPeak": 2.0,
                "inFlight": 1,
                "held": 0,
            },
            "prewarm": {"hits": hits, "misses": misses},
            "instances": [{"phase": "serving"}],
            "prewarmedReplicas": [{"state": "ready"}],
        },
    }
    return model_sample(t, md)


def test_rows_count_the_measured_period_only() -> None:
    res = []
    for i, (planned, outcome) in enumerate([(-1.0, OK), (1.0, OK), (2.0, CAPPED), (3.0, DROPPED)]):
        r = _r(200, "done")
        r.index, r.planned_s, r.outcome = i, planned, outcome
        res.append(r)
    samples = [_sample(-5, "m", 3, 2, 0), _sample(0.5, "m", 3, 2, 0), _sample(9, "m", 7, 3, 0)]
    m, total = rows(["m"], res, samples)
    assert (m.sent, m.ok, m.capped, m.dropped) == (3, 1, 1, 1)
    assert (m.hits, m.cold) == (4, 1)  # warm-up starts are not counted
    assert total.hits == 4 and total.ok == 1


def test_report_files_and_headline(tmp_path: Path) -> None:
    sc = load_default()
    p = plan(sc, sc.arrivals, 20, 10)
    runs = []
    t0 = 1_800_000_000.0
    for label, p99 in (("warmserve", 0.3), ("reactive", 6.0)):
        res = []
        for i in range(len(p)):
            r = _r(200, "done")
            r.index, r.model, r.planned_s = i, p.models[int(p.model[i])], float(p.arrival[i])
            r.ttft_s, r.outcome = (p99 if i % 50 == 0 else 0.1), OK
            res.append(r)
        ms = [
            _sample(t, m, int(t) // 10, 1, t0 + (t // 15) * 15)
            for t in range(-40, 40, 5)
            for m in p.models
        ]
        ns = [
            NodeSample(t, "gpu-node-1", True, ["idle", "universal", "dedicated", "grace"])
            for t in range(-40, 40, 5)
        ]
        runs.append(RunData(label, p, res, ms, ns, t0))
    summary = write(runs, tmp_path, {"note": "synthetic"})
    for f in ("report.md", "summary.json", "requests-warmserve.jsonl", "samples-reactive.json"):
        assert (tmp_path / f).is_file()
    for png in summary["plots"].values():
        assert Path(png).stat().st_size > 10_000
    assert "warmserve" in headline(runs) and "reactive" in headline(runs)
    assert json.loads((tmp_path / "summary.json").read_text())["runs"]["reactive"]["rows"]


def test_live_view_renders_models_and_gpus() -> None:
    from rich.console import Console

    from warmserve.local.replay import Replayer
    from warmserve.local.view import View

    sc = load_default()
    p = plan(sc, sc.arrivals, 20, 10)
    sampler = type("S", (), {})()
    sampler.models = {m: _sample(1.0, m, 3, 1, 0) for m in p.models}
    sampler.nodes = {"gpu-node-1": NodeSample(1.0, "gpu-node-1", True, ["idle", "dedicated"])}
    sampler.errors, sampler.last_error = 0, ""
    rp = Replayer(p, ["http://127.0.0.1:1"], 120)
    rp.t0 = time.monotonic()
    r = _r(200, "done")
    r.model, r.outcome = p.models[0], OK
    rp.results.append(r)
    lines: list[str] = []
    view = View("title", sampler, rp, ["export KUBECONFIG=/x"], tty=False, log=lines.append)
    console = Console(width=200, record=True)
    console.print(view.render())
    text = console.export_text()
    for needle in (*p.models, "gpu-node-1", "HITS/COLD", "75%", "export KUBECONFIG=/x", "1/0/0"):
        assert needle in text, needle
    with view:
        view.tick()
    assert lines and "sent=0 ok=1" in lines[0]
