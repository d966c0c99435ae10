"""The gateway's edge on real sockets (docs/security.md "The gateway's edge"): a header flood
cut off by the header budget with the replica's RSS bounded (measured on a gateway process), a
slowloris cut off by the header deadline, the connection cap, and no false positive for
well-behaved keep-alive, pipelining and large-body clients; the admin listener's /demand behind
the same limits."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from tests.gateway.gw_support import demand_headers, md, raw_http, start_gateway_process

MiB = 1024**2


def _addr(url: str) -> tuple[str, int]:
    u = URL(url)
    assert u.host is not None and u.port is not None
    return u.host, u.port


async def _ended(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the server sends until it ends the connection (a reset counts as an end)."""
    got = b""
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionError:
                return got
            if not chunk:
                return got
            got += chunk


async def test_a_header_flood_is_cut_off_and_memory_stays_bounded(tmp_path: Path) -> None:
    """100 connections each start a request and send 60 header fields of 16,000 bytes — each
    field within the per-field limit, ~1 MB per head — and never finish.  Before the header
    budget aiohttp buffered all of it, ~2 MiB of Python objects per connection (a replica went
    from 53 to 244 MiB); now each connection is answered 431 after 32 KiB and the process' peak
    RSS barely moves."""
    gw = start_gateway_process(tmp_path, [md("chat", "tiny", [])])
    try:
        host, port = _addr(gw.api)
        async with aiohttp.ClientSession() as s, s.get(f"{gw.api}/v1/models") as r:
            assert r.status == 200
        await asyncio.sleep(0.5)
        base = gw.status_kib("VmRSS")
        field = b"X-Fill-%03d: " + b"a" * 16000 + b"\r\n"

        async def flood(k: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
            try:
                for i in range(60):
                    writer.write(field % i)
                    await writer.drain()
            except ConnectionError:
                pass  # the gateway ended it
            return reader, writer

        conns = await asyncio.gather(*(flood(k) for k in range(100)))
        await asyncio.sleep(1.0)
        peak = gw.status_kib("VmHWM")
        grown_mib = (peak - base) / 1024
        print(f"gateway RSS {base // 1024} MiB, peak during the flood {peak // 1024} MiB")
        assert grown_mib < 32, f"RSS grew {grown_mib:.0f} MiB (base {base // 1024} MiB)"
        answers = await asyncio.gather(*(_ended(r, 10) for r, _ in conns))
        for _, w in conns:
            w.close()
        cut = [a for a in answers if a.startswith(b"HTTP/1.1 431 ")]
        assert len(cut) == 100, [a[:40] for a in answers if a not in cut][:5]
        doc = json.loads(cut[0].split(b"\r\n\r\n", 1)[1])
        assert doc["error"]["code"] == "headers_too_large"
        async with aiohttp.ClientSession() as s:  # and the replica still serves
            async with s.get(f"{gw.api}/v1/models") as r:
                assert r.status == 200
            text = await (await s.get(f"{gw.admin}/metrics")).text()
        assert (
            'warmserve_gateway_edge_rejected_total{listener="api",reason="header_budget"} 100.0'
            in text
        )
    finally:
        gw.stop()


async def test_slowloris_is_cut_off_by_the_header_deadline(make_gateway: Any) -> None:
    """A client trickling one header line every 0.3 s gets 408 at the header deadline; one that
    sends nothing is closed; a kept-alive connection idle between requests (longer than the
    header deadline) is not."""
    gw, _ = await make_gateway([md("chat", "tiny", [])], header_timeout_s=1.5)
    host, port = _addr(gw.urls["api"])

    async def slowloris() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        t0 = time.monotonic()
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n")
        ended = asyncio.create_task(_ended(reader, 10))
        try:
            while not ended.done():
                writer.write(b"X-Slow: 1\r\n")
                await asyncio.sleep(0.3)
        except ConnectionError:
            pass
        got = await ended
        writer.close()
        return time.monotonic() - t0, got

    async def silent() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        t0 = time.monotonic()
        got = await _ended(reader, 10)
        writer.close()
        return time.monotonic() - t0, got

    (t_slow, slow), (t_silent, quiet) = await asyncio.gather(slowloris(), silent())
    assert slow.startswith(b"HTTP/1.1 408 "), slow[:80]
    assert json.loads(slow.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert 1.4 < t_slow < 4.0, t_slow
    assert quiet == b"" and 1.4 < t_silent < 4.0, (quiet, t_silent)
    # Keep-alive: the deadline runs from a request's first byte, not through the idle wait.
    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(2):
            async with s.get(f"{gw.urls['api']}/v1/models") as r:
                assert r.status == 200
            await asyncio.sleep(2.0)
    text = await _metrics(gw)
    assert 'reason="header_timeout"} 2.0' in text


async def _metrics(gw: Any) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{gw.urls['admin']}/metrics") as r:
        return await r.text()


async def test_the_connection_cap_refuses_at_once_with_503(make_gateway: Any) -> None:
    gw, _ = await make_gateway([md("chat", "tiny", [])], max_connections=4)
    host, port = _addr(gw.urls["api"])
    held = [await asyncio.open_connection(host, port) for _ in range(4)]
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    st, headers, body = await raw_http(
        gw.urls["api"], b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n", timeout=5
    )
    assert time.monotonic() - t0 < 1.0
    assert st == 503 and headers["retry-after"] == "1", (st, headers)
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    _, w = held.pop()
    w.close()
    await asyncio.sleep(0.2)
    st, _, _ = await raw_http(
        gw.urls["api"], b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
    )
    assert st == 200
    for _, w in held:
        w.close()
    text = await _metrics(gw)
    assert 'reason="connection_cap"} 1.0' in text
    # The admin port has its own cap: probes and the operator still get through.
    async with aiohttp.ClientSession() as s, s.get(f"{gw.urls['admin']}/healthz") as r:
        assert r.status == 200


async def test_well_behaved_clients_never_hit_the_budget(make_gateway: Any, tiny: Any) -> None:
    """No false positive: 200 requests with 20 KiB of headers each on one kept-alive
    connection (the budget counts each head, nothing accumulates), pipelined requests, a
    900 kB body (bodies are not header bytes); a chunked body gets 411."""
    gw, _ = await make_gateway([md("chat", "tiny", tiny)], max_body_bytes=2 * MiB)
    api = gw.urls["api"]
    big = {f"X-Big-{i}": "b" * 5000 for i in range(4)}
    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(200):
            async with s.get(f"{api}/v1/models", headers=big) as r:
                assert r.status == 200
        body = {"model": "tiny", "prompt": "x" * 900_000, "max_tokens": 1}
        async with s.post(f"{api}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()

        async def chunks() -> Any:
            yield b'{"model": "tiny", '
            yield b'"prompt": "hi", "max_tokens": 1}'

        async with s.post(f"{api}/v1/completions", data=chunks()) as r:
            assert r.status == 411 and (await r.json())["error"]["code"] == "length_required"
    one = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
    host, port = _addr(api)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(one * 3)
    got = b""
    async with asyncio.timeout(10):
        while got.count(b"HTTP/1.1 200 ") < 3:
            got += await reader.read(65536)
    writer.close()
    text = await _metrics(gw)
    assert "warmserve_gateway_edge_rejected_total{" not in text


async def test_demand_sits_behind_the_admin_listeners_edge(make_gateway: Any) -> None:
    """/demand (the operator's token) is on the admin listener, which has the API's header
    budget and deadline: an oversized or trickled head is cut off before the token is looked
    at, even when it carries the right token; a normal one with the token is answered."""
    gw, _ = await make_gateway([md("chat", "tiny", [])], header_timeout_s=1.5)
    admin = gw.urls["admin"]
    auth = demand_headers(gw)["Authorization"]
    fill = "".join(f"X-Fill-{i}: {'a' * 8000}\r\n" for i in range(5))  # 40 KB > 32 KiB
    head = f"GET /demand HTTP/1.1\r\nHost: gw\r\nAuthorization: {auth}\r\n{fill}\r\n"
    st, _, body = await raw_http(admin, head.encode(), timeout=5)
    assert st == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    host, port = _addr(admin)
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.monotonic()
    writer.write(f"GET /demand HTTP/1.1\r\nHost: gw\r\nAuthorization: {auth}\r\n".encode())
    ended = asyncio.create_task(_ended(reader, 10))
    try:
        while not ended.done():
            writer.write(b"X-Slow: 1\r\n")
            await asyncio.sleep(0.3)
    except ConnectionError:
        pass
    slow = await ended
    writer.close()
    assert slow.startswith(b"HTTP/1.1 408 ") and 1.4 < time.monotonic() - t0 < 4.0, slow[:80]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{admin}/demand") as r:
            assert r.status == 401
        async with s.get(f"{admin}/demand", headers={"Authorization": auth}) as r:
            assert r.status == 200 and "models" in await r.json()
    text = await _metrics(gw)
    for reason in ("header_budget", "header_timeout"):
        series = f'warmserve_gateway_edge_rejected_total{{listener="admin",reason="{reason}"}}'
        assert f"{series} 1.0" in text, reason


@pytest.fixture(scope="module")
def tiny(engines: Any) -> list[tuple[str, str]]:
    return [engines.start("tiny", 0)]
