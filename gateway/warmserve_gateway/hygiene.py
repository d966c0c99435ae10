"""Request hygiene at the gateway's edge (pure: no I/O, no aiohttp).

Everything here reads what a client sent, which is hostile until checked:

* :func:`normalise_path` — the request target as RFC 3986 defines its equivalence (percent-encoded
  unreserved characters decoded, dot segments removed) plus merged slashes; a target with a
  character outside the path grammar is refused.  Routes are matched on the result, exactly, and
  engines only ever receive the canonical path of an allowlisted route, never the client's
  spelling (an engine's own normaliser could otherwise reach a route the gateway did not allow,
  e.g. ``/v1/%2e%2e/metrics``).
* :func:`request_headers` / :func:`response_headers` — hop-by-hop headers (RFC 9110 §7.6.1:
  ``Connection``, ``Keep-Alive``, ``Proxy-*``, ``TE``, ``Trailer``, ``Transfer-Encoding``,
  ``Upgrade`` and every header named in ``Connection``) dropped in both directions, plus what the
  gateway owns: the client's ``Authorization``, and its forwarding headers (``Forwarded``,
  ``X-Forwarded-*``, ``X-Real-IP``), replaced by the gateway's own ``X-Forwarded-For``.
* :func:`parse_json_object` — a JSON body as a dict, or :class:`BadJson` (400) for malformed JSON,
  nesting deeper than the limit (which Python's parser would otherwise answer with a
  ``RecursionError``, a 500) or integers beyond Python's digit limit.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

# Headers as aiohttp hands them over (case-insensitive, repeatable).
Headers = CIMultiDict[str] | CIMultiDictProxy[str] | MultiMapping[str]

# A path segment: RFC 3986 pchar (unreserved, pct-encoded, sub-delims, ":" and "@").
_SEGMENT = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})*")
_PCT = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def _pct(m: re.Match[str]) -> str:
    ch = chr(int(m.group(1), 16))
    return ch if ch in _UNRESERVED else "%" + m.group(1).upper()


def normalise_path(target: str) -> str | None:
    """The canonical path of a request target (its query dropped), or ``None`` when it is not an
    origin-form path (absolute-form, ``*``, a character outside RFC 3986's path grammar such as
    ``\\``, a space or a control character, a malformed ``%``).

    ``%2e%2e`` is ``..`` (RFC 3986 §6.2.2.2) and is resolved like it, ``..`` above the root stays
    at the root, empty segments (``//``, a trailing ``/``) are dropped; reserved characters stay
    encoded (``%2F`` is not a ``/``)."""
    path = target.partition("?")[0]
    if not path.startswith("/"):
        return None
    out: list[str] = []
    for seg in path[1:].split("/"):
        if "%" in seg:
            if not _SEGMENT.fullmatch(seg):
                return None
            seg = _PCT.sub(_pct, seg)
        elif not _SEGMENT.fullmatch(seg):
            return None
        if seg in ("", "."):
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    return "/" + "/".join(out)


# ---- headers ----

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade"}
)  # fmt: skip
# What the gateway owns on the way to an engine: its framing (Host, Content-Length; Expect is
# answered here), the client's API key, and forwarding headers a client could spoof.
# Content-Encoding too: aiohttp decodes a compressed body, so the engine gets it decoded.
_REQUEST_DROP = _HOP_BY_HOP | {
    "host", "content-length", "expect", "authorization", "content-encoding", "forwarded",
    "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-forwarded-port",
    "x-forwarded-prefix", "x-real-ip",
}  # fmt: skip
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length", "server", "date"}


def _kept(headers: Headers, drop: frozenset[str]) -> list[tuple[str, str]]:
    """``headers`` without ``drop``, ``Proxy-*`` and every header a ``Connection`` names (as
    pairs: aiohttp builds its own multidict from them)."""
    named = [t.strip().lower() for v in headers.getall("Connection", ()) for t in v.split(",")]
    if named:
        drop = drop.union(named)
    return [
        (k, v)
        for k, v in headers.items()
        if (low := k.lower()) not in drop and not low.startswith("proxy-")
    ]


def forwarded_for(client_values: Iterable[str], peer: str | None, trusted_hops: int) -> str:
    """The ``X-Forwarded-For`` an engine gets: the last ``trusted_hops`` entries of the client's
    header (what the proxies in front of the gateway appended; anything before them is the
    client's own, spoofable, and dropped), then the peer address of the connection (from the
    socket).  Entries that are not IP addresses become ``unknown``."""
    chain: list[str] = []
    if trusted_hops:
        entries = [e.strip() for v in client_values for e in v.split(",")]
        entries = [e for e in entries if e]
        chain = [e if _is_ip(e) else "unknown" for e in entries[-trusted_hops:]]
    chain.append(peer or "unknown")
    return ", ".join(chain)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def request_headers(
    headers: Headers, peer: str | None, trusted_hops: int = 0
) -> list[tuple[str, str]]:
    """The headers forwarded to an engine (see the module docstring)."""
    out = _kept(headers, _REQUEST_DROP)
    xff = headers.getall("X-Forwarded-For", ()) if trusted_hops else ()
    out.append(("X-Forwarded-For", forwarded_for(xff, peer, trusted_hops)))
    return out


def response_headers(headers: Headers) -> list[tuple[str, str]]:
    """The engine's headers sent on to the client: hop-by-hop ones dropped, and what aiohttp
    writes itself (framing, ``Server``, ``Date``)."""
    return _kept(headers, _RESPONSE_DROP)


# ---- JSON bodies ----


class BadJson(ValueError):
    """A body the gateway answers 400; ``code`` goes into the OpenAI error."""

    def __init__(self, message: str, code: str = "invalid_json") -> None:
        super().__init__(message)
        self.code = code


def _too_deep(doc: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_json_object(body: bytes, max_depth: int) -> dict[str, Any]:
    """``body`` as a JSON object nested at most ``max_depth`` levels (the object itself is 1)."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise BadJson(
            f"the request body nests JSON deeper than the gateway's limit of {max_depth}",
            "json_too_deep",
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many integer digits
        raise BadJson(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadJson("the request body must be a JSON object")
    # Nesting needs at least one bracket per level: most bodies skip the walk.
    if body.count(b"[") + body.count(b"{") > max_depth and _too_deep(doc, max_depth):
        raise BadJson(
            f"the request body nests JSON deeper than the gateway's limit of {max_depth}",
            "json_too_deep",
        )
    return doc
