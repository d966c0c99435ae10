"""Token usage at the gateway, on the real aiohttp gateway over real sockets: the simulated engine
(whose ``stream_options`` handling is vLLM 0.32's) for whole answers and streams with and
without ``include_usage``, and a real HTTP engine of odd answers (no usage, a malformed or an
invalid usage chunk, events split across writes) for what an engine may get wrong.  What the
client receives is compared with what the engine sends a client directly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.gw_support import Engines, md

PROMPT = "one two three four five"  # the simulated engine counts words: 5 prompt tokens
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}


@pytest.fixture(scope="module")
def tiny(engines: Engines) -> tuple[str, str]:
    return engines.start("tiny", 3)


async def metrics(gw: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(f"{gw.urls['admin']}/metrics") as r:
        text = await r.text()
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for fam in text_string_to_metric_families(text)
        for x in fam.samples
    }


def value(got: dict[Any, float], name: str, **labels: str) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


def tokens(
    got: dict[Any, float], model: str, key: str = "_anonymous", ns: str = "default"
) -> tuple:
    """(input, output) of warmserve_gateway_tokens_total for one model, namespace and key."""
    return tuple(
        value(got, "warmserve_gateway_tokens_total", model=model, namespace=ns, key=key, type=t)
        for t in ("input", "output")
    )


def usage_errors(got: dict[Any, float]) -> dict[tuple[str, str], float]:
    return {
        (dict(lab)["model"], dict(lab)["reason"]): v
        for (name, lab), v in got.items()
        if name == "warmserve_gateway_usage_errors_total"
    }


async def stream(url: str, body: dict[str, Any], headers: Any = None) -> tuple[int, list[bytes]]:
    """POST a streaming request; the status and the raw SSE events as they arrived."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        raw = await r.read()
    return r.status, [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def parsed(events: list[bytes]) -> list[Any]:
    """The events' JSON (``[DONE]`` as is) without the per-request ``id`` and ``created``."""
    out: list[Any] = []
    for e in events:
        data = e.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        doc = json.loads(data)
        doc.pop("id", None)
        doc.pop("created", None)
        out.append(doc)
    return out


async def test_whole_answers_are_counted_per_model_from_the_engines_usage(
    make_gateway: Any, tiny: Any
) -> None:
    gw, _ = await make_gateway([md("chat", "tiny", [tiny])])
    api = gw.urls["api"]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api}/v1/chat/completions", json={"model": "tiny", **CHAT}) as r:
            assert r.status == 200
            chat = await r.json()
        body = {"model": "tiny", "prompt": "a b c", "max_tokens": 2}
        async with s.post(f"{api}/v1/completions", json=body) as r:
            assert r.status == 200
            done = await r.json()
    assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert done["usage"]["prompt_tokens"] == 3 and done["usage"]["completion_tokens"] == 2
    got = await metrics(gw)
    assert tokens(got, "tiny") == (8.0, 8.0)
    hist = "gen_ai_client_token_usage_sum"
    m = {"gen_ai_request_model": "tiny"}
    assert value(got, hist, gen_ai_operation_name="chat", gen_ai_token_type="input", **m) == 5
    assert value(got, hist, gen_ai_operation_name="chat", gen_ai_token_type="output", **m) == 6
    assert (
        value(got, hist, gen_ai_operation_name="text_completion", gen_ai_token_type="input", **m)
        == 3
    )
    dur = "gen_ai_server_request_duration_seconds_count"
    assert value(got, dur, gen_ai_operation_name="chat", error_type="", **m) == 1
    assert value(got, dur, gen_ai_operation_name="text_completion", error_type="", **m) == 1
    # whole answers have no first token of their own: no time per output token
    tpot = "gen_ai_server_time_per_output_token_seconds_count"
    assert value(got, tpot, gen_ai_operation_name="chat", **m) == 0
    assert usage_errors(got) == {}


async def test_a_stream_without_include_usage_reaches_the_client_as_from_the_engine(
    make_gateway: Any, tiny: Any
) -> None:
    """The gateway asks for usage, reads it, and takes the usage chunk out: the client gets the
    engine's own stream for its request (the finish chunk with its system_fingerprint, no usage
    anywhere), and the tokens are counted."""
    gw, _ = await make_gateway([md("chat", "tiny", [tiny])])
    body = {"model": "tiny", **CHAT, "stream": True}
    st, direct = await stream(f"{tiny[1]}/v1/chat/completions", body)
    assert st == 200
    st, via = await stream(f"{gw.urls['api']}/v1/chat/completions", body)
    assert st == 200
    assert parsed(via) == parsed(direct)
    assert not [e for e in via if b'"usage"' in e]
    assert parsed(via)[-2]["system_fingerprint"].startswith("warmserve-sim-")
    got = await metrics(gw)
    assert tokens(got, "tiny") == (5.0, 6.0)
    m = {"gen_ai_request_model": "tiny", "gen_ai_operation_name": "chat"}
    assert value(got, "gen_ai_server_time_per_output_token_seconds_count", **m) == 1
    assert value(got, "gen_ai_server_request_duration_seconds_count", **m, error_type="") == 1
    assert usage_errors(got) == {}
    # the same for a text completion
    body = {"model": "tiny", "prompt": "x y", "max_tokens": 3, "stream": True}
    st, direct = await stream(f"{tiny[1]}/v1/completions", body)
    st2, via = await stream(f"{gw.urls['api']}/v1/completions", body)
    assert st == st2 == 200 and parsed(via) == parsed(direct)
    assert tokens(await metrics(gw), "tiny") == (7.0, 9.0)


@pytest.mark.parametrize("continuous", [False, True])
async def test_a_stream_with_include_usage_passes_and_counts_once(
    make_gateway: Any, tiny: Any, continuous: bool
) -> None:
    """The client asked: its usage chunk (and, with continuous_usage_stats, the usage on every
    chunk) reaches it unchanged; the request is counted once."""
    gw, _ = await make_gateway([md("chat", "tiny", [tiny])])
    opts = {"include_usage": True, "continuous_usage_stats": continuous}
    body = {"model": "tiny", **CHAT, "stream": True, "stream_options": opts}
    st, direct = await stream(f"{tiny[1]}/v1/chat/completions", body)
    st2, via = await stream(f"{gw.urls['api']}/v1/chat/completions", body)
    assert st == st2 == 200
    assert parsed(via) == parsed(direct)
    last = parsed(via)[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert len([e for e in via if b'"usage"' in e]) == (8 if continuous else 1)
    assert tokens(await metrics(gw), "tiny") == (5.0, 6.0)


async def test_stream_options_the_gateway_does_not_own_are_left_to_the_engine(
    make_gateway: Any, tiny: Any
) -> None:
    """include_usage false or null is the client not asking (asked for, then taken out);
    continuous_usage_stats without include_usage stays without effect.  A value that only the
    engine's own parsing gives a meaning (vLLM reads "yes" as true, "no" as false) reaches it
    unchanged, and whatever usage the engine then sends passes and counts."""
    gw, _ = await make_gateway([md("chat", "tiny", [tiny])])
    url = f"{gw.urls['api']}/v1/chat/completions"
    for opts in ({"include_usage": False}, {"continuous_usage_stats": True}, None):
        body = {"model": "tiny", **CHAT, "stream": True, "stream_options": opts}
        st, direct = await stream(f"{tiny[1]}/v1/chat/completions", body)
        st2, via = await stream(url, body)
        assert st == st2 == 200, opts
        assert parsed(via) == parsed(direct), opts
        assert not [e for e in via if b'"usage"' in e], opts
    assert tokens(await metrics(gw), "tiny") == (15.0, 18.0)
    for word, chunks in (("yes", 1), ("no", 0)):
        body = {"model": "tiny", **CHAT, "stream": True, "stream_options": {"include_usage": word}}
        st, direct = await stream(f"{tiny[1]}/v1/chat/completions", body)
        st2, via = await stream(url, body)
        assert st == st2 == 200 and parsed(via) == parsed(direct), word
        assert len([e for e in via if b'"usage"' in e]) == chunks, word
    assert tokens(await metrics(gw), "tiny") == (20.0, 24.0)
    # what the engine refuses, it refuses through the gateway too (vLLM's request model)
    body = {"model": "tiny", **CHAT, "stream": True, "stream_options": {"include_usage": 2}}
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 400
        assert "include_usage" in (await r.json())["error"]["message"]
    body = {"model": "tiny", **CHAT, "stream_options": {"include_usage": True}}  # no stream
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 400 and "stream=True" in (await r.json())["error"]["message"]
    assert usage_errors(await metrics(gw)) == {}


async def test_usage_per_api_key_id_never_the_key(
    make_gateway: Any, tiny: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "api-keys"
    keys.mkdir()
    (keys / "team-a.alice").write_text("sk-alice-secret")
    (keys / "team-a.bob").write_text("sk-bob-secret")
    gw, _ = await make_gateway([md("chat", "tiny", [tiny], namespace="team-a")], api_keys=keys)
    url = f"{gw.urls['api']}/v1/chat/completions"
    for key, n, streamed in (("sk-alice-secret", 2, True), ("sk-bob-secret", 1, False)):
        for _ in range(n):
            body = {"model": "tiny", **CHAT, "stream": streamed}
            st, _ = await stream(url, body, {"Authorization": f"Bearer {key}"})
            assert st == 200
    got = await metrics(gw)
    assert tokens(got, "tiny", "team-a.alice", "team-a") == (10.0, 12.0)
    assert tokens(got, "tiny", "team-a.bob", "team-a") == (5.0, 6.0)
    async with aiohttp.ClientSession() as s, s.get(f"{gw.urls['admin']}/metrics") as r:
        assert "secret" not in await r.text()
    # keys off: the anonymous caller's key label is _anonymous, as in key_requests_total
    gw2, _ = await make_gateway([md("chat", "tiny", [tiny])])
    st, _ = await stream(f"{gw2.urls['api']}/v1/chat/completions", {"model": "tiny", **CHAT})
    assert st == 200 and tokens(await metrics(gw2), "tiny", "_anonymous") == (5.0, 6.0)


# ---- an engine that gets usage wrong -------------------------------------------------------


def _event(doc: Any) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _content(model: str, text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return _event({"id": "c1", "object": "chat.completion.chunk", "model": model,
                   "choices": [choice]})  # fmt: skip


_USAGE_CHUNK = {  # what follows the content for each odd model (None: nothing)
    "plain": None,  # an engine that knows no usage (ignores stream_options)
    "malformed": b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,\n\n',
    "invalid": _event({"id": "c1", "choices": [], "usage": {"prompt_tokens": -3,
                                                            "completion_tokens": "2"}}),
    "split": _event({"id": "c1", "choices": [], "usage": {"prompt_tokens": 4,
                                                          "completion_tokens": 2},
                     "system_fingerprint": "fp-odd"}),
}  # fmt: skip


@dataclass
class Odd:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
async def odd() -> AsyncIterator[Odd]:
    """A real HTTP engine whose answers get usage wrong in one way per model name."""
    o = Odd()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        o.bodies.append(body)
        model = body["model"]
        if not body.get("stream"):
            if model == "malformed":
                return web.Response(body=b'{"choices": [], "usage": {"prompt', status=200,
                                    content_type="application/json")  # fmt: skip
            answer: dict[str, Any] = {"object": "chat.completion", "model": model, "choices": []}
            if model == "invalid":
                answer["usage"] = {"prompt_tokens": True, "completion_tokens": 1}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [_content(model, "hel"), _content(model, "lo", "stop")]
        usage = _USAGE_CHUNK[model] if (body.get("stream_options") or {}).get("include_usage") \
            else None  # fmt: skip
        if usage is not None:
            events.append(usage)
        events.append(b"data: [DONE]\n\n")
        raw = b"".join(events)
        step = 7 if model == "split" else len(raw)  # events split across writes
        for i in range(0, len(raw), step):
            await resp.write(raw[i : i + step])
            if step < len(raw):
                await asyncio.sleep(0.002)  # a write of its own on the wire
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    o.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield o
    await runner.cleanup()


async def test_an_engine_without_usage_counts_nothing_and_is_no_error(
    make_gateway: Any, odd: Odd
) -> None:
    gw, _ = await make_gateway([md("plain", "plain", [("o1", odd.url)])])
    url = f"{gw.urls['api']}/v1/chat/completions"
    st, events = await stream(url, {"model": "plain", **CHAT, "stream": True})
    assert st == 200
    assert b"".join(events) == _content("plain", "hel") + _content("plain", "lo", "stop") + (
        b"data: [DONE]\n\n"
    )
    assert odd.bodies[-1]["stream_options"] == {"include_usage": True}  # asked, got nothing
    st, _ = await stream(url, {"model": "plain", **CHAT})
    assert st == 200
    got = await metrics(gw)
    assert tokens(got, "plain") == (0.0, 0.0)  # the series, created at arrival, at 0
    assert usage_errors(got) == {}
    m = {"gen_ai_request_model": "plain", "gen_ai_operation_name": "chat", "error_type": ""}
    assert value(got, "gen_ai_server_request_duration_seconds_count", **m) == 2


async def test_a_malformed_or_invalid_usage_chunk_is_counted_as_an_error_never_breaks_the_stream(
    make_gateway: Any, odd: Odd
) -> None:
    objs = [md(n, n, [(f"o-{n}", odd.url)]) for n in ("malformed", "invalid")]
    gw, _ = await make_gateway(objs)
    url = f"{gw.urls['api']}/v1/chat/completions"
    # Not JSON: the gateway cannot tell what it is, so the client gets it as the engine sent it.
    st, events = await stream(url, {"model": "malformed", **CHAT, "stream": True})
    assert st == 200
    assert events[-2] == _USAGE_CHUNK["malformed"] and events[-1] == b"data: [DONE]\n\n"
    # A usage chunk (no choices) with counts that are not counts: not counted, and taken out
    # like any usage chunk the client did not ask for.
    st, events = await stream(url, {"model": "invalid", **CHAT, "stream": True})
    assert st == 200
    assert b"".join(events) == _content("invalid", "hel") + _content("invalid", "lo", "stop") + (
        b"data: [DONE]\n\n"
    )
    for model in ("malformed", "invalid"):  # whole answers: the same reasons
        async with aiohttp.ClientSession() as s, s.post(url, json={"model": model, **CHAT}) as r:
            assert r.status == 200 and await r.read()
    got = await metrics(gw)
    assert usage_errors(got) == {("malformed", "malformed"): 2.0, ("invalid", "invalid"): 2.0}
    assert tokens(got, "malformed") == tokens(got, "invalid") == (0.0, 0.0)


async def test_events_split_across_writes_are_read_and_the_fingerprint_put_back(
    make_gateway: Any, odd: Odd
) -> None:
    """The engine writes its stream 7 bytes at a time: the usage chunk is still found and taken
    out, and the finish chunk gets the fingerprint the engine moved to the usage chunk."""
    gw, _ = await make_gateway([md("split", "split", [("o1", odd.url)])])
    url = f"{gw.urls['api']}/v1/chat/completions"
    st, events = await stream(url, {"model": "split", **CHAT, "stream": True})
    assert st == 200
    assert events[0] == _content("split", "hel")
    finish = json.loads(events[1][6:])
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["system_fingerprint"] == "fp-odd"
    assert events[2:] == [b"data: [DONE]\n\n"]
    assert tokens(await metrics(gw), "split") == (4.0, 2.0)
    # asked by the client: the chunk passes and the finish chunk stays as it came
    opts = {"include_usage": True}
    st, events = await stream(
        url, {"model": "split", **CHAT, "stream": True, "stream_options": opts}
    )
    assert st == 200 and events[1] == _content("split", "lo", "stop")
    assert events[2] == _USAGE_CHUNK["split"]
    assert odd.bodies[-1]["stream_options"] == opts
    assert tokens(await metrics(gw), "split") == (8.0, 4.0)


async def test_a_requests_series_exist_at_zero_while_it_is_held(make_gateway: Any) -> None:
    """Prometheus' rate() does not see the count a series is born with: the request's series
    exist (at 0) from its arrival, long before its answer counts."""
    gw, _ = await make_gateway([md("cold", "cold", [], max_hold_s=30)])
    url = f"{gw.urls['api']}/v1/chat/completions"
    held = asyncio.create_task(stream(url, {"model": "cold", **CHAT, "stream": True}))
    try:
        for _ in range(200):
            st = gw.dispatcher.state("cold")
            if st is not None and st.held:
                break
            await asyncio.sleep(0.01)
        got = await metrics(gw)
        assert tokens(got, "cold") == (0.0, 0.0)
        m = {"gen_ai_request_model": "cold", "gen_ai_operation_name": "chat"}
        for t in ("input", "output"):
            assert value(got, "gen_ai_client_token_usage_count", **m, gen_ai_token_type=t) == 0
        assert value(got, "gen_ai_server_time_per_output_token_seconds_count", **m) == 0
        assert value(got, "gen_ai_server_request_duration_seconds_count", **m, error_type="") == 0
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
