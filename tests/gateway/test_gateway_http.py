"""The gateway's HTTP behaviour against real simulated engines (an agent with simulated GPUs):
OpenAI routes, SSE passed through chunk by chunk, errors in OpenAI's shape, holding and its caps,
disconnects, retry before the first byte, grace instances, the demand endpoint."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.gateway.gw_support import MDS, NODES, Engines, demand_headers, md

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


async def post(
    s: aiohttp.ClientSession, url: str, body: Any, **kw: Any
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    async with s.post(url, data=data, headers=headers, **kw) as r:
        raw = await r.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = raw
        return r.status, dict(r.headers), doc


def assert_openai_error(doc: Any, code: str) -> None:
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["code"] == code and doc["error"]["message"], doc


@pytest.fixture(scope="module")
def tiny(engines: Engines) -> list[tuple[str, str]]:
    """Two serving instances of the fast model."""
    return [engines.start("tiny", 0), engines.start("tiny", 1)]


@pytest.fixture(scope="module")
def slow(engines: Engines) -> tuple[str, str]:
    return engines.start("slow", 2)


async def test_openai_routes_and_model_names(make_gateway: Any, tiny: Any) -> None:
    gw, _ = await make_gateway(
        [md("chat", "tiny", tiny, namespace="team-a")], anonymous_namespaces=("team-a",)
    )
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api}/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == "tiny" and card["ready"] is True and card["instances"] == 2
        assert card["deployment"] == "team-a/chat"
        # By spec.model.name, by the deployment's name and by namespace/name; the engine always
        # gets spec.model.name.
        for name in ("tiny", "chat", "team-a/chat"):
            st, _, doc = await post(s, f"{api}/v1/chat/completions", {"model": name, **CHAT})
            assert st == 200, doc
            assert doc["object"] == "chat.completion" and doc["model"] == "tiny"
            assert doc["choices"][0]["message"]["content"]
        st, _, doc = await post(
            s, f"{api}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        )
        assert st == 200 and doc["object"] == "text_completion" and doc["choices"][0]["text"]
        async with s.get(f"{api}/v1/models/chat") as r:
            assert r.status == 200 and (await r.json())["id"] == "tiny"
        # Only allowlisted routes go to engines (--route adds some): the gateway answers 404.
        st, _, doc = await post(s, f"{api}/v1/tokenize", {"model": "tiny", "prompt": "x"})
        assert st == 404
        assert_openai_error(doc, "not_found")
        # An allowlisted route the model's engine lacks (a generative model's embeddings): the
        # engine's 404 becomes one in OpenAI's shape naming model and route.
        st, _, doc = await post(s, f"{api}/v1/embeddings", {"model": "tiny", "input": "x"})
        assert st == 404
        assert_openai_error(doc, "unsupported_route")
        async with s.get(f"{api}/healthz") as r:
            assert r.status == 200
        async with s.get(f"{api}/nope") as r:
            assert r.status == 404
            assert_openai_error(await r.json(), "not_found")


async def test_sse_is_passed_through_chunk_by_chunk(make_gateway: Any, slow: Any) -> None:
    gw, _ = await make_gateway([md("slow", "slow", [slow])])
    body = {"model": "slow", "prompt": "a", "max_tokens": 20, "stream": True}  # ~1 s at 20 tok/s
    arrivals: list[float] = []
    events: list[bytes] = []
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(f"{gw.urls['api']}/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data:"):
                    arrivals.append(time.monotonic() - t0)
                    events.append(line)
    assert events[-1].strip() == b"data: [DONE]"
    chunks = [json.loads(e[5:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks).split()  # the text arrived
    # Buffered, every event would arrive at the end; passed through, the first one arrives
    # long before the last (the engine paces 20 tokens over ~1 s).
    assert arrivals[-1] - arrivals[0] > 0.5, arrivals


async def test_errors_use_the_openai_shape(make_gateway: Any, tiny: Any) -> None:
    gw, _ = await make_gateway([md("chat", "tiny", tiny)], max_body_bytes=4096)
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        st, _, doc = await post(s, f"{api}/v1/chat/completions", b"{not json")
        assert st == 400
        assert_openai_error(doc, "invalid_json")
        st, _, doc = await post(s, f"{api}/v1/chat/completions", [1, 2])
        assert st == 400
        assert_openai_error(doc, "invalid_json")
        st, _, doc = await post(s, f"{api}/v1/chat/completions", CHAT)
        assert st == 400
        assert_openai_error(doc, "missing_model")
        assert doc["error"]["param"] == "model"
        st, _, doc = await post(s, f"{api}/v1/chat/completions", {"model": "gpt-9", **CHAT})
        assert st == 404
        assert_openai_error(doc, "model_not_found")
        big = {"model": "tiny", "prompt": "x" * 5000}
        st, _, doc = await post(s, f"{api}/v1/completions", big)
        assert st == 413
        assert_openai_error(doc, "request_too_large")
        # A header line over --max-header-bytes is refused by the HTTP parser.
        async with s.get(f"{api}/v1/models", headers={"X-Big": "y" * 20000}) as r:
            assert r.status in (400, 431)


async def test_ambiguous_and_duplicate_deployments(make_gateway: Any, tiny: Any) -> None:
    objs = [
        md("chat", "tiny", tiny, namespace="a", created="2026-01-01T00:00:00Z"),
        md("chat", "other", [], namespace="b", created="2026-01-02T00:00:00Z"),
        md("dup", "tiny", [], namespace="c", created="2026-01-03T00:00:00Z"),
    ]
    gw, _ = await make_gateway(objs, anonymous_namespaces=("a", "b", "c"))
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        st, _, doc = await post(s, f"{api}/v1/chat/completions", {"model": "chat", **CHAT})
        assert st == 400
        assert_openai_error(doc, "ambiguous_model")
        assert "a/chat" in doc["error"]["message"] and "b/chat" in doc["error"]["message"]
        st, _, doc = await post(s, f"{api}/v1/chat/completions", {"model": "a/chat", **CHAT})
        assert st == 200
        # The newer deployment of the same weights is the operator's DuplicateModel: not served,
        # answered at once without naming the deployment that serves the model.
        st, headers, doc = await post(s, f"{api}/v1/chat/completions", {"model": "c/dup", **CHAT})
        assert st == 503 and "Retry-After" in headers
        assert_openai_error(doc, "model_unavailable")
        msg = doc["error"]["message"]
        assert "DuplicateModel" in msg and "a/chat" not in msg


async def test_api_keys_from_a_mounted_secret(make_gateway: Any, tiny: Any, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "team-a").write_text("sk-alpha\n")
    (keys / "team-b").write_text("sk-beta")
    (keys / "..data").mkdir()  # what a mounted Secret also contains
    gw, _ = await make_gateway([md("chat", "tiny", tiny)], api_keys=keys)
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-alpha"}):
            async with s.get(f"{api}/v1/models", headers=headers) as r:
                assert r.status == 401
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                assert_openai_error(await r.json(), "invalid_api_key")
        for key in ("sk-alpha", "sk-beta"):
            hdr = {"Authorization": f"Bearer {key}"}
            st, _, doc = await post(
                s, f"{api}/v1/chat/completions", {"model": "tiny", **CHAT}, headers=hdr
            )
            assert st == 200, doc
        async with s.get(f"{api}/healthz") as r:  # probes need no key
            assert r.status == 200


async def test_holding_fifo_until_room(make_gateway: Any, slow: Any) -> None:
    # maxBatchSize 1: one request at a time per instance; the others wait in arrival order.
    gw, _ = await make_gateway([md("slow", "slow", [slow], max_batch=1)])
    api = gw.urls["api"]
    order: list[int] = []

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        st, _, _ = await post(s, f"{api}/v1/completions", {"model": "slow", "max_tokens": 12})
        order.append(i)
        return st

    async with aiohttp.ClientSession() as s:
        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(one(s, i)))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        st = gw.dispatcher.state("slow")
        assert st is not None and st.held == 3 and st.inflight == 1
        r = await s.get(f"{gw.urls['admin']}/demand", headers=demand_headers(gw))
        demand = await r.json()
        assert demand["models"]["slow"] == {"held": 3, "inflight": 1, "namespace": "default"}
        assert await asyncio.gather(*tasks) == [200] * 4
    assert order == [0, 1, 2, 3]
    assert gw.dispatcher.check_invariant(st)


async def test_queue_cap_429_hold_timeout_503_and_disconnects(make_gateway: Any) -> None:
    # No instance at all (scaled to zero): everything is held.
    objs = [md("cold", "cold", [], max_queue=2, max_hold_s=1.0)]
    gw, _ = await make_gateway(objs)
    api = gw.urls["api"]
    body = {"model": "cold", **CHAT}
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(post(s, f"{api}/v1/chat/completions", body) for _ in range(5))
        )
        codes = sorted(r[0] for r in results)
        assert codes == [429, 429, 429, 503, 503], codes
        for st, headers, doc in results:
            assert int(headers["Retry-After"]) >= 1
            assert_openai_error(doc, "queue_full" if st == 429 else "hold_timeout")
        assert 0.9 < time.monotonic() - t0 < 5
        # A held client that disconnects leaves the queue at once.
        task = asyncio.create_task(post(s, f"{api}/v1/chat/completions", body))
        await asyncio.sleep(0.2)
        assert gw.dispatcher.state("cold").held == 1  # type: ignore[union-attr]
        task.cancel()
        await asyncio.sleep(0.2)
        assert gw.dispatcher.state("cold").held == 0  # type: ignore[union-attr]
        text = await (await s.get(f"{gw.urls['admin']}/metrics")).text()
    assert 'warmserve_gateway_held_disconnects_total{model="cold"} 1.0' in text
    assert 'warmserve_gateway_rejected_total{model="cold",reason="queue_full"} 3.0' in text
    assert 'warmserve_gateway_requests_total{code="503",model="cold"} 2.0' in text


async def test_global_cap_and_unservable_deployments(make_gateway: Any) -> None:
    objs = [
        md("a", "a", [], max_queue=10, max_hold_s=30),
        md("b", "b", [], max_queue=10, max_hold_s=30),
        md("off", "off", [], max_instances=0),
        md("broken", "broken", [], ready_reason="Unplaceable"),
    ]
    gw, _ = await make_gateway(objs, max_held=2)
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        held = [
            asyncio.create_task(post(s, f"{api}/v1/chat/completions", {"model": m, **CHAT}))
            for m in ("a", "b")
        ]
        await asyncio.sleep(0.2)
        st, headers, doc = await post(s, f"{api}/v1/chat/completions", {"model": "a", **CHAT})
        assert st == 429 and "--max-held" in doc["error"]["message"]
        for name, why in (("off", "maxInstances 0"), ("broken", "Unplaceable")):
            t0 = time.monotonic()
            st, headers, doc = await post(s, f"{api}/v1/chat/completions", {"model": name, **CHAT})
            assert st == 503 and why in doc["error"]["message"] and "Retry-After" in headers
            assert time.monotonic() - t0 < 1.0  # at once, not after the hold time
        for t in held:
            t.cancel()


async def test_held_requests_go_out_when_an_instance_starts_serving(
    make_gateway: Any, engines: Engines
) -> None:
    obj = md("late", "tiny", [], max_hold_s=30)
    gw, src = await make_gateway([obj])
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        tasks = [
            asyncio.create_task(post(s, f"{api}/v1/chat/completions", {"model": "late", **CHAT}))
            for _ in range(3)
        ]
        await asyncio.sleep(0.3)
        assert gw.dispatcher.state("tiny").held == 3  # type: ignore[union-attr]
        iid, url = await asyncio.to_thread(engines.start, "tiny", 3)
        try:
            # starting: still nothing; serving: the queue drains
            src.modified(md("late", "tiny", [(iid, url, "starting")], max_hold_s=30))
            await asyncio.sleep(0.2)
            assert all(not t.done() for t in tasks)
            src.modified(md("late", "tiny", [(iid, url, "serving")], max_hold_s=30))
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            assert [r[0] for r in results] == [200, 200, 200]
        finally:
            await asyncio.to_thread(engines.end, iid)


async def test_grace_instances_get_no_new_requests(make_gateway: Any, tiny: Any) -> None:
    (a_id, a_url), (b_id, b_url) = tiny
    gw, _ = await make_gateway([md("chat", "tiny", [(a_id, a_url, "grace"), (b_id, b_url)])])
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            st, _, _ = await post(
                s, f"{gw.urls['api']}/v1/chat/completions", {"model": "tiny", **CHAT}
            )
            assert st == 200
    st = gw.dispatcher.state("tiny")
    assert st is not None and set(st.endpoints) == {b_id}


async def test_a_dead_engine_is_retried_once_on_another_instance(
    make_gateway: Any, tiny: Any, engines: Engines
) -> None:
    # A real instance that ended: its port refuses connections (before any byte).
    dead_id, dead_url = await asyncio.to_thread(engines.start, "tiny", 3)
    await asyncio.to_thread(engines.end, dead_id)
    live_id, live_url = tiny[0]
    # Ejected for longer than the test runs: with the default 2 s a loaded machine let the dead
    # one back in before the last request (a second refusal, a flaky count).
    objs = [md("chat", "tiny", [(dead_id, dead_url), (live_id, live_url)])]
    gw, _ = await make_gateway(objs, eject_s=600.0)
    refused = 'warmserve_gateway_upstream_errors_total{kind="connect",model="tiny"} 1.0'
    async with aiohttp.ClientSession() as s:

        async def served_one() -> str:
            st, _, doc = await post(
                s, f"{gw.urls['api']}/v1/chat/completions", {"model": "tiny", **CHAT}
            )
            assert st == 200, doc
            return await (await s.get(f"{gw.urls['admin']}/metrics")).text()

        # Ties between the two idle instances break at random: send until the dead one was
        # picked (each request picks it with probability 1/2 while it is not ejected).
        for _ in range(40):
            if refused in await served_one():
                break
        for _ in range(8):
            text = await served_one()
    # The dead one refused once, the request went elsewhere, then it was ejected (no further
    # attempts).  A refusal is not the one retry: the engine never saw the request.
    assert refused in text
    assert 'warmserve_gateway_retries_total{model="tiny"} 1.0' not in text


async def test_every_instance_refusing_holds_the_request_until_one_serves(
    make_gateway: Any, tiny: Any, engines: Engines
) -> None:
    """The operator ended a model's last instances between two discovery updates (scale to
    zero; seen in `warmserve up`: both ended 0.26 s after their drain, a request sent 0.2 s
    later got 502).  Refused connections are held like requests at a model without an
    instance, and served once an instance appears; only at the hold deadline does the client
    get an error, and then the hold timeout's 503 with Retry-After."""
    dead = []
    for _ in range(2):  # two ended instances (GPU 3 reused): the old single retry hit the 2nd
        dead_id, dead_url = await asyncio.to_thread(engines.start, "tiny", 3)
        await asyncio.to_thread(engines.end, dead_id)
        dead.append((dead_id, dead_url))
    live_id, live_url = tiny[0]
    obj = md("gone", "tiny", dead, max_hold_s=20)
    gw, src = await make_gateway([obj])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            post(s, f"{gw.urls['api']}/v1/chat/completions", {"model": "gone", **CHAT})
        )
        st = None
        for _ in range(100):  # refused by both ended instances, then held (slower under load)
            await asyncio.sleep(0.1)
            st = gw.dispatcher.state("tiny")
            if task.done() or (st is not None and st.held == 1):
                break
        assert not task.done()
        assert st is not None and st.held == 1, "held: its demand starts an instance"
        src.modified(md("gone", "tiny", [(live_id, live_url)], max_hold_s=20))
        code, _, doc = await asyncio.wait_for(task, 10)
    assert code == 200, doc
    # Nothing appears before the hold deadline: 503 + Retry-After, as for any held request.
    gw2, _ = await make_gateway([md("gone2", "tiny", dead, max_hold_s=1)])
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            f"{gw2.urls['api']}/v1/chat/completions", json={"model": "gone2", **CHAT}
        )
        doc = await r.json()
    assert r.status == 503 and "Retry-After" in r.headers, doc
    assert_openai_error(doc, "hold_timeout")


async def test_deleted_deployment_fails_its_held_requests(make_gateway: Any) -> None:
    obj = md("bye", "bye", [], max_hold_s=30)
    gw, src = await make_gateway([obj])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            post(s, f"{gw.urls['api']}/v1/chat/completions", {"model": "bye", **CHAT})
        )
        await asyncio.sleep(0.2)
        src.deleted(obj)
        st, _, doc = await asyncio.wait_for(task, 5)
    assert st == 404
    assert_openai_error(doc, "model_not_found")


async def test_demand_watch_stream_reports_held_edges(make_gateway: Any) -> None:
    gw, _ = await make_gateway([md("cold", "cold", [], max_hold_s=30)])
    api, admin = gw.urls["api"], gw.urls["admin"]
    seen: list[int] = []
    tasks: list[asyncio.Task[Any]] = []

    async def drain(r: aiohttp.ClientResponse, wait: float) -> None:
        """Read the lines the stream sends within ``wait`` seconds (heartbeats are empty)."""
        try:
            while True:
                line = await asyncio.wait_for(r.content.readline(), wait)
                if line.strip():
                    doc = json.loads(line)
                    seen.append(doc["models"].get("cold", {}).get("held", 0))
        except TimeoutError:
            pass

    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{admin}/demand", params={"watch": "1"}, headers=demand_headers(gw)) as r,
    ):
        await drain(r, 0.3)  # the current report comes at once
        assert seen == [0]
        for _ in range(5):
            body = {"model": "cold", **CHAT}
            tasks.append(asyncio.create_task(post(s, f"{api}/v1/chat/completions", body)))
            await drain(r, 0.3)
        for t in tasks:
            t.cancel()
    # 0 -> 1, then each doubling (2, 4): a burst costs a handful of wake-ups, not one per request
    assert seen == [0, 1, 2, 4], seen


async def test_ready_only_once_every_watched_namespace_is_listed() -> None:
    from warmserve_gateway.config import GatewayConfig
    from warmserve_gateway.server import Gateway

    from tests.gateway.gw_support import ListSource

    a, b = ("modeldeployments", "a"), ("modeldeployments", "b")

    class TwoNamespaces(ListSource):
        def start(self, loop: Any, on_list: Any, on_event: Any) -> None:
            self.on_list, self.on_event = on_list, on_event
            on_list(NODES, [])
            on_list(a, [md("x", "x", [], namespace="a")])  # "b" not listed yet

    src = TwoNamespaces(scopes=(a, b, NODES))
    gw = Gateway(GatewayConfig(host="127.0.0.1", port=0, admin_port=0, namespaces=("a", "b")), src)
    await gw.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{gw.urls['api']}/healthz") as r:
                assert r.status == 503
            st, headers, doc = await post(
                s, f"{gw.urls['api']}/v1/chat/completions", {"model": "x"}
            )
            assert st == 503 and doc["error"]["code"] == "not_ready" and headers["Retry-After"]
            assert src.on_list is not None
            src.on_list(b, [])
            async with s.get(f"{gw.urls['api']}/healthz") as r:
                assert r.status == 200
    finally:
        await gw.stop()


async def test_an_engine_dying_mid_stream_aborts_the_client_connection(
    make_gateway: Any, tmp_path: Any
) -> None:
    """A node agent process (its engines inside) is SIGKILLed in the middle of an answer: the
    client must see a broken stream, not a clean end of a truncated answer."""
    import signal
    import subprocess
    import sys

    from warmserve_agent.testing import write_model

    from tests.gateway.gw_support import REPO
    from warmserve.api.agent.client import SyncAgentClient

    write_model(tmp_path / "m", "doomed", layers=2, hidden=32, profile={"decode_tok_s": 20.0})
    addr_file = tmp_path / "agent.addr"
    agent = subprocess.Popen(
        [
            sys.executable, str(REPO / "tests/e2e/agent_proc.py"), "--models", str(tmp_path / "m"),
            "--gpus", "1x64MiB", "--node", "doomed", "--address-file", str(addr_file),
            "--memory-dir", str(tmp_path / "mem"),
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(600):
            if addr_file.exists():
                break
            await asyncio.sleep(0.1)

        def activate() -> Any:
            with SyncAgentClient(addr_file.read_text()) as c:
                return c.activate("doomed", [0]).instance

        inst = await asyncio.to_thread(activate)
        gw, _ = await make_gateway([md("doomed", "doomed", [(inst.instance_id, inst.endpoint)])])
        body = {"model": "doomed", "prompt": "a", "max_tokens": 200, "stream": True}  # ~10 s
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gw.urls['api']}/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.content.readline()).startswith(b"data:")  # the answer began
                agent.send_signal(signal.SIGKILL)
                with pytest.raises(aiohttp.ClientPayloadError):
                    while await asyncio.wait_for(r.content.readline(), 10):
                        pass
            text = await (await s.get(f"{gw.urls['admin']}/metrics")).text()
        assert (
            'warmserve_gateway_upstream_errors_total{kind="mid_stream",model="doomed"} 1.0' in text
        )
    finally:
        agent.kill()
        agent.wait(10)


async def test_per_model_series_exist_at_zero_once_the_model_is_known() -> None:
    """A dashboard's rate() needs the series before the first request: a histogram born with its
    first observation already counted shows no increase (the dead-panel failure of the real
    Prometheus dashboard test)."""
    from warmserve_gateway.config import GatewayConfig
    from warmserve_gateway.server import Gateway

    from tests.gateway.gw_support import ListSource

    class OneModel(ListSource):
        def start(self, loop: Any, on_list: Any, on_event: Any) -> None:
            on_list(NODES, [])
            on_list(MDS, [md("known", "known", [])])

    gw = Gateway(GatewayConfig(host="127.0.0.1", port=0, admin_port=0), OneModel())
    await gw.start()
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{gw.urls['admin']}/metrics") as r:
            text = await r.text()
        assert 'warmserve_gateway_ttft_seconds_count{model="known",stream="true"} 0.0' in text
        assert 'warmserve_gateway_queue_wait_seconds_count{model="known"} 0.0' in text
    finally:
        await gw.stop()
