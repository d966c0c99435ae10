"""Shutdown and hung engines: SIGTERM to a gateway process holding requests answers each of them
503 + Retry-After in OpenAI's shape (never a reset), after serving on through the drain delay;
an engine that accepts and never answers is ejected after the time-to-first-byte limit and the
request served elsewhere, or answered 504."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from warmserve_gateway.catalog import parse_deployment
from warmserve_gateway.holding import Dispatcher, HoldTimeout
from warmserve_gateway.routing import Endpoint
from warmserve_gateway.server import Draining

from tests.gateway.gw_support import md, start_gateway_process

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


async def _answer(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    """One request on its own connection; a reset or a closed connection raises."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, dict(r.headers), json.loads(await r.read())


async def test_sigterm_answers_held_requests_503_never_a_reset(tmp_path: Path) -> None:
    # A model at zero instances with a long hold (any tenant may set 120 s): its requests are
    # held when the replica gets SIGTERM, and a drain of 1.5 s ends before their hold does.
    objs = [md("cold", "cold", [], max_hold_s=120)]
    gw = start_gateway_process(tmp_path, objs, "--drain-seconds", "1.5")
    try:
        url = f"{gw.api}/v1/chat/completions"
        held = [asyncio.create_task(_answer(url, {"model": "cold", **CHAT})) for _ in range(3)]
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                async with s.get(f"{gw.admin}/demand", headers=gw.demand_headers) as r:
                    if (await r.json())["models"].get("cold", {}).get("held") == 3:
                        break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the requests were not held")
            t0 = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            # Not ready at once, but serving as before through the drain delay (default 5 s):
            # a request still routed here by a stale endpoint is held too, not refused.
            async with s.get(f"{gw.admin}/healthz") as r:
                assert r.status == 503
            held.append(asyncio.create_task(_answer(url, {"model": "cold", **CHAT})))
            results = await asyncio.wait_for(asyncio.gather(*held), 30)
        took = time.monotonic() - t0
        for status, headers, doc in results:
            assert status == 503 and headers["Retry-After"] == "1", (status, headers, doc)
            assert headers.get("Connection") == "close"
            assert set(doc["error"]) == {"message", "type", "param", "code"}
            assert doc["error"]["code"] == "draining" and doc["error"]["type"] == "server_error"
        assert 5.0 + 1.5 - 0.2 < took < 5.0 + 1.5 + 4.0, took  # delay + drain (+ exit)
        assert gw.proc.wait(10) == 0
        assert "event=drain_deadline held_answered=4" in gw.log.read_text()
    finally:
        gw.stop()


async def test_an_idle_replica_waits_out_the_drain_delay_then_exits(tmp_path: Path) -> None:
    """Exiting at once on SIGTERM would refuse the connections kube-proxy still sends here
    until every node saw the endpoint go; the default drain delay is 5 s."""
    gw = start_gateway_process(tmp_path, [md("m", "m", [])])
    try:
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        # Still accepting: a request sent by a stale endpoint is served.
        async with aiohttp.ClientSession() as s, s.get(f"{gw.api}/v1/models") as r:
            assert r.status == 200 and r.headers.get("Connection") != "close"
        assert await asyncio.to_thread(gw.proc.wait, 15) == 0
        assert 4.9 < time.monotonic() - t0 < 8.0
    finally:
        gw.stop()


async def test_a_hung_engine_is_ejected_after_the_ttfb_limit(
    make_gateway: Any, hung: Any, engines: Any
) -> None:
    live = await asyncio.to_thread(engines.start, "tiny", 0)
    objs = [md("chat", "tiny", [("hung", hung.url), live])]
    gw, _ = await make_gateway(objs, ttfb_timeout_s=1.0, eject_s=30.0)
    url = f"{gw.urls['api']}/v1/chat/completions"
    body = {"model": "tiny", "stream": True, **CHAT}

    async def stream() -> tuple[int, float]:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
            await r.read()
            return r.status, time.monotonic() - t0

    # Ties between the two idle instances break at random: send until the hung one was tried.
    for _ in range(40):
        status, took = await stream()
        assert status == 200
        if hung.accepted:
            assert 0.9 < took < 5.0, took  # the TTFB limit, then served by the live engine
            break
    else:
        pytest.fail("the hung instance was never picked")
    for _ in range(6):
        status, took = await stream()
        assert status == 200 and took < 0.9  # ejected: it gets nothing any more
    assert hung.accepted == 1
    eps = gw.dispatcher.state("tiny").endpoints
    assert eps["hung"].failures == 1 and eps[live[0]].failures == 0
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(f"{gw.urls['admin']}/metrics")).text()
    assert 'upstream_errors_total{kind="ttfb_timeout",model="tiny"} 1.0' in text

    # Only the hung engine: the retry goes back to it after its ejection and the client gets a
    # clean 504 (no first byte was sent, so nothing is half answered); non-streaming requests
    # have --read-timeout as their first-byte limit.
    gw2, _ = await make_gateway(
        [md("lone", "lone", [("hung", hung.url)])],
        ttfb_timeout_s=1.0, read_timeout_s=1.5, eject_s=0.2,
    )  # fmt: skip
    url2 = f"{gw2.urls['api']}/v1/chat/completions"
    for stream_it, limit in ((True, 1.0), (False, 1.5)):
        t0 = time.monotonic()
        status, _, doc = await _answer(url2, {"model": "lone", "stream": stream_it, **CHAT})
        took = time.monotonic() - t0
        assert status == 504 and doc["error"]["code"] == "upstream_timeout", doc
        assert 2 * limit < took < 2 * limit + 4.0, took


def test_consecutive_failures_double_the_ejection() -> None:
    ep = Endpoint("a", "http://a")
    assert [ep.ejection_s(2.0, 60.0) for _ in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    ep.failures = 0  # an answer
    assert ep.ejection_s(2.0, 60.0) == 2.0
    assert Endpoint("b", "http://b").ejection_s(600.0, 60.0) == 600.0  # never below the base


async def test_shedding_answers_every_held_request_and_later_ones() -> None:
    d = Dispatcher(max_held_per_namespace=10, max_held_per_key=5)
    d.update("m", parse_deployment(md("m", "m", [], max_hold_s=60, namespace="team-a")))
    st_ = d.state("m")
    assert st_ is not None
    held = [
        asyncio.create_task(d.acquire(st_, time.monotonic() + 60, key=k))
        for k in ("team-a.k1", "team-a.k1", "")
    ]
    await asyncio.sleep(0.01)
    assert st_.held == 3 and d.held_total == 3
    assert d.held_by_namespace == {"team-a": 3} and d.held_by_key == {"team-a.k1": 2}
    assert d.shed(lambda: Draining("bye", retry_after=1)) == 3
    for t in held:
        with pytest.raises(Draining):
            await t
    assert st_.held == 0 and d.held_total == 0 and not st_.queue
    # The namespace's and the key's counts are given back too (the caps count nothing shed).
    assert d.held_by_namespace == {} and d.held_by_key == {}
    with pytest.raises(Draining) as err:
        await d.acquire(st_, time.monotonic() + 60)
    assert err.value.status == 503 and err.value.retry_after == 1
    assert not isinstance(err.value, HoldTimeout) and d.check_invariant(st_)
