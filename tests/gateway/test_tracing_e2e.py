"""Tracing end to end, against a real OpenTelemetry Collector (``hack/testbin/build.sh otelcol``).

A real gateway (aiohttp, in-process), a real node agent whose simulated engines export spans,
and the operator's loop (real agent over gRPC, in-memory API) send their spans to the collector;
the tests read back what it wrote and check the trees: client -> gateway server span -> hold /
upstream client span -> engine span, the operator's start span linked to the held request, and
that with tracing off the gateway exports nothing and invents no ``traceparent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gw_support import REPO, Engines, ListSource, demand_headers, md
from warmserve_agent.config import AgentConfig, parse_simulated_gpus
from warmserve_agent.testing import AgentThread, write_model
from warmserve_gateway.config import GatewayConfig
from warmserve_gateway.server import Gateway
from warmserve_operator import tracing as operator_tracing
from warmserve_operator.agents import AgentAuth, AgentPool
from warmserve_operator.config import OperatorConfig
from warmserve_operator.gateway_demand import GatewayDemand, StaticEndpoints
from warmserve_operator.reconciler import Reconciler

from warmserve.api.agent.client import SyncAgentClient
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.testing.otel import CLIENT, SERVER, Collector, collector, in_trace, one
from warmserve.tracing import TRACEPARENT_RE, TracingConfig

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def _operator_fakes() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "operator_fakes_tracing", REPO / "tests" / "operator" / "operator_fakes.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def otel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    yield from collector(tmp_path_factory.mktemp("otelcol"))


def _agent_config(root: Path, endpoint: str, gpus: str = "4x64MiB") -> AgentConfig:
    write_model(root / "models", "tiny", layers=2, hidden=32, seed=1, profile={"max_batch": 64})
    return AgentConfig(
        model_dir=root / "models",
        simulate_gpus=parse_simulated_gpus(gpus),
        listen="127.0.0.1:0",
        node_name="trace-node",
        memory_dir=root / "mem",
        use_workers=False,
        spare_workers=0,
        host_cache_bytes=32 * 1024**2,
        engine_traces_endpoint=endpoint,
    )


@pytest.fixture(scope="module")
def traced_engines(tmp_path_factory: pytest.TempPathFactory, otel: Collector) -> Iterator[Engines]:
    """An agent whose engines export spans to the collector (``--otlp-traces-endpoint``)."""
    cfg = _agent_config(tmp_path_factory.mktemp("traced-agent"), otel.endpoint)
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
        yield Engines(agent, client)


@pytest.fixture
async def traced_gateway(otel: Collector, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await traced_gateway(objects, tracing=True, mirrored=True, **config) -> (Gateway,
    ListSource)`` (``mirrored``: as ``gw_support.ListSource``); /demand needs
    the token of ``gw.config.demand_token_file`` (``gw_support.demand_headers``)."""
    started: list[Gateway] = []
    token = tmp_path / "demand-token"
    token.write_text("demand-secret-for-tracing-tests\n")

    async def make(
        items: list[Any], tracing: bool = True, mirrored: bool = True, **kw: Any
    ) -> tuple[Gateway, ListSource]:
        src = ListSource(list(items), mirrored=mirrored)
        cfg = GatewayConfig(
            host="127.0.0.1",
            port=0,
            admin_host="127.0.0.1",
            admin_port=0,
            replica="traced",
            demand_token_file=token,
            **kw,
        )
        traces = TracingConfig(otel.endpoint, 1.0, "warmserve-gateway") if tracing else None
        gw = Gateway(cfg, src, tracing=traces)
        await gw.start()
        started.append(gw)
        return gw, src

    yield make
    for gw in started:
        await gw.stop()


def _client_parent() -> tuple[str, str, dict[str, str]]:
    tid, sid = secrets.token_hex(16), secrets.token_hex(8)
    return tid, sid, {"traceparent": f"00-{tid}-{sid}-01", "tracestate": "client=1"}


async def _post(
    s: aiohttp.ClientSession, url: str, headers: dict[str, str], stream: bool = True
) -> int:
    async with s.post(url, json={**CHAT, "stream": stream}, headers=headers) as r:
        await r.read()
        return r.status


def _complete(tid: str) -> Callable[[list[Any]], bool]:
    """The trace ``tid`` has the gateway's server span and the engine's span (they are
    exported separately, by batch processors with a 1 s schedule)."""

    def done(got: list[Any]) -> bool:
        services = {(x.service, x.kind) for x in in_trace(got, tid)}
        return {("warmserve-gateway", SERVER), ("warmserve-engine", SERVER)} <= services

    return done


async def _until(pred: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s}s: {what}")


async def test_a_request_is_traced_from_the_gateway_into_the_engine(
    otel: Collector, traced_engines: Engines, traced_gateway: Any
) -> None:
    iid, url = await asyncio.to_thread(traced_engines.start, "tiny", 0)
    try:
        gw, _ = await traced_gateway([md("chat", "tiny", [(iid, url)])])
        tid, sid, headers = _client_parent()
        async with aiohttp.ClientSession() as s:
            assert await _post(s, gw.urls["api"] + "/v1/chat/completions", headers) == 200
        spans = in_trace(
            otel.wait_for(
                _complete(tid), "the gateway's and the engine's spans in the client's trace"
            ),
            tid,
        )
    finally:
        await asyncio.to_thread(traced_engines.end, iid)
    server = one(spans, service="warmserve-gateway", kind=SERVER)
    assert server.parent == sid  # the client's traceparent was continued
    assert server.name == "POST /v1/chat/completions"
    a = server.attributes
    assert a["http.route"] == "/v1/chat/completions" and a["http.request.method"] == "POST"
    assert a["gen_ai.request.model"] == "tiny" and a["http.response.status_code"] == 200
    assert a["warmserve.ttft_s"] > 0
    # the stream's usage chunk, asked for by the gateway (gen_ai.usage.*; usage.py)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (2, 4)
    assert "gateway.routed" in server.events
    assert not [x for x in spans if x.name == "gateway.hold"]  # an instance had room: no hold
    up = one(spans, service="warmserve-gateway", kind=CLIENT)
    assert up.parent == server.span_id and up.name == "chat tiny"
    assert up.attributes["warmserve.instance.id"] == iid
    assert up.attributes["gen_ai.operation.name"] == "chat"
    assert up.attributes["http.response.status_code"] == 200
    assert up.attributes["gen_ai.usage.output_tokens"] == 4
    assert "gateway.first_byte" in up.events
    engine = one(spans, service="warmserve-engine")
    assert engine.parent == up.span_id  # the gateway's traceparent, not the client's
    assert engine.kind == SERVER and engine.attributes["warmserve.instance.id"] == iid
    assert engine.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert up.start_ns <= engine.start_ns <= up.end_ns <= server.end_ns


async def test_a_held_request_has_a_hold_span_reported_in_demand(
    otel: Collector, traced_engines: Engines, traced_gateway: Any
) -> None:
    gw, src = await traced_gateway([md("chat", "tiny", [], max_hold_s=30)])
    tid, sid, headers = _client_parent()
    async with aiohttp.ClientSession() as s:
        req = asyncio.create_task(_post(s, gw.urls["api"] + "/v1/chat/completions", headers))
        st = gw.dispatcher.state("tiny")
        assert st is not None
        await _until(lambda: st.held == 1, "the request held")
        async with s.get(gw.urls["admin"] + "/demand", headers=demand_headers(gw)) as r:
            report = await r.json()
        assert report["models"]["tiny"]["namespace"] == "default"  # the tenancy format
        traces = report["models"]["tiny"]["traces"]
        assert len(traces) == 1
        m = TRACEPARENT_RE.match(traces[0])
        assert m is not None and m.group(1) == tid and m.group(3) == "01"
        iid, url = await asyncio.to_thread(traced_engines.start, "tiny", 1)
        try:
            obj = md("chat", "tiny", [(iid, url)], max_hold_s=30)
            obj["status"]["instances"][0]["prewarmHit"] = True
            src.modified(obj)
            assert await asyncio.wait_for(req, 20) == 200
            async with s.get(gw.urls["admin"] + "/demand", headers=demand_headers(gw)) as r:
                assert "traces" not in (await r.json())["models"].get("tiny", {})
            spans = in_trace(
                otel.wait_for(_complete(tid), "the held request's gateway and engine spans"),
                tid,
            )
        finally:
            await asyncio.to_thread(traced_engines.end, iid)
    server = one(spans, service="warmserve-gateway", kind=SERVER)
    hold = one(spans, name="gateway.hold")
    assert hold.parent == server.span_id and server.parent == sid
    assert hold.span_id == m.group(2)  # what /demand reported is the hold span
    assert hold.attributes["warmserve.hold.outcome"] == "dispatched"
    assert hold.attributes["warmserve.instance.id"] == iid
    assert hold.attributes["warmserve.prewarm_hit"] is True
    assert hold.duration_s > 0
    up = one(spans, service="warmserve-gateway", kind=CLIENT)
    assert up.start_ns >= hold.end_ns
    assert one(spans, service="warmserve-engine").parent == up.span_id


async def test_hold_spans_follow_the_namespace_caps(
    otel: Collector, traced_gateway: Any
) -> None:
    """Tenancy with tracing on: the held request is in /demand under its model with the
    model's namespace and its hold span's traceparent; a request of the same namespace that
    the per-namespace cap refuses (429) was never held: no hold span, nothing in /demand."""
    objs = [
        md("a1", "a1", [], namespace="team-a", max_hold_s=30),
        md("a2", "a2", [], namespace="team-a", max_hold_s=30),
    ]
    gw, _ = await traced_gateway(
        objs, anonymous_namespaces=("team-a",), max_held_per_namespace=1
    )
    api = gw.urls["api"] + "/v1/chat/completions"
    held_tid, _, held_headers = _client_parent()
    capped_tid, _, capped_headers = _client_parent()

    async def post(s: aiohttp.ClientSession, model: str, headers: dict[str, str]) -> int:
        async with s.post(api, json={**CHAT, "model": model}, headers=headers) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        req = asyncio.create_task(post(s, "a1", held_headers))
        await _until(lambda: gw.dispatcher.held_by_namespace.get("team-a") == 1, "a1 held")
        assert await post(s, "a2", capped_headers) == 429
        async with s.get(gw.urls["admin"] + "/demand", headers=demand_headers(gw)) as r:
            report = await r.json()
        req.cancel()  # the client leaves: the hold ends
        with contextlib.suppress(asyncio.CancelledError):
            await req
    assert set(report["models"]) == {"a1"}
    a1 = report["models"]["a1"]
    assert a1["namespace"] == "team-a" and a1["held"] == 1
    (tp,) = a1["traces"]
    m = TRACEPARENT_RE.match(tp)
    assert m is not None and m.group(1) == held_tid

    def done(got: list[Any]) -> bool:
        return any(x.name == "gateway.hold" for x in in_trace(got, held_tid)) and any(
            x.kind == SERVER for x in in_trace(got, capped_tid)
        )

    spans = otel.wait_for(done, "the held and the capped request's spans")
    hold = one(in_trace(spans, held_tid), name="gateway.hold")
    assert hold.span_id == m.group(2) and hold.attributes["gen_ai.request.model"] == "a1"
    assert hold.attributes["warmserve.hold.outcome"] == "answered_499"  # the client left
    capped = in_trace(spans, capped_tid)
    server = one(capped, service="warmserve-gateway", kind=SERVER)
    assert server.attributes["http.response.status_code"] == 429
    assert server.attributes["gen_ai.request.model"] == "a2"
    assert server.attributes["warmserve.rejected"] == "queue_full"
    assert not [x for x in capped if x.name == "gateway.hold"]


async def test_the_operators_start_span_links_to_the_held_request(
    otel: Collector, traced_gateway: Any, tmp_path: Path
) -> None:
    """A request held at a model with no instance wakes the operator, which starts one on a
    real agent: its ``operator.start`` span links to the request's hold span, and the request,
    served by the new instance, is one trace from the client into the engine."""
    fakes = _operator_fakes()
    cfg = _agent_config(tmp_path, otel.endpoint, gpus="2x64MiB")
    with AgentThread(cfg) as agent:
        kube = fakes.FakeKube()
        kube.add_node("trace-node", agent.address)
        kube.add_md("chat", "tiny", maxBatchSize=4, minInstances=0, maxInstances=1)
        # The gateway reads the GPUNode the operator writes (its agent's instance records), as
        # in a cluster: it routes only to instances an agent reported.
        node = {"apiVersion": "warmserve.io/v1alpha1", "kind": "GPUNode"}
        gw, src = await traced_gateway(
            [md("chat", "tiny", [], max_hold_s=60), {**node, **kube.nodes["trace-node"]}],
            mirrored=False,
        )
        demand = GatewayDemand(
            StaticEndpoints((gw.urls["admin"],)), token_file=gw.config.demand_token_file
        )
        rec = Reconciler(
            OperatorConfig(
                window_s=60.0,
                poll_s=5.0,
                leader_settle_polls=1,
                autoscaler=AutoscalerConfig(scale_down_delay_s=600.0),
            ),
            kube,
            AgentPool(AgentAuth()),
            demand=demand,
        )
        operator_tracing.enable(TracingConfig(otel.endpoint, 1.0, "warmserve-operator"))
        tid, sid, headers = _client_parent()
        try:
            async with aiohttp.ClientSession() as s:
                req = asyncio.create_task(
                    _post(s, gw.urls["api"] + "/v1/chat/completions", headers)
                )
                st = gw.dispatcher.state("tiny")
                assert st is not None
                await _until(lambda: st.held == 1, "the request held")
                await rec.tick()  # demand 1 at zero instances: the start
                await rec.drain_tasks(timeout=30)
                await rec.tick()  # the instance, serving, goes into the status
                obj = {
                    "apiVersion": "warmserve.io/v1alpha1",
                    "kind": "ModelDeployment",
                    **kube.mds[("default", "chat")],
                }
                obj["spec"] = {**obj["spec"], "gateway": {"maxHoldSeconds": 60}}
                assert [i["phase"] for i in obj["status"]["instances"]] == ["serving"]
                src.modified({**node, **kube.nodes["trace-node"]})  # what the watches deliver
                src.modified(obj)
                assert await asyncio.wait_for(req, 30) == 200
        finally:
            operator_tracing.disable()
            await demand.close()
            await rec.agents.close()
        spans = otel.wait_for(
            lambda got: (
                _complete(tid)(got) and any(x.name == "operator.start" for x in got if x.links)
            ),
            "the engine span and the operator's start span",
        )
    hold = one(in_trace(spans, tid), name="gateway.hold")
    start = one(spans, name="operator.start", service="warmserve-operator")
    assert (tid, hold.span_id) in start.links  # the start is linked to the held request
    assert start.attributes["warmserve.model"] == "tiny"
    assert start.attributes["warmserve.node"] == "trace-node"
    assert start.attributes["warmserve.linked_requests"] == 1
    iid = obj["status"]["instances"][0]["id"]
    assert start.attributes["warmserve.instance.id"] == iid
    assert start.attributes["warmserve.prewarm_hit"] is False  # nothing was prewarmed
    assert hold.attributes["warmserve.instance.id"] == iid
    assert hold.start_ns < start.start_ns < hold.end_ns  # the start happened while it waited
    trace = in_trace(spans, tid)
    server = one(trace, service="warmserve-gateway", kind=SERVER)
    up = one(trace, service="warmserve-gateway", kind=CLIENT)
    assert server.parent == sid and up.parent == server.span_id
    assert one(trace, service="warmserve-engine").parent == up.span_id


async def test_with_tracing_off_the_gateway_exports_nothing_and_invents_no_traceparent(
    otel: Collector, traced_engines: Engines, traced_gateway: Any
) -> None:
    """Gateway tracing off, engine tracing on: the engine span shows what the engine received.
    Without a client traceparent it is a root span (none was invented) alone in its trace; with
    one, its parent is exactly the client's span (passed through untouched)."""
    iid, url = await asyncio.to_thread(traced_engines.start, "tiny", 2)
    try:
        gw, _ = await traced_gateway([md("chat", "tiny", [(iid, url)])], tracing=False)
        assert gw.tracing is None
        tid, sid, headers = _client_parent()
        async with aiohttp.ClientSession() as s:
            assert await _post(s, gw.urls["api"] + "/v1/chat/completions", {}) == 200
            assert await _post(s, gw.urls["api"] + "/v1/chat/completions", headers, False) == 200

        def of_instance(got: list[Any]) -> list[Any]:
            return [x for x in got if x.attributes.get("warmserve.instance.id") == iid]

        spans = otel.wait_for(lambda got: len(of_instance(got)) == 2, "two engine spans")
    finally:
        await asyncio.to_thread(traced_engines.end, iid)
    mine = of_instance(spans)
    assert all(x.service == "warmserve-engine" for x in mine)
    passed = one(mine, trace_id=tid)
    assert passed.parent == sid
    root = next(x for x in mine if x is not passed)
    assert root.parent == ""
    assert in_trace(spans, root.trace_id) == [root]  # nothing from the gateway in its trace
    assert not [x for x in in_trace(spans, tid) if x.service == "warmserve-gateway"]


async def test_malformed_client_trace_headers_start_a_new_trace(
    otel: Collector, traced_engines: Engines
) -> None:
    """A malformed ``traceparent`` never fails the request and never reaches the engine: the
    gateway starts its own trace and sends its own context; an oversized path or tracestate is
    bounded."""
    iid, url = await asyncio.to_thread(traced_engines.start, "tiny", 3)
    gw = Gateway(
        GatewayConfig(host="127.0.0.1", port=0, admin_host="127.0.0.1", admin_port=0),
        ListSource([md("chat", "tiny", [(iid, url)])]),
        tracing=TracingConfig(otel.endpoint, 1.0, "warmserve-gateway"),
    )
    await gw.start()
    bad = [
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # zero trace id
        "zz-not-a-traceparent",
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01-" + "x" * 4000,
    ]
    marker = secrets.token_hex(4)
    try:
        async with aiohttp.ClientSession() as s:
            for i, value in enumerate(bad):
                headers = {"traceparent": value, "tracestate": "k=" + "v" * 4000}
                body = {"model": "chat", "prompt": f"{marker} {i}", "max_tokens": 2}
                async with s.post(
                    gw.urls["api"] + "/v1/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
            async with s.get(gw.urls["api"] + "/v1/" + "p" * 5000) as r:
                assert r.status == 404  # not an allowlisted route: the gateway answers, traced
    finally:
        await gw.stop()
        await asyncio.to_thread(traced_engines.end, iid)

    def servers(got: list[Any]) -> list[Any]:
        return [
            x
            for x in got
            if x.service == "warmserve-gateway"
            and x.kind == SERVER
            and x.attributes.get("warmserve.instance.id") is None
        ]

    spans = otel.wait_for(
        lambda got: (
            len([x for x in servers(got) if x.name == "POST /v1/completions"]) >= 3
            and any(x.name == "GET /v1/*" for x in servers(got))
            and len([x for x in got if x.attributes.get("warmserve.instance.id") == iid]) >= 6
        ),
        "the gateway's and the engine's spans of the malformed requests",
    )
    posts = [x for x in servers(spans) if x.name == "POST /v1/completions"]
    assert len(posts) == 3
    for server in posts:
        assert server.parent == ""  # a new trace, not the client's
        assert server.trace_id not in (bad[0][3:35], "a" * 32)
        up = one(spans, kind=CLIENT, parent=server.span_id)
        engine = one(spans, service="warmserve-engine", parent=up.span_id)
        assert engine.trace_id == server.trace_id
    other = one(servers(spans), name="GET /v1/*")
    assert other.attributes["http.route"] == "/v1/*"  # never the client's path as a route
    assert len(other.attributes["url.path"]) <= 256
    assert other.attributes["http.response.status_code"] == 404


def test_tracing_off_imports_no_opentelemetry() -> None:
    """The gateway, operator and agent with tracing off never import the SDK (or the API)."""
    code = (
        "import sys\n"
        "from warmserve_gateway.server import Gateway\n"
        "from warmserve_gateway.config import GatewayConfig\n"
        "import warmserve_operator.reconciler, warmserve_operator.handlers\n"
        "import warmserve_agent.server, warmserve_agent.engines.simulated\n"
        "import warmserve_gateway.cli, warmserve_operator.cli, warmserve_agent.cli\n"
        "class Src:\n"
        "    scopes = (None,)\n"
        "gw = Gateway(GatewayConfig(port=0, admin_port=0), Src())\n"
        "assert gw.tracing is None and not gw.public_app().middlewares\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    assert json.loads(out.stdout.strip().replace("'", '"')) == []
