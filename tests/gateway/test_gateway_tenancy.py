"""Namespaces are tenants, on the real aiohttp gateway in front of real simulated engines: model
names and API keys scoped per namespace, cluster-wide names only by the admin's claim, held
requests capped per key and namespace, endpoints contacted only when an agent reported them
(a real listener records every hit), and /demand only for the operator."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.gateway.gw_support import AGENT_ADDRESS, NODE, Engines, demand_headers, gpunode, md

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


async def post(
    s: aiohttp.ClientSession, url: str, body: Any, key: str | None = None
) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.post(url, json=body, headers=headers) as r:
        raw = await r.read()
        return r.status, dict(r.headers), json.loads(raw) if raw else None


async def models(s: aiohttp.ClientSession, api: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.get(f"{api}/v1/models", headers=headers) as r:
        assert r.status == 200
        return {m["id"]: m for m in (await r.json())["data"]}


def error_code(doc: Any) -> str:
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    return str(doc["error"]["code"])


@pytest.fixture(scope="module")
def tiny(engines: Engines) -> tuple[str, str]:
    return engines.start("tiny", 0)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "api-keys"  # a mounted Secret: <namespace>.<id> per data key
    d.mkdir()
    (d / "team-a.alice").write_text("sk-alice")
    (d / "team-b.bob").write_text("sk-bob")
    return d


async def test_team_b_cannot_reach_or_list_team_a_model_even_with_the_same_bare_name(
    make_gateway: Any, tiny: Any, keys: Path
) -> None:
    objs = [
        md("chat", "tiny", [tiny], namespace="team-a"),
        md("chat", "tiny-b", [], namespace="team-b", max_instances=0),
    ]
    gw, _ = await make_gateway(objs, api_keys=keys)
    url = f"{gw.urls['api']}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        assert set(await models(s, gw.urls["api"], "sk-alice")) == {"tiny"}
        assert set(await models(s, gw.urls["api"], "sk-bob")) == {"tiny-b"}
        st, _, doc = await post(s, url, {"model": "chat", **CHAT}, "sk-alice")
        assert st == 200 and doc["model"] == "tiny"
        # team-b's "chat" is its own deployment (maxInstances 0: unavailable at once) ...
        st, _, doc = await post(s, url, {"model": "chat", **CHAT}, "sk-bob")
        assert st == 503 and error_code(doc) == "model_unavailable"
        assert "team-b/chat" in doc["error"]["message"]
        # ... and team-a's model is not there for it by any name (404, as for a made-up name)
        for name in ("tiny", "team-a/chat"):
            st, _, doc = await post(s, url, {"model": name, **CHAT}, "sk-bob")
            assert st == 404 and error_code(doc) == "model_not_found", name
            assert "team-a" not in doc["error"]["message"].replace(name, "")
            async with s.get(
                f"{gw.urls['api']}/v1/models/{name}", headers={"Authorization": "Bearer sk-bob"}
            ) as r:
                assert r.status == 404
    # Keys off: an anonymous caller has the anonymous namespaces only (the chart: its release's).
    gw2, _ = await make_gateway(objs, anonymous_namespaces=("team-b",))
    async with aiohttp.ClientSession() as s:
        assert set(await models(s, gw2.urls["api"])) == {"tiny-b"}
        st, _, _ = await post(s, f"{gw2.urls['api']}/v1/completions", {"model": "tiny"})
        assert st == 404


async def test_a_cluster_wide_name_only_through_the_admin_claim(
    make_gateway: Any, tiny: Any
) -> None:
    objs = [
        md("chat", "tiny", [tiny], namespace="team-a"),
        # a tenant naming its deployment like a well-known model claims nothing outside team-c
        md("shared", "shared", [], namespace="team-c", max_hold_s=0.5),
    ]
    gw, _ = await make_gateway(objs)  # anonymous callers: namespace "default"
    url = f"{gw.urls['api']}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        assert await models(s, gw.urls["api"]) == {}
        for name in ("chat", "tiny", "shared", "team-c/shared"):
            st, _, _ = await post(s, url, {"model": name, **CHAT})
            assert st == 404, name
    claimed = (("chat", "team-a/chat"),)
    gw2, _ = await make_gateway(objs, global_models=claimed)
    url = f"{gw2.urls['api']}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        listed = await models(s, gw2.urls["api"])
        assert set(listed) == {"chat"} and listed["chat"]["deployment"] == "team-a/chat"
        st, _, doc = await post(s, url, {"model": "chat", **CHAT})
        assert st == 200 and doc["model"] == "tiny"
        for name in ("tiny", "team-a/chat", "shared"):  # the claim opens that one name only
            st, _, _ = await post(s, url, {"model": name, **CHAT})
            assert st == 404, name


async def test_held_requests_capped_per_key_and_per_namespace_429(
    make_gateway: Any, keys: Path
) -> None:
    (keys / "team-a.ci").write_text("sk-ci")
    objs = [  # no instance: every request is held
        md("a1", "a1", [], namespace="team-a", max_hold_s=30, max_queue=10_000),
        md("a2", "a2", [], namespace="team-a", max_hold_s=30),
        md("b1", "b1", [], namespace="team-b", max_hold_s=30),
    ]
    gw, _ = await make_gateway(objs, api_keys=keys, max_held_per_namespace=3, max_held_per_key=2)
    url = f"{gw.urls['api']}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        held = [
            asyncio.create_task(post(s, url, {"model": "a1", **CHAT}, "sk-alice")) for _ in range(2)
        ]
        await asyncio.sleep(0.3)
        st, headers, doc = await post(s, url, {"model": "a2", **CHAT}, "sk-alice")
        assert st == 429 and int(headers["Retry-After"]) >= 1
        assert error_code(doc) == "queue_full" and "--max-held-per-key" in doc["error"]["message"]
        assert doc["error"]["type"] == "rate_limit_error"
        held.append(asyncio.create_task(post(s, url, {"model": "a2", **CHAT}, "sk-ci")))
        await asyncio.sleep(0.3)
        st, headers, doc = await post(s, url, {"model": "a2", **CHAT}, "sk-ci")
        assert st == 429 and "Retry-After" in headers
        assert "namespace 'team-a'" in doc["error"]["message"]
        # maxQueue 10000 on a1 is clamped by the namespace cap too
        st, _, doc = await post(s, url, {"model": "a1", **CHAT}, "sk-ci")
        assert st == 429 and error_code(doc) == "queue_full"
        # another tenant is not starved by team-a's flood
        held.append(asyncio.create_task(post(s, url, {"model": "b1", **CHAT}, "sk-bob")))
        await asyncio.sleep(0.3)
        assert gw.dispatcher.held_by_namespace == {"team-a": 3, "team-b": 1}
        r = await s.get(f"{gw.urls['admin']}/demand", headers=demand_headers(gw))
        report = await r.json()
        assert report["models"]["a1"] == {"held": 2, "inflight": 0, "namespace": "team-a"}
        text = await (await s.get(f"{gw.urls['admin']}/metrics")).text()
        # the key's id (its Secret data key name), never the key itself
        assert 'warmserve_gateway_key_requests_total{key="team-a.alice",namespace="team-a"}' in text
        assert "sk-alice" not in text
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)


# ------------------------------------------------------------------ endpoints (M5)


@pytest.fixture
async def listener() -> AsyncIterator[tuple[str, list[str]]]:
    """A real HTTP server on 127.0.0.1 that records every request it gets (and answers like an
    engine would, so a request that reaches it succeeds)."""
    hits: list[str] = []

    async def any_route(request: web.Request) -> web.Response:
        hits.append(f"{request.method} {request.path_qs}")
        return web.json_response({"object": "chat.completion", "model": "x", "choices": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", hits
    await runner.cleanup()


async def test_a_status_endpoint_no_agent_reported_is_never_contacted(
    make_gateway: Any, tiny: Any, listener: Any
) -> None:
    target, hits = listener
    iid, real = tiny
    agent = gpunode(NODE, AGENT_ADDRESS, [(iid, "tiny", real)])  # the operator's record
    cases = {
        # status written by a tenant: an id no agent reported
        "forged": [("forged-1", target)],
        # team-a's real instance id, pointed at the listener
        "hijack": [(iid, target)],
        # the cloud's metadata service, with the fragment trick
        "metadata": [("m-1", "http://169.254.169.254:80/latest/meta-data#")],
    }
    objs = [agent] + [
        md(name, f"evil-{name}", inst, max_hold_s=0.5) for name, inst in cases.items()
    ]
    gw, src = await make_gateway(objs, mirrored=False)
    url = f"{gw.urls['api']}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        for name in cases:
            st, _, doc = await post(s, url, {"model": name, **CHAT})
            assert st == 503 and error_code(doc) == "hold_timeout", (name, doc)
        text = await (await s.get(f"{gw.urls['admin']}/metrics")).text()
    assert hits == []
    assert "warmserve_gateway_upstream_errors_total{" not in text  # no connection was tried
    # Control: with a matching agent record the same listener is contacted (the check above
    # would have seen a hit).
    src.modified(gpunode(NODE, AGENT_ADDRESS, [(iid, "tiny", real), ("ok-1", "evil-ok", target)]))
    src.modified(md("ok", "evil-ok", [("ok-1", target)]))
    async with aiohttp.ClientSession() as s:
        st, _, _ = await post(s, url, {"model": "ok", **CHAT})
    assert st == 200 and len(hits) == 1


# ------------------------------------------------------------------ /demand


async def test_demand_needs_the_operator_token_and_caps_streams(make_gateway: Any) -> None:
    gw, _ = await make_gateway([md("cold", "cold", [])])
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}):
            for params in ({}, {"watch": "1"}):
                async with s.get(f"{gw.urls['admin']}/demand", headers=headers, params=params) as r:
                    assert r.status == 401, (headers, params)
                    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    gw, _ = await make_gateway([md("cold", "cold", [])], max_demand_streams=1)
    admin = gw.urls["admin"]
    good = demand_headers(gw)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{admin}/demand", headers=good) as r:
            assert r.status == 200 and (await r.json())["replica"] == "test"
        async with s.get(f"{admin}/demand", headers=good, params={"watch": "1"}) as stream:
            assert stream.status == 200
            assert (await stream.content.readline()).strip()
            async with s.get(f"{admin}/demand", headers=good, params={"watch": "1"}) as r:
                assert r.status == 429 and r.headers["Retry-After"]
        await asyncio.sleep(0.1)  # the first stream closed: there is room again
        async with s.get(f"{admin}/demand", headers=good, params={"watch": "1"}) as r:
            assert r.status == 200
    # No token configured: refused unless the admin explicitly opens it.
    gw2, _ = await make_gateway([], demand_token_file=None)
    gw3, _ = await make_gateway([], demand_token_file=None, insecure_demand=True)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw2.urls['admin']}/demand") as r:
            assert r.status == 401
        async with s.get(f"{gw3.urls['admin']}/demand") as r:
            assert r.status == 200
