"""Request hygiene (docs/security.md "The gateway's edge"): path normalisation and the route
allowlist, hop-by-hop headers in both directions, spoofed forwarding headers, JSON nesting — on
the real aiohttp gateway in front of a real upstream that records what reaches it; plus the pure
rules under random inputs (hypothesis) and the settings' checks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict
from warmserve_gateway.config import ConfigError, GatewayConfig
from warmserve_gateway.hygiene import (
    BadJson,
    forwarded_for,
    normalise_path,
    parse_json_object,
    request_headers,
    response_headers,
)

from tests.gateway.gw_support import md, raw_http

CHAT = json.dumps({"model": "rec", "messages": [{"role": "user", "content": "hi"}]}).encode()


def post(target: str, body: bytes = CHAT, extra: str = "", method: str = "POST") -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + body


async def test_paths_are_normalised_and_only_allowlisted_routes_reach_engines(
    make_gateway: Any, recorder: Any
) -> None:
    gw, _ = await make_gateway([md("rec", "rec", [("r1", recorder.url)])])
    api = gw.urls["api"]
    # Only allowlisted routes, exactly, after normalisation; the rest is the gateway's 404 and
    # never reaches an engine.
    for target in (
        "/v1/%2e%2e/metrics",
        "/v1/chat/completions/../../../metrics",
        "/v1/..%2f..%2fmetrics",
        "/v1/chat%2Fcompletions",
        "/V1/chat/completions",
        "/v1/embeddings/x",
        "/v1/tokenize",
        "/metrics",
        "/v1/chat/completions%00",
        "/v1\\chat\\completions",
        "http://engine/v1/chat/completions",
        "/v1/chat/completions;x",
    ):
        st_, _, body = await raw_http(api, post(target))
        assert st_ == 404, (target, body)
        assert json.loads(body)["error"]["code"] == "not_found", target
    assert recorder.seen == []
    # Equivalent spellings of an allowlisted route are served at its canonical path (the
    # query string is not forwarded).
    for target in (
        "/v1/chat/completions",
        "//v1/./chat/completions",
        "/v1/chat/%2e%2e/chat/completions",
        "/v1/%63hat/completions/",
        "/v1/chat/completions?api-version=1&x=%2F",
    ):
        st_, _, body = await raw_http(api, post(target))
        assert st_ == 200, (target, body)
    assert recorder.paths() == ["/v1/chat/completions"] * 5
    st_, headers, body = await raw_http(api, post("/v1/chat/completions", b"", method="GET"))
    assert st_ == 405 and headers["allow"] == "POST"
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
    st_, _, body = await raw_http(api, post("/v1//models/./rec", b"", method="GET"))
    assert st_ == 200 and json.loads(body)["id"] == "rec"
    assert len(recorder.seen) == 5


async def test_an_extra_route_is_forwarded_only_when_the_admin_allows_it(
    make_gateway: Any, recorder: Any
) -> None:
    st_, _, _ = await raw_http(
        (await make_gateway([md("rec", "rec", [("r1", recorder.url)])]))[0].urls["api"],
        post("/v1/score"),
    )
    assert st_ == 404 and recorder.paths() == []
    routes = ("/v1/chat/completions", "/v1/completions", "/v1/score")
    gw, _ = await make_gateway([md("rec", "rec", [("r1", recorder.url)])], forwarded_routes=routes)
    st_, _, _ = await raw_http(gw.urls["api"], post("/v1/./score"))
    assert st_ == 200 and recorder.paths() == ["/v1/score"]


async def test_hop_by_hop_headers_are_stripped_both_ways(make_gateway: Any, recorder: Any) -> None:
    gw, _ = await make_gateway([md("rec", "rec", [("r1", recorder.url)])])
    extra = (
        "Connection: keep-alive, X-Secret\r\nX-Secret: s3cr3t\r\nKeep-Alive: timeout=9\r\n"
        "Proxy-Authorization: Basic eA==\r\nTE: trailers\r\nX-Kept: yes\r\n"
    )
    st_, headers, _ = await raw_http(
        gw.urls["api"], post("/v1/chat/completions", extra=extra).replace(
            b"Connection: close\r\n", b""
        ),
    )  # fmt: skip
    assert st_ == 200
    (_, _, seen), = recorder.seen  # fmt: skip
    names = {k.lower() for k, _ in seen}
    assert "x-kept" in names
    for gone in ("x-secret", "keep-alive", "proxy-authorization", "te"):
        assert gone not in names, (gone, seen)
    assert all(v.lower() != "keep-alive, x-secret" for _, v in seen)
    # The engine's own hop-by-hop headers (and the one its Connection names) stop here.
    assert headers["x-engine"] == "visible"
    for gone in ("x-internal", "proxy-authenticate"):
        assert gone not in headers, headers
    assert headers.get("keep-alive") is None


async def test_spoofed_forwarding_headers_are_replaced(make_gateway: Any, recorder: Any) -> None:
    spoof = (
        "X-Forwarded-For: 6.6.6.6\r\nForwarded: for=6.6.6.6\r\nX-Real-IP: 6.6.6.6\r\n"
        "X-Forwarded-Host: evil\r\n"
    )
    gw, _ = await make_gateway([md("rec", "rec", [("r1", recorder.url)])])
    st_, _, _ = await raw_http(gw.urls["api"], post("/v1/chat/completions", extra=spoof))
    assert st_ == 200
    seen = {k.lower(): v for k, v in recorder.seen[-1][2]}
    assert seen["x-forwarded-for"] == "127.0.0.1"
    for gone in ("forwarded", "x-real-ip", "x-forwarded-host"):
        assert gone not in seen
    # Behind one trusted proxy: its entry (the last) is kept, the client's own is not.
    gw1, _ = await make_gateway([md("rec", "rec", [("r1", recorder.url)])], trusted_proxy_hops=1)
    chain = "X-Forwarded-For: 6.6.6.6, 10.1.2.3\r\n"
    await raw_http(gw1.urls["api"], post("/v1/chat/completions", extra=chain))
    seen = {k.lower(): v for k, v in recorder.seen[-1][2]}
    assert seen["x-forwarded-for"] == "10.1.2.3, 127.0.0.1"


async def test_json_nesting_and_huge_numbers_get_400_not_500(
    make_gateway: Any, recorder: Any
) -> None:
    gw, _ = await make_gateway([md("rec", "rec", [("r1", recorder.url)])])
    api = gw.urls["api"]
    deep = b'{"model": "rec", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    limit = b'{"model": "rec", "x": ' + b"[" * 63 + b"]" * 63 + b"}"  # depth 64: the limit
    over = b'{"model": "rec", "x": ' + b"[" * 64 + b"]" * 64 + b"}"
    digits = b'{"model": "rec", "n": ' + b"9" * 5000 + b"}"
    for body, code in ((deep, "json_too_deep"), (over, "json_too_deep"), (digits, "invalid_json")):
        st_, _, answer = await raw_http(api, post("/v1/chat/completions", body))
        assert st_ == 400, answer[:200]
        doc = json.loads(answer)
        assert doc["error"]["code"] == code and doc["error"]["type"] == "invalid_request_error"
    st_, _, _ = await raw_http(api, post("/v1/chat/completions", limit))
    assert st_ == 200 and len(recorder.seen) == 1


# ---- the pure rules -----------------------------------------------------------------------

_UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
segment_st = st.text(alphabet=_UNRESERVED + "!$&'()*+,;=:@", min_size=1, max_size=8).filter(
    lambda s: s not in (".", "..")
)


@given(st.lists(segment_st, max_size=6), st.data())
def test_equivalent_spellings_normalise_to_one_path(segs: list[str], data: Any) -> None:
    canonical = "/" + "/".join(segs)
    assert normalise_path(canonical) == canonical
    spelled: list[str] = []
    for seg in segs:
        trick = data.draw(st.sampled_from(["plain", "dot", "dotdot", "empty", "encode"]))
        if trick == "dot":
            spelled += [".", seg]
        elif trick == "dotdot":
            spelled += ["zz", "%2E%2e", seg]
        elif trick == "empty":
            spelled += ["", seg]
        elif trick == "encode":
            spelled.append("".join(f"%{ord(c):02x}" if c in _UNRESERVED else c for c in seg))
        else:
            spelled.append(seg)
    got = normalise_path("/" + "/".join(spelled) + data.draw(st.sampled_from(["", "/", "?q=1"])))
    assert got == canonical
    assert normalise_path(got) == got  # idempotent


@given(st.text(max_size=40))
def test_normalised_paths_have_no_tricks_left(target: str) -> None:
    got = normalise_path(target)
    if got is None:
        return
    assert got.startswith("/") and normalise_path(got) == got
    segs = got[1:].split("/") if got != "/" else []
    assert all(s not in ("", ".", "..") for s in segs)
    assert "\\" not in got and "?" not in got and not any(ord(c) < 0x21 for c in got)


name_st = st.sampled_from(
    ["Connection", "Keep-Alive", "TE", "Trailer", "Transfer-Encoding", "Upgrade",
     "Proxy-Authorization", "Proxy-Foo", "X-A", "X-B", "Accept", "Authorization",
     "X-Forwarded-For", "Forwarded", "Content-Type"]
)  # fmt: skip


@given(st.lists(st.tuples(name_st, st.sampled_from(["1", "x-a", "X-B, close", "v"]))))
def test_no_hop_by_hop_header_passes(pairs: list[tuple[str, str]]) -> None:
    headers = CIMultiDict(pairs)
    named = {t.strip().lower() for k, v in pairs if k.lower() == "connection" for t in v.split(",")}
    hop = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
    for out in (response_headers(headers), request_headers(headers, "10.0.0.1")):
        for k, _ in out:
            low = k.lower()
            assert low not in hop and low not in named and not low.startswith("proxy-")
    req = CIMultiDict(request_headers(headers, "10.0.0.1"))
    assert req.getall("X-Forwarded-For") == ["10.0.0.1"]
    assert "Authorization" not in req and "Forwarded" not in req
    kept = [(k, v) for k, v in pairs if k in ("Accept", "Content-Type")]
    kept = [(k, v) for k, v in kept if k.lower() not in named]
    assert [(k, v) for k, v in req.items() if k in ("Accept", "Content-Type")] == kept


def test_forwarded_for_keeps_only_trusted_entries() -> None:
    assert forwarded_for(["1.1.1.1, 2.2.2.2"], "3.3.3.3", 0) == "3.3.3.3"
    assert forwarded_for(["1.1.1.1, 2.2.2.2"], "3.3.3.3", 1) == "2.2.2.2, 3.3.3.3"
    assert forwarded_for(["1.1.1.1", "2.2.2.2"], "::1", 2) == "1.1.1.1, 2.2.2.2, ::1"
    assert forwarded_for(["<script>"], "3.3.3.3", 1) == "unknown, 3.3.3.3"
    assert forwarded_for([], None, 3) == "unknown"


def test_parse_json_object() -> None:
    assert parse_json_object(b'{"a": [1, {"b": 2}]}', 3) == {"a": [1, {"b": 2}]}
    for body, code in (
        (b'{"a": [1, {"b": 2}]}', "json_too_deep"),
        (b"[1]", "invalid_json"),
        (b"{", "invalid_json"),
        (b"\xff", "invalid_json"),
        (b"[" * 5000 + b"]" * 5000, "json_too_deep"),
    ):
        with pytest.raises(BadJson) as err:
            parse_json_object(body, 2)
        assert err.value.code == code, body[:20]


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"max_header_block_bytes": 8192, "max_header_bytes": 16384}, "--max-header-block-bytes"),
        ({"max_connections": 0}, "--max-connections"),
        ({"max_json_depth": 1}, "--max-json-depth"),
        ({"trusted_proxy_hops": 17}, "--trusted-proxy-hops"),
        ({"forwarded_routes": ("/v1/../admin",)}, "--route"),
        ({"forwarded_routes": ("/v1/models",)}, "--route"),
        ({"forwarded_routes": ("/metrics",)}, "--route"),
        ({"header_timeout_s": 0.0}, "--header-timeout"),
        ({"ttfb_timeout_s": float("inf")}, "--ttfb-timeout"),
        ({"drain_delay_s": -1.0}, "--drain-delay"),
        ({"idle_timeout_s": float("nan")}, "--idle-timeout"),
    ],
)
def test_bad_edge_settings_name_their_flag(kw: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        GatewayConfig(**kw)
