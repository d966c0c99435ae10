"""The operator's side of held demand: the wire format, EndpointSlice discovery (pure), and the
reconciler reading two real gateway replicas (in-process, over HTTP): held requests are summed,
a model at zero instances is started, a stopped replica's demand is gone at the next poll, and a
held request wakes the loop long before its next poll."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from typing import Any

import aiohttp
import pytest
from gw_support import REPO, md
from hypothesis import given
from hypothesis import strategies as st
from warmserve_operator.agents import AgentPool
from warmserve_operator.config import OperatorConfig
from warmserve_operator.gateway_demand import (
    GatewayDemand,
    GatewaySources,
    StaticEndpoints,
    endpoints_from_slices,
    sum_held,
)
from warmserve_operator.reconciler import Reconciler
from warmserve_operator.testing import FakeAgent

from warmserve.api.demand import DemandError, DemandReport, ModelDemand
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import GiB


def _fakes() -> Any:
    spec = importlib.util.spec_from_file_location(
        "operator_fakes_gw", REPO / "tests" / "operator" / "operator_fakes.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


fakes = _fakes()

# ------------------------------------------------------------------------------- wire format

reports = st.builds(
    DemandReport,
    st.text(max_size=20),
    st.floats(0, 2e9, allow_nan=False),
    st.integers(0, 2**40),
    st.dictionaries(
        st.text(min_size=1, max_size=30),
        st.builds(ModelDemand, st.integers(0, 10**6), st.integers(0, 10**6)),
        max_size=5,
    ),
)


@given(reports)
def test_demand_report_round_trips_through_json(r: DemandReport) -> None:
    assert DemandReport.from_json(json.loads(json.dumps(r.to_json()))) == r


@pytest.mark.parametrize(
    "doc, why",
    [
        ([], "JSON object"),
        ({"apiVersion": "v0", "models": {}}, "apiVersion"),
        ({"apiVersion": "warmserve.io/demand/v1", "models": []}, "models"),
        ({"apiVersion": "warmserve.io/demand/v1", "models": {"m": {"held": -1}}}, "held"),
        ({"apiVersion": "warmserve.io/demand/v1", "models": {"m": {"held": True}}}, "held"),
        ({"apiVersion": "warmserve.io/demand/v1", "models": {"m": 3}}, "object"),
        ({"apiVersion": "warmserve.io/demand/v1", "models": {}, "seq": "1"}, "seq"),
    ],
)
def test_bad_demand_documents_are_refused(doc: Any, why: str) -> None:
    with pytest.raises(DemandError, match=why):
        DemandReport.from_json(doc)


def test_sum_over_replicas() -> None:
    a = DemandReport("a", 0, 1, {"x": ModelDemand(2, 9), "y": ModelDemand(0, 3)})
    b = DemandReport("b", 0, 1, {"x": ModelDemand(3, 0), "z": ModelDemand(1, 0)})
    assert sum_held([a, b]) == {"x": 5, "z": 1}


def test_endpoints_from_slices() -> None:
    def ep(addr: str, pod: str, ready: bool = True) -> dict[str, Any]:
        return {
            "addresses": [addr],
            "conditions": {"ready": ready},
            "targetRef": {"kind": "Pod", "name": pod},
        }

    slices = [
        {
            "ports": [{"name": "http", "port": 8000}, {"name": "admin", "port": 9092}],
            "endpoints": [ep("10.0.0.1", "gw-a"), ep("10.0.0.2", "gw-b", ready=False)],
        },
        {  # the same endpoint in a second slice (during an update) counts once
            "ports": [{"name": "admin", "port": 9092}],
            "endpoints": [ep("10.0.0.1", "gw-a"), ep("fd00::5", "gw-c")],
        },
        {"ports": [{"name": "http", "port": 8000}], "endpoints": [ep("10.0.0.9", "other")]},
    ]
    got = endpoints_from_slices(slices, "admin")
    assert [(e.name, e.url) for e in got] == [
        ("gw-a", "http://10.0.0.1:9092"),
        ("gw-b", "http://10.0.0.2:9092"),  # not ready (starting/terminating) may still hold
        ("gw-c", "http://[fd00::5]:9092"),
    ]


def test_no_gateway_configured_means_no_reader() -> None:
    assert GatewaySources().build() is None
    assert GatewaySources(urls=("http://x:1",)).build() is not None


# ------------------------------------------------------------------- reconciler + 2 gateways

CATALOG = {"llama-a": (10 * GiB, 32)}
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _hold(s: aiohttp.ClientSession, api: str, n: int) -> list[asyncio.Task[Any]]:
    async def one() -> int:
        async with s.post(f"{api}/v1/chat/completions", json=CHAT) as r:
            await r.read()
            return r.status

    return [asyncio.create_task(one()) for _ in range(n)]


def _harness(poll_s: float, demand: GatewayDemand) -> tuple[Any, Any, Reconciler]:
    kube = fakes.FakeKube()
    agent = FakeAgent("node-0", 4, catalog=CATALOG)
    kube.add_node("node-0")
    kube.add_md("chat", "llama-a", maxBatchSize=4, minInstances=0, maxInstances=1)
    cfg = OperatorConfig(
        window_s=60.0,
        poll_s=poll_s,
        leader_settle_polls=1,
        autoscaler=AutoscalerConfig(scale_down_delay_s=600.0),
    )
    rec = Reconciler(
        cfg, kube, AgentPool(factory=lambda n, a: agent), clock=fakes.Clock(), demand=demand
    )
    return kube, agent, rec


async def test_held_demand_is_summed_starts_from_zero_and_recovers(make_gateway: Any) -> None:
    gw1, _ = await make_gateway([md("chat", "llama-a", [], max_hold_s=30)])
    gw2, _ = await make_gateway([md("chat", "llama-a", [], max_hold_s=30)])
    demand = GatewayDemand(
        StaticEndpoints((gw1.urls["admin"], gw2.urls["admin"])),
        token_file=gw1.config.demand_token_file,
    )
    kube, agent, rec = _harness(5.0, demand)
    async with aiohttp.ClientSession() as s:
        held = await _hold(s, gw1.urls["api"], 2) + await _hold(s, gw2.urls["api"], 3)
        await asyncio.sleep(0.3)
        await rec.tick()
        await rec.drain_tasks(timeout=5)
        load = kube.mds[("default", "chat")]["status"]["load"]
        assert load["held"] == 5 and load["gatewayReplicas"] == 2 and load["inFlight"] == 0
        # Demand 5 > 0 at zero instances: the autoscaler starts one at this very poll
        # (maxInstances 1), exactly as for load measured at instances.
        assert [c for c, _ in agent.calls].count("activate") == 1
        assert rec.models["llama-a"].tracker.inflight == 5
        # One replica goes away with its held clients: they get an error, never a hang ...
        await gw2.stop()
        results = await asyncio.wait_for(asyncio.gather(*held[2:], return_exceptions=True), 10)
        assert all(isinstance(r, aiohttp.ClientError) for r in results), results
        # ... and the next poll counts the remaining replica only.
        await rec.tick()
        load = kube.mds[("default", "chat")]["status"]["load"]
        assert load["held"] == 2 and load["gatewayReplicas"] == 1
        for t in held[:2]:
            t.cancel()
    await demand.close()


async def test_a_held_request_wakes_the_loop_long_before_its_poll(make_gateway: Any) -> None:
    gw, _ = await make_gateway([md("chat", "llama-a", [], max_hold_s=30)])
    demand = GatewayDemand(
        StaticEndpoints((gw.urls["admin"],)), token_file=gw.config.demand_token_file
    )
    _, agent, rec = _harness(30.0, demand)  # the next poll would come in 30 s
    stop = asyncio.Event()
    loop_task = asyncio.create_task(rec.run(stop))
    try:
        deadline = time.monotonic() + 10
        while rec.models.get("llama-a") is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the first poll has run (and opened the stream)
        await asyncio.sleep(0.5)
        assert not agent.calls
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            held = await _hold(s, gw.urls["api"], 1)
            while not agent.calls and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.02)
            waited = time.monotonic() - t0
            # the start, and with overshoot spares on (the default; demand 1 > a forecast peak
            # of 0, docs/policy.md "Overshoot spares") the same decision prewarms one spare
            calls = [c for c, _ in agent.calls]
            assert calls[0] == "activate" and set(calls[1:]) <= {"prewarm"}, calls
            assert len(calls) <= 2, calls
            assert waited < 3.0, f"the start came {waited:.2f}s after the held request"
            held[0].cancel()
    finally:
        stop.set()
        await asyncio.wait_for(loop_task, 15)
