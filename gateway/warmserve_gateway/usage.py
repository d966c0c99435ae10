"""Token usage of forwarded requests, from the engines' own answers (docs/gateway.md "Token
metrics").

* **A whole answer** (the proxy reads answers up to ``proxy.BUFFER_MAX`` whole anyway): the
  ``usage`` of its JSON (:func:`usage_of_answer`).
* **A stream** (``"stream": true``): OpenAI-compatible engines (vLLM, the simulated engine)
  report usage only when ``stream_options.include_usage`` asks, in a last chunk without
  choices.  When the client did not ask, :func:`ask_for_usage` asks for it and
  :class:`StreamUsage` takes that chunk out of the stream as it passes, so the client gets what
  the engine would have sent it; vLLM then also moves the ``system_fingerprint`` of the finish
  chunk onto the usage chunk, so the finish chunk waits for the next event and gets it back.
  When the client asked, the chunk passes.  Nothing is buffered but the event being received.
* **Only what an engine says counts**: an answer without ``usage`` counts nothing; a usage
  event that is not JSON, or counts that are not integers in [0, :data:`MAX_TOKENS`], count
  nothing and name a :class:`UsageError`; the client's bytes are never changed beyond the
  stripped chunk (and the fingerprint put back).

:class:`Meter` records an answer in the gateway's metrics (:mod:`.metrics`); the rest is pure.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from .metrics import Metrics

MAX_TOKENS = 10**9  # more in one answer is not a count
MAX_EVENT = 64 * 1024  # bytes of one SSE event looked at (a usage chunk is a few hundred)
# Routes whose streams take stream_options (the OpenAI API's and vLLM's).
ASK_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
# gen_ai.operation.name per route; another allowlisted route (--route) is named by its path.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}

_USAGE = b'"usage"'  # JSON escapes a quote inside a string: only a key or a value matches
_FINGERPRINT = b'"system_fingerprint"'
_FINISHED = re.compile(rb'"finish_reason" ?: ?"')  # a choice's last chunk (null elsewhere)
_END = re.compile(rb"\n\r?\n")  # an SSE event ends at an empty line (LF or CRLF)
_INCLUDE_USAGE = b'{"stream_options":{"include_usage":true},'


class UsageError(enum.Enum):
    """Why an answer's usage was not counted (``warmserve_gateway_usage_errors_total``)."""

    MALFORMED = "malformed"  # an answer or SSE event that mentions usage and is not JSON
    INVALID = "invalid"  # a usage whose counts are not integers in [0, MAX_TOKENS]
    OVERSIZED = "oversized"  # an SSE event over MAX_EVENT bytes that mentions usage: not read
    ENCODED = "encoded"  # a compressed answer (Content-Encoding): not read


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int  # the engine's prompt_tokens
    output_tokens: int  # its completion_tokens (0 when absent: embeddings)


def _count(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_TOKENS else None


def parse_usage(value: Any) -> Usage | UsageError | None:
    """An engine's ``usage`` object; ``None`` when it is null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return UsageError.INVALID
    if "prompt_tokens" not in value and "input_tokens" in value:  # the Responses API's names
        given = _count(value.get("input_tokens"))
        made = _count(value.get("output_tokens", 0))
    else:
        given = _count(value.get("prompt_tokens"))
        made = _count(value.get("completion_tokens", 0))
    if given is None or made is None:
        return UsageError.INVALID
    return Usage(given, made)


def usage_of_answer(body: bytes) -> Usage | UsageError | None:
    """The ``usage`` of a whole JSON answer (at most ``proxy.BUFFER_MAX`` bytes)."""
    if _USAGE not in body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return UsageError.MALFORMED
    if not isinstance(doc, dict):
        return UsageError.MALFORMED
    return parse_usage(doc.get("usage"))


def ask_for_usage(doc: dict[str, Any], body: bytes) -> tuple[bytes, bool]:
    """A streaming request's body asking the engine for usage when the client did not, and
    whether the usage chunk is the gateway's to take out (``doc``, the parsed ``body``, is
    changed to match).  A ``stream_options`` the engine would refuse, or read otherwise than
    as JSON booleans, is left alone (vLLM coerces ``"yes"`` to true, for one)."""
    if "stream_options" not in doc:
        # In front of the first member (there is one: "model"), when the body is UTF-8 without
        # a BOM (not UTF-16/32), so that a long prompt is not encoded again.
        splice = bool(doc) and body[:1] == b"{" and body[1:2] != b"\x00"
        doc["stream_options"] = {"include_usage": True}
        return (_INCLUDE_USAGE + body[1:] if splice else json.dumps(doc).encode()), True
    opts = doc["stream_options"]
    if opts is None:
        opts = {}
    elif not isinstance(opts, dict):
        return body, False
    asked, per_chunk = opts.get("include_usage"), opts.get("continuous_usage_stats")
    if not (asked is None or asked is False) or per_chunk not in (None, False, True):
        return body, False  # asked (true), or values only the engine can interpret
    opts = {**opts, "include_usage": True}
    if per_chunk is True:  # ignored without include_usage: off keeps every chunk as it was
        opts["continuous_usage_stats"] = False
    doc["stream_options"] = opts
    return json.dumps(doc).encode(), True


def _last_end(buf: bytes) -> int:
    """The index after the last complete event in ``buf`` (0: none)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _data(event: bytes) -> bytes:
    """The ``data`` of one SSE event (its data lines joined)."""
    lines = [ln for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"\n".join(ln[6:] if ln[5:6] == b" " else ln[5:] for ln in lines)


def _with_fingerprint(event: bytes, fingerprint: str) -> bytes:
    """A finish chunk with the ``system_fingerprint`` vLLM put on the usage chunk instead; an
    event that is not one ``data:`` line of a JSON object stays as it is."""
    data = _data(event)
    nl = b"\r\n" if event.endswith(b"\r\n\r\n") else b"\n"
    if event != b"data: " + data + nl + nl:
        return event
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return event
    if not isinstance(doc, dict):
        return event
    doc["system_fingerprint"] = fingerprint
    spaced = b'": ' in data or b'", "' in data  # Python's json.dumps; vLLM's pydantic is compact
    text = json.dumps(
        doc, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=data.isascii()
    )
    return b"data: " + text.encode() + nl + nl


class StreamUsage:
    """The usage of one SSE stream, read as it passes (see the module docstring).

    :meth:`feed` takes each chunk from the engine and returns the bytes for the client;
    :meth:`end` returns what is left when the engine's stream ends.  Without ``strip`` a chunk
    goes on at once and unchanged.  With it, the bytes of an event that is not complete yet wait
    for its end (an SSE client acts on complete events only), a usage chunk is dropped, and a
    finish chunk waits for the next event.  An event over :data:`MAX_EVENT` bytes goes on
    unread.  The last usage seen counts (``continuous_usage_stats`` repeats it on every chunk).
    """

    __slots__ = ("_carry", "_held", "_skip", "_tail", "errors", "strip", "usage")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self.errors: list[UsageError] = []
        self._tail = b""  # the start of an event not complete yet
        self._held = b""  # strip: a finish chunk waiting for the next event
        self._skip = False  # inside an event over MAX_EVENT: it passes unread to its end
        self._carry = b""  # the last bytes seen while skipping (an end split between chunks)

    def feed(self, chunk: bytes) -> bytes:
        out = self._take(chunk)
        return out if self.strip else chunk

    def end(self) -> bytes:
        out, self._held, self._tail = self._held + self._tail, b"", b""
        return out if self.strip else b""

    def _take(self, chunk: bytes) -> bytes:
        if not (self._tail or self._skip or self._held) and chunk.endswith(b"\n\n"):
            # The common case: whole events (an engine writes one per token).
            if _USAGE in chunk or (self.strip and _FINISHED.search(chunk)):
                return self._events(chunk)
            return chunk
        head = b""
        if self._skip:
            head, chunk = self._skip_to_end(chunk)
            if not chunk:
                return head
        buf = self._tail + chunk if self._tail else chunk
        cut = _last_end(buf)
        done, rest = (buf[:cut], buf[cut:]) if cut else (b"", buf)
        if done and (self._held or _USAGE in done or (self.strip and _FINISHED.search(done))):
            done = self._events(done)
        if len(rest) <= MAX_EVENT:
            self._tail = rest
            return head + done
        if _USAGE in rest:
            self.errors.append(UsageError.OVERSIZED)
        self._tail, self._skip, self._carry = b"", True, rest[-2:]
        held, self._held = self._held, b""
        return head + done + held + rest

    def _skip_to_end(self, chunk: bytes) -> tuple[bytes, bytes]:
        """Inside an event over MAX_EVENT: (its bytes up to its end, what follows)."""
        probe = self._carry + chunk
        m = _END.search(probe)
        if m is None:
            self._carry = probe[-2:]
            return chunk, b""
        cut = m.end() - len(self._carry)
        self._skip, self._carry = False, b""
        return chunk[:cut], chunk[cut:]

    def _events(self, done: bytes) -> bytes:
        out, pos = [], 0
        for m in _END.finditer(done):
            out.append(self._event(done[pos : m.end()]))
            pos = m.end()
        out.append(done[pos:])  # blank-line bytes past the last match
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        """One complete event: read its usage; what the client gets for it now."""
        held = self._held
        if _USAGE in event:
            only, fingerprint = self._read(event)
            if only and self.strip:
                self._held = b""
                if held and fingerprint is not None and _FINGERPRINT not in held:
                    return _with_fingerprint(held, fingerprint)
                return held
        if not self.strip:
            return event
        if _FINISHED.search(event) and _FINGERPRINT not in event:
            self._held = event
            return held
        self._held = b""
        return held + event

    def _read(self, event: bytes) -> tuple[bool, str | None]:
        """Record the event's usage; (a usage chunk without choices, its fingerprint)."""
        data = _data(event)
        if _USAGE not in data:
            return False, None
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            self.errors.append(UsageError.MALFORMED)
            return False, None
        if not isinstance(doc, dict) or doc.get("usage") is None:
            return False, None  # "usage" in a text, or OpenAI's usage: null on every chunk
        got = parse_usage(doc["usage"])
        if isinstance(got, UsageError):
            self.errors.append(got)
        elif got is not None:
            self.usage = got
        fingerprint = doc.get("system_fingerprint")
        return doc.get("choices") == [], fingerprint if isinstance(fingerprint, str) else None


class _Trace(Protocol):
    def usage(self, input_tokens: int, output_tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class _ModelChildren:
    op: str
    input: Any
    output: Any
    per_token: Any
    duration: Any  # error_type ""


class RequestMeter:
    """The metric children of one request's labels, resolved when it arrives: a series exists
    (at 0) before its first answer counts, so Prometheus' rate() sees that answer (a series
    born with its first observation already counted shows no increase)."""

    __slots__ = ("_meter", "_model", "_per_model", "_tokens")

    def __init__(self, meter: Meter, model: str, per_model: _ModelChildren, tokens: Any) -> None:
        self._meter = meter
        self._model = model
        self._per_model = per_model
        self._tokens = tokens

    def answered(self, status: int, seconds: float) -> None:
        """An engine's answer ended ``seconds`` after the request arrived at the gateway."""
        if status < 400:
            self._per_model.duration.observe(seconds)
        else:
            m = self._meter.m
            m.request_duration.labels(self._per_model.op, self._model, str(status)).observe(seconds)

    def usage(
        self,
        got: Usage | None,
        errors: list[UsageError] | tuple[UsageError, ...] = (),
        decode_s: float | None = None,
        trace: _Trace | None = None,
    ) -> None:
        """Count an answer's usage; ``decode_s`` (a stream's first to last byte) gives the time
        per output token after the first."""
        for e in errors:
            self._meter.m.usage_errors.labels(self._model, e.value).inc()
        if got is None:
            return
        given, made = self._tokens
        given.inc(got.input_tokens)
        made.inc(got.output_tokens)
        mc = self._per_model
        mc.input.observe(got.input_tokens)
        mc.output.observe(got.output_tokens)
        if decode_s is not None and got.output_tokens > 1:
            mc.per_token.observe(decode_s / (got.output_tokens - 1))
        if trace is not None:
            trace.usage(got.input_tokens, got.output_tokens)


class Meter:
    """Token and request metrics of answers from engines (:mod:`.metrics`); label children are
    resolved once per label set (``labels()`` per request costs more than the observation).
    Label values are bounded: served models, allowlisted routes, the admin's key ids."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self._models: dict[tuple[str, str], _ModelChildren] = {}
        self._tokens: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def request(self, model: str, namespace: str, key: str, path: str) -> RequestMeter:
        op = OPERATIONS.get(path, path)
        mc = self._models.get((model, op))
        if mc is None:
            m = self.m
            mc = self._models[(model, op)] = _ModelChildren(
                op,
                m.token_usage.labels(op, model, "input"),
                m.token_usage.labels(op, model, "output"),
                m.time_per_output_token.labels(op, model),
                m.request_duration.labels(op, model, ""),
            )
        tc = self._tokens.get((model, namespace, key))
        if tc is None:
            c = self.m.tokens
            tc = self._tokens[(model, namespace, key)] = (
                c.labels(model, namespace, key, "input"),
                c.labels(model, namespace, key, "output"),
            )
        return RequestMeter(self, model, mc, tc)
