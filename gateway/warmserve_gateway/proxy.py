"""Forwarding one request to an engine and the answer back (issue 9 "Routing").

* The request body goes unchanged (except ``model``, rewritten by the server when the client
  named the deployment rather than ``spec.model.name``); hop-by-hop headers and the client's
  ``Authorization`` (the gateway's API key, which engines must never see) are dropped.
* Answers with a ``Content-Length`` up to :data:`BUFFER_MAX` are read whole and sent in one
  piece; everything else — SSE streams in particular — is passed through *chunk by chunk* as the
  engine sends it (``readany``), never buffered.  Bytes are relayed as they are
  (``auto_decompress`` off).
* **Retry once before the first byte**: when the engine cannot be reached, answers 502/503/504,
  or breaks the connection before the first body byte, the request goes once more to another
  instance (the same one only if no other has room), and the failing instance is ejected for
  ``eject_s`` if it refused the connection.  After the first byte reached the client nothing can
  be retried: a break mid-stream aborts the client's connection, so the client sees an error
  rather than a silently truncated answer.
* **A refused connection is not that retry**: the engine never saw the request, so it goes to
  another instance, or, when every instance refused (the operator ended them between two of this
  replica's discovery updates: a model scaled to zero), it is held like any request at a model
  without an instance — its held demand starts one — until the hold deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from .holding import Dispatcher, ModelState, Rejected
from .metrics import Metrics
from .routing import Endpoint
from .tracing import current as current_trace

log = logging.getLogger("warmserve.gateway.proxy")

BUFFER_MAX = 1024**2
# Never forwarded (RFC 9110 §7.6.1 hop-by-hop, plus what the gateway owns).
_DROP_REQUEST = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization",
        "expect",
    }
)  # fmt: skip
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}
)
_RETRY_STATUS = frozenset({502, 503, 504})
_BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


class UpstreamError(Exception):
    """Both attempts failed; the client gets 502 with this message."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What is sent to the engine."""

    method: str
    path_qs: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool  # the client asked for SSE (label of the TTFT histogram only)
    key: str = ""  # the caller's API key id (per-key cap on held requests)


def request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_REQUEST}


def _response_headers(up: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in up.headers.items() if k.lower() not in _DROP_RESPONSE}


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
    ) -> None:
        self.session = session
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.eject_s = eject_s
        self.clock = clock

    async def forward(
        self, request: web.Request, st: ModelState, out: Outgoing, t0: float, deadline: float
    ) -> web.StreamResponse:
        """Hold until an instance has room, forward, relay; one retry before the first byte."""
        avoid: frozenset[str] = frozenset()
        mm = self.metrics.model(st.model)
        tr = current_trace()  # None unless tracing is on
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
                    request, st, ep, sent, t0, last=retried, refusable=self.clock() < deadline
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

    def _ttft(self, model: str, stream: bool, t0: float) -> None:
        mm = self.metrics.model(model)
        ttft = self.clock() - t0
        (mm.ttft_stream if stream else mm.ttft_unary).observe(ttft)
        tr = current_trace()
        if tr is not None:
            tr.first_byte(ttft)

    def _failed(self, st: ModelState, ep: Endpoint, kind: str, exc: BaseException | str) -> None:
        self.metrics.upstream_errors.labels(st.model, kind).inc()
        log.warning(
            "event=upstream_failed model=%s instance=%s url=%s kind=%s error=%r",
            st.model, ep.instance_id, ep.url, kind, str(exc) or type(exc).__name__,
        )  # fmt: skip

    async def _attempt(
        self,
        request: web.Request,
        st: ModelState,
        ep: Endpoint,
        out: Outgoing,
        t0: float,
        last: bool,
        refusable: bool = False,
    ) -> Any:
        try:
            up = await self.session.request(
                out.method, ep.target(out.path_qs), data=out.body, headers=out.headers
            )
        except _BROKEN as exc:
            self._failed(st, ep, "connect", exc)
            if isinstance(exc, aiohttp.ClientConnectorError):
                self.dispatcher.eject(st, ep, self.eject_s)
                if refusable:  # before the hold deadline: try elsewhere or hold
                    return _REFUSED
            if not last:
                return _RETRY
            raise UpstreamError(f"engine of {st.model!r} failed: {exc}") from exc
        try:
            if up.status in _RETRY_STATUS and not last:
                self._failed(st, ep, f"status_{up.status}", f"HTTP {up.status}")
                return _RETRY
            length = up.content_length
            if length is not None and length <= BUFFER_MAX:
                try:
                    data = await up.read()
                except _BROKEN as exc:
                    self._failed(st, ep, "body", exc)
                    if not last:
                        return _RETRY
                    raise UpstreamError(f"engine of {st.model!r} failed: {exc}") from exc
                self._ttft(st.model, out.stream, t0)
                return web.Response(status=up.status, body=data, headers=_response_headers(up))
            try:
                first = await up.content.readany()
            except _BROKEN as exc:
                self._failed(st, ep, "body", exc)
                if not last:
                    return _RETRY
                raise UpstreamError(f"engine of {st.model!r} failed: {exc}") from exc
            return await self._relay(request, st, ep, up, first, out, t0)
        finally:
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
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, headers=_response_headers(up))
        await resp.prepare(request)
        if first:
            await resp.write(first)
        self._ttft(st.model, out.stream, t0)
        try:
            while True:
                chunk = await up.content.readany()
                if not chunk:
                    break
                await resp.write(chunk)
        except _BROKEN as exc:
            self._failed(st, ep, "mid_stream", exc)
            # Abort rather than end the chunked body cleanly: the client must see the break.
            if request.transport is not None:
                request.transport.abort()
            return resp
        await resp.write_eof()
        return resp
