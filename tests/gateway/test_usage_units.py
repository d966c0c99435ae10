"""The gateway's usage reading (warmserve_gateway.usage), pure: streams cut anywhere (hypothesis)
give the client the engine's bytes less the usage chunk the gateway asked for, and the usage
once; request bodies ask for usage only when the client did not; engines' usage values that are
not counts are refused."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_gateway.usage import (
    MAX_EVENT,
    StreamUsage,
    Usage,
    UsageError,
    ask_for_usage,
    parse_usage,
    usage_of_answer,
)


def _dumps(doc: Any, compact: bool) -> bytes:
    if compact:  # vLLM (pydantic): no spaces, UTF-8 as it is
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    return json.dumps(doc).encode()  # the simulated engine


def _event(data: bytes, nl: bytes) -> bytes:
    return b"data: " + data + nl + nl


def _content(text: str, finish: str | None = None, fp: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    doc: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                           "model": "m", "choices": [choice]}  # fmt: skip
    if fp is not None:
        doc["system_fingerprint"] = fp
    return doc


# Pieces of text a model may generate that look like what the reader looks for.
texts = st.lists(
    st.sampled_from(["usage", '"usage"', "a", " ", "é", "\n", "{", "}", "data:", "\\", "ü"]),
    max_size=6,
).map("".join)


@st.composite
def streams(draw: Any) -> dict[str, Any]:
    compact = draw(st.booleans())
    nl = draw(st.sampled_from([b"\n", b"\r\n"]))
    usage = draw(st.none() | st.tuples(st.integers(0, 5000), st.integers(0, 5000)))
    fp = draw(st.none() | st.just("vllm-0.32.0-abcd1234"))
    big = draw(st.none() | st.integers(MAX_EVENT - 100, MAX_EVENT + 3000))
    parts: list[tuple[str, bytes]] = []
    for text in draw(st.lists(texts, max_size=5)):
        parts.append(("content", _event(_dumps(_content(text), compact), nl)))
    if big is not None:  # e.g. prompt_token_ids of a long prompt on the first chunk
        parts.insert(0, ("big", _event(_dumps(_content("x" * big), compact), nl)))
    if draw(st.booleans()):
        parts.append(("comment", b": keep-alive" + nl + nl))
    finish_fp = fp if usage is None else None  # vLLM: the fingerprint rides the last chunk
    parts.append(("finish", _event(_dumps(_content("", "stop", finish_fp), compact), nl)))
    if usage is not None:
        doc: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                               "model": "m", "choices": [],
                               "usage": {"prompt_tokens": usage[0],
                                         "completion_tokens": usage[1],
                                         "total_tokens": sum(usage)}}  # fmt: skip
        if fp is not None:
            doc["system_fingerprint"] = fp
        parts.append(("usage", _event(_dumps(doc, compact), nl)))
    parts.append(("done", b"data: [DONE]" + nl + nl))
    raw = b"".join(p for _, p in parts)
    cuts = sorted(set(draw(st.lists(st.integers(0, len(raw)), max_size=12))))
    return {"parts": parts, "raw": raw, "cuts": cuts, "usage": usage, "fp": fp}


def _pieces(raw: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


def _run(s: dict[str, Any], strip: bool) -> tuple[bytes, StreamUsage]:
    scan = StreamUsage(strip)
    nl = b"\r\n" if s["raw"].endswith(b"\r\n\r\n") else b"\n"
    at_once = {p for kind, p in s["parts"] if kind in ("content", "comment")}
    out, fed = b"", b""
    for piece in _pieces(s["raw"], s["cuts"]):
        out += scan.feed(piece)
        fed += piece
        assert len(scan._tail) <= MAX_EVENT  # nothing but the event being received waits
        # content goes on as soon as its event is complete (only a finish chunk waits)
        complete = fed[: fed.rfind(nl + nl) + len(nl + nl)] if nl + nl in fed else b""
        for p in at_once:
            assert out.count(p) >= complete.count(p)
    return out + scan.end(), scan


@settings(max_examples=300, deadline=None)
@given(streams())
def test_a_stream_cut_anywhere_passes_whole_and_its_usage_counts_once(s: dict[str, Any]) -> None:
    usage = Usage(*s["usage"]) if s["usage"] is not None else None
    # the client asked (or the gateway did not ask): every byte as the engine sent it
    out, scan = _run(s, strip=False)
    assert out == s["raw"]
    assert scan.usage == usage and scan.errors == []
    # the gateway asked: the usage chunk is gone, the finish chunk has the fingerprint back
    out, scan = _run(s, strip=True)
    assert scan.usage == usage and scan.errors == []
    want = [(k, p) for k, p in s["parts"] if k != "usage"]
    nl = b"\r\n" if s["raw"].endswith(b"\r\n\r\n") else b"\n"
    got = [e + nl + nl for e in out.split(nl + nl) if e]
    assert len(got) == len(want)
    for (kind, sent), received in zip(want, got, strict=True):
        if kind == "finish" and usage is not None:
            doc = json.loads(sent[6:])
            if s["fp"] is not None:
                doc["system_fingerprint"] = s["fp"]
            assert json.loads(received[6:]) == doc
            assert received.startswith(b"data: ") and received.endswith(nl + nl)
        else:
            assert received == sent, kind


def test_the_fingerprint_put_back_is_what_vllm_sends_without_include_usage() -> None:
    """vLLM (compact JSON) stamps the finish chunk when usage is off; when the gateway asked
    for usage, the client gets that same finish chunk, byte for byte."""
    finish = _content("", "length")
    expected = _event(_dumps({**finish, "system_fingerprint": "vllm-fp"}, True), b"\n")
    usage = {
        **_content(""),
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "system_fingerprint": "vllm-fp",
    }
    scan = StreamUsage(strip=True)
    out = scan.feed(_event(_dumps(finish, True), b"\n"))
    assert out == b""  # the finish chunk waits for the next event
    out += scan.feed(_event(_dumps(usage, True), b"\n") + b"data: [DONE]\n\n")
    assert out == expected + b"data: [DONE]\n\n"
    assert scan.usage == Usage(3, 1)


def test_bad_usage_events_pass_unchanged_and_are_named() -> None:
    malformed = b'data: {"choices": [], "usage": {"prompt_tokens": 3,\n\n'
    invalid = b'data: {"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 2}}\n\n'
    repeated = b'data: {"choices": [{"delta": {}}], "usage": {"prompt_tokens": 2}}\n\n'
    scan = StreamUsage(strip=True)
    out = scan.feed(malformed + b"data: [DONE]\n\n")
    assert out == malformed + b"data: [DONE]\n\n"  # not JSON: not known to be the gateway's
    assert scan.errors == [UsageError.MALFORMED] and scan.usage is None
    scan = StreamUsage(strip=True)
    assert scan.feed(invalid) == b""  # a usage chunk the client did not ask for, unreadable
    assert scan.errors == [UsageError.INVALID] and scan.usage is None
    scan = StreamUsage(strip=True)
    assert scan.feed(repeated) == repeated  # usage on a chunk with choices stays
    assert scan.usage == Usage(2, 0)
    # a usage chunk too long to be one is not read
    scan = StreamUsage(strip=True)
    long = b'data: {"usage": {"prompt_tokens": 1}, "x": "' + b"y" * MAX_EVENT + b'"}\n\n'
    out = scan.feed(long[:100]) + scan.feed(long[100:-1]) + scan.feed(long[-1:])
    assert out == long and scan.usage is None and scan.errors == [UsageError.OVERSIZED]


def test_an_unterminated_tail_goes_to_the_client_at_the_end_unread() -> None:
    scan = StreamUsage(strip=True)
    tail = b'data: {"choices": [], "usage": {"prompt_tokens": 1}}'
    assert scan.feed(tail) == b""
    assert scan.end() == tail and scan.usage is None


# ---- the request ------------------------------------------------------------------------


def test_the_gateway_asks_for_usage_only_when_the_client_did_not() -> None:
    doc = {"model": "m", "stream": True}
    body, strip = ask_for_usage(doc, json.dumps(doc).encode())
    assert (
        strip and json.loads(body) == {**doc} and doc["stream_options"] == {"include_usage": True}
    )
    for opts, sent, strip_ in [
        (None, {"include_usage": True}, True),
        ({}, {"include_usage": True}, True),
        ({"include_usage": False}, {"include_usage": True}, True),
        # ignored without include_usage; turned off so that no chunk changes
        (
            {"continuous_usage_stats": True},
            {"continuous_usage_stats": False, "include_usage": True},
            True,
        ),
        ({"include_usage": True}, {"include_usage": True}, False),
        (
            {"include_usage": True, "continuous_usage_stats": True},
            {"include_usage": True, "continuous_usage_stats": True},
            False,
        ),
        ({"include_usage": "yes"}, {"include_usage": "yes"}, False),  # the engine's to read
        ({"include_usage": 0}, {"include_usage": 0}, False),
        (
            {"include_usage": None, "continuous_usage_stats": "no"},
            {"include_usage": None, "continuous_usage_stats": "no"},
            False,
        ),
        ("bogus", "bogus", False),  # the engine refuses it, as it would without the gateway
    ]:
        doc = {"model": "m", "stream": True, "stream_options": opts}
        raw = json.dumps(doc).encode()
        body, strip = ask_for_usage(doc, raw)
        assert strip is strip_, opts
        assert json.loads(body)["stream_options"] == sent, opts
        if not strip:
            assert body == raw, opts


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k != "stream_options"),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
            max_leaves=8,
        ),
        max_size=6,
    ),
    st.sampled_from([{}, {"indent": 1}, {"ensure_ascii": False}]),
)
def test_the_spliced_body_is_the_client_body_plus_stream_options(
    doc: dict[str, Any], style: dict[str, Any]
) -> None:
    raw = json.dumps(doc, **style).encode()
    sent = dict(doc)
    body, strip = ask_for_usage(sent, raw)
    assert strip
    assert json.loads(body) == {**doc, "stream_options": {"include_usage": True}} == sent
    assert body.endswith(raw[1:])  # the prompt is not re-encoded


def test_a_utf16_body_is_re_encoded() -> None:
    doc = {"model": "m", "stream": True}
    body, strip = ask_for_usage(doc, json.dumps(doc).encode("utf-16-le"))
    assert strip and json.loads(body) == doc


# ---- usage values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, Usage(3, 4)),
        ({"prompt_tokens": 8, "total_tokens": 8}, Usage(8, 0)),  # embeddings
        (None, None),
        ({"prompt_tokens": -1, "completion_tokens": 4}, UsageError.INVALID),
        ({"prompt_tokens": True, "completion_tokens": 4}, UsageError.INVALID),
        ({"prompt_tokens": 3.0, "completion_tokens": 4}, UsageError.INVALID),
        ({"prompt_tokens": "3", "completion_tokens": 4}, UsageError.INVALID),
        ({"prompt_tokens": 3, "completion_tokens": None}, UsageError.INVALID),
        ({"prompt_tokens": 10**12, "completion_tokens": 4}, UsageError.INVALID),
        ({"completion_tokens": 4}, UsageError.INVALID),
        ([3, 4], UsageError.INVALID),
    ],
)
def test_usage_values(value: Any, want: Any) -> None:
    assert parse_usage(value) == want


def test_whole_answers() -> None:
    assert usage_of_answer(b'{"choices": []}') is None
    assert usage_of_answer(b'{"usage": null}') is None
    assert usage_of_answer(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 1}}') == Usage(
        2, 1
    )
    assert usage_of_answer(b'{"usage": {"prompt') is UsageError.MALFORMED
    assert usage_of_answer(b'["usage"]') is UsageError.MALFORMED
    deep = b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert usage_of_answer(deep) is UsageError.MALFORMED  # RecursionError, caught
    assert usage_of_answer(b'{"text": "the word \\"usage\\""}') is None
