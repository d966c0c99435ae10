"""Forwarding one request to an engine and the answer back (docs/gateway.md "Routing").

* The request body goes unchanged (except ``model``, rewritten by the server when the client
  named the deployment rather than ``spec.model.name``) to the canonical path of an allowlisted
  route; the headers are :func:`.hygiene.request_headers` (hop-by-hop headers, the client's
  ``Authorization`` and its forwarding headers dropped, the gateway's ``X-Forwarded-For`` set),
  and the answer's :func:`.hygiene.response_headers` go back.
* Answers with a ``Content-Length`` up to :data:`BUFFER_MAX` are read whole and sent in one
  piece; everything else — SSE streams in particular — is passed through *chunk by chunk* as the
  engine sends it (``readany``), never buffered.  Bytes are relayed as they are
  (``auto_decompress`` off).
* **Retry once before the first byte**: when the engine cannot be reached, answers 502/503/504,
  or breaks the connection before the first body byte, the request goes once more to another
  instance (the same one only if no other has room), and the failing instance is ejected if it
  refused the connection.  After the first byte reached the client nothing can be retried: a
  break mid-stream aborts the client's connection, so the client sees an error rather than a
  silently truncated answer.
* **Time to first byte**: a streaming request's engine must send its first byte within
  ``ttfb_s`` (its prefill), a non-streaming one — whose answer comes whole, after the
  generation — within ``read_timeout_s``.  Both are aiohttp's per-read timeout (the answer's
  head, then its first body byte, each within the limit; after that ``read_timeout_s`` between
  chunks), so no timer is added per request.  An engine that does not is ejected like a dead one
  and the request is retried elsewhere (nothing reached the client yet), or, when that was the
  retry, answered 504.
* **A refused connection is not that retry**: the engine never saw the request, so it goes to
  another instance, or, when every instance refused (the operator ended them between two of this
  replica's discovery updates: a model scaled to zero), it is held like any request at a model
  without an instance — its held demand starts one — until the hold deadline.
* Ejections double per consecutive failure of an instance, up to ``max_eject_s``
  (:meth:`.routing.Endpoint.ejection_s`); an answer resets the count.
* **Token usage** (:mod:`.usage`): read from a whole answer's JSON, or from a stream's usage
  chunk as it passes (taken out when the gateway asked for it, ``Outgoing.strip_usage``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from .errors import route_not_served
from .holding import Dispatcher, ModelState, Rejected
from .hygiene import response_headers
from .metrics import Metrics
from .routing import Endpoint
from .tracing import current as current_trace
from .usage import Meter, RequestMeter, StreamUsage, UsageError, usage_of_answer

log = logging.getLogger("warmserve.gateway.proxy")

BUFFER_MAX = 1024**2
_RETRY_STATUS = frozenset({502, 503, 504})
_BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
# Nothing reached the engine: refused, or no connection within --connect-timeout.
_UNREACHED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def _encoded(up: aiohttp.ClientResponse) -> bool:
    return up.headers.get("Content-Encoding", "identity").lower() not in ("identity", "")


class UpstreamError(Exception):
    """Both attempts failed; the client gets 502 with this message."""


class UpstreamTimeout(UpstreamError):
    """No first byte within the limit on the last attempt; the client gets 504."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What is sent to the engine."""

    method: str
    path: str  # the canonical path of an allowlisted route (never the client's spelling)
    body: bytes
    headers: Sequence[tuple[str, str]]
    stream: bool  # the client asked for SSE: the first byte comes after the prefill
    key: str = ""  # the caller's API key id (per-key cap on held requests, token counts)
    strip_usage: bool = False  # the gateway asked for the stream's usage: not the client's


def new_session(connect_timeout_s: float, read_timeout_s: float) -> aiohttp.ClientSession:
    """One session (connection pool) for every engine.  No cookie jar: a cookie an engine sets
    must never be sent along with another client's request (and the jar costs per request)."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        timeout=aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        ),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
    )


_RETRY = object()
_REFUSED = object()  # the connection was refused: nothing reached the engine


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        dispatcher: Dispatcher,
        metrics: Metrics,
        eject_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        ttfb_s: float = 60.0,
        read_timeout_s: float = 600.0,
        max_eject_s: float = 60.0,
    ) -> None:
        self.session = session
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.meter = Meter(metrics)
        self.eject_s = eject_s
        self.max_eject_s = max_eject_s
        self.ttfb_s = ttfb_s
        self.read_timeout_s = read_timeout_s
        self.clock = clock
        # A streaming request's read timeout is the time-to-first-byte limit until its first
        # byte, then --read-timeout again (aiohttp's per-read timer: no extra timer per request).
        base = self._unary_timeout = session.timeout
        self._stream_timeout = aiohttp.ClientTimeout(
            total=base.total, connect=base.connect, sock_connect=base.sock_connect, sock_read=ttfb_s
        )

    async def forward(
        self, request: web.Request, st: ModelState, out: Outgoing, t0: float, deadline: float
    ) -> web.StreamResponse:
        """Hold until an instance has room, forward, relay; one retry before the first byte."""
        avoid: frozenset[str] = frozenset()
        mm = self.metrics.model(st.model)
        tr = current_trace()  # None unless tracing is on
        meter = self.meter.request(
            st.model, st.dep.spec.namespace, out.key or "_anonymous", out.path
        )
        retried = first = False
        while True:
            try:
                ep = await self.dispatcher.acquire(st, deadline, avoid, out.key)
            except Rejected as exc:
                if tr is not None:  # a cap (429), the hold deadline, the model gone
                    tr.rejected(st.model, exc.code)
                raise
            if tr is not None:
                tr.routed(st.model, ep, st.dep)
            if not first:
                first = True
                mm.queue_wait.observe(self.clock() - t0)
            mm.inflight.inc()
            try:
                sent = out if tr is None else tr.upstream(ep, out)  # + the engine's traceparent
                result = await self._attempt(
                    request, st, ep, sent, t0, meter, retried, self.clock() < deadline
                )
                if tr is not None:
                    tr.upstream_done(getattr(result, "status", None))
            finally:
                mm.inflight.dec()
                self.dispatcher.release(st, ep)
            if result is _REFUSED:  # ejected: acquire picks another instance or holds
                avoid = avoid | {ep.instance_id}
                continue
            if result is _RETRY:
                retried = True
                avoid = avoid | {ep.instance_id}
                self.metrics.retries.labels(st.model).inc()
                continue
            assert isinstance(result, web.StreamResponse)
            return result

    def _ttft(self, model: str, stream: bool, t0: float) -> float:
        mm = self.metrics.model(model)
        now = self.clock()
        ttft = now - t0
        (mm.ttft_stream if stream else mm.ttft_unary).observe(ttft)
        tr = current_trace()
        if tr is not None:
            tr.first_byte(ttft)
        return now

    def _failed(self, st: ModelState, ep: Endpoint, kind: str, exc: BaseException | str) -> None:
        self.metrics.upstream_errors.labels(st.model, kind).inc()
        log.warning(
            "event=upstream_failed model=%s instance=%s url=%s kind=%s error=%r",
            st.model, ep.instance_id, ep.url, kind, str(exc) or type(exc).__name__,
        )  # fmt: skip

    def _eject(self, st: ModelState, ep: Endpoint) -> None:
        self.dispatcher.eject(st, ep, ep.ejection_s(self.eject_s, self.max_eject_s))

    def _broken(
        self,
        st: ModelState,
        ep: Endpoint,
        kind: str,
        exc: Exception,
        last: bool,
        refusable: bool,
        stream: bool = False,
    ) -> Any:
        """The engine failed before the first byte: eject when it is unreachable or silent;
        retry, hold (unreached) or raise."""
        if isinstance(exc, aiohttp.ServerTimeoutError) and not isinstance(exc, _UNREACHED):
            limit = f"{self.ttfb_s:g} s (--ttfb-timeout)" if stream else (
                f"{self.read_timeout_s:g} s (--read-timeout)"
            )  # fmt: skip
            return self._late(st, ep, last, f"none within {limit}")
        self._failed(st, ep, kind, exc)
        if isinstance(exc, _UNREACHED):
            self._eject(st, ep)
            if refusable:  # before the hold deadline: try elsewhere or hold
                return _REFUSED
        if not last:
            return _RETRY
        raise UpstreamError(f"engine of {st.model!r} failed: {exc}") from exc

    def _late(self, st: ModelState, ep: Endpoint, last: bool, why: str) -> Any:
        """No first byte in time: a hung engine is ejected like a dead one."""
        self._failed(st, ep, "ttfb_timeout", why)
        self._eject(st, ep)
        if not last:
            return _RETRY
        raise UpstreamTimeout(f"engine of {st.model!r} sent no first byte: {why}")

    async def _attempt(
        self,
        request: web.Request,
        st: ModelState,
        ep: Endpoint,
        out: Outgoing,
        t0: float,
        meter: RequestMeter,
        last: bool,
        refusable: bool = False,
    ) -> Any:
        up: aiohttp.ClientResponse | None = None
        try:
            try:
                up = await self.session.request(
                    out.method,
                    ep.target(out.path),
                    data=out.body,
                    headers=out.headers,
                    timeout=self._stream_timeout if out.stream else self._unary_timeout,
                )
            except _BROKEN as exc:
                return self._broken(st, ep, "connect", exc, last, refusable, out.stream)
            if up.status in _RETRY_STATUS and not last:
                self._failed(st, ep, f"status_{up.status}", f"HTTP {up.status}")
                return _RETRY
            length = up.content_length
            try:
                if length is not None and length <= BUFFER_MAX:
                    data = await up.read()
                    ep.failures = 0
                    end = self._ttft(st.model, out.stream, t0)
                    meter.answered(up.status, end - t0)
                    if up.status == 200:
                        got = UsageError.ENCODED if _encoded(up) else usage_of_answer(data)
                        if isinstance(got, UsageError):
                            meter.usage(None, (got,))
                        else:
                            meter.usage(got, trace=current_trace())
                    missing = route_not_served(up.status, data, out.path, st.model)
                    if missing is not None:
                        return missing
                    return web.Response(
                        status=up.status, body=data, headers=response_headers(up.headers)
                    )
                first = await up.content.readany()
            except _BROKEN as exc:
                return self._broken(st, ep, "body", exc, last, False, out.stream)
            ep.failures = 0
            if out.stream and up.connection is not None:
                proto = up.connection.protocol
                if proto is not None:  # the first byte came: silence limit back to normal
                    proto.read_timeout = self.read_timeout_s
                    proto.start_timeout()
            return await self._relay(request, st, ep, up, first, out, t0, meter)
        finally:
            if up is not None:
                up.release()

    async def _relay(
        self,
        request: web.Request,
        st: ModelState,
        ep: Endpoint,
        up: aiohttp.ClientResponse,
        first: bytes,
        out: Outgoing,
        t0: float,
        meter: RequestMeter,
    ) -> web.StreamResponse:
        scan: StreamUsage | None = None
        if out.stream and up.status == 200:  # a whole answer relayed as it comes is not read
            if _encoded(up):
                meter.usage(None, (UsageError.ENCODED,))
            else:
                scan = StreamUsage(out.strip_usage)
                first = scan.feed(first)
        resp = web.StreamResponse(status=up.status, headers=response_headers(up.headers))
        await resp.prepare(request)
        if first:
            await resp.write(first)
        first_at = self._ttft(st.model, out.stream, t0)
        try:
            while True:
                chunk = await up.content.readany()
                if not chunk:
                    break
                if scan is not None:
                    chunk = scan.feed(chunk)
                    if not chunk:
                        continue
                await resp.write(chunk)
            if scan is not None:
                await resp.write(scan.end())
        except _BROKEN as exc:
            self._failed(st, ep, "mid_stream", exc)
            # Abort rather than end the chunked body cleanly: the client must see the break.
            if request.transport is not None:
                request.transport.abort()
            return resp
        finally:  # the usage chunk comes last: once seen it counts, even if the client left
            if scan is not None:
                decode_s = self.clock() - first_at
                meter.usage(scan.usage, scan.errors, decode_s, current_trace())
        await resp.write_eof()
        meter.answered(up.status, self.clock() - t0)
        return resp
