"""The gateway's edge: the per-connection limits aiohttp does not have, before any handler runs.

aiohttp (3.14) bounds each request line and header field (``max_line_size``,
``max_field_size``), the number of headers (``max_headers``) and the idle time of a keep-alive
connection (``keepalive_timeout``).  It has no bound on a request's *whole* header block (64
fields of 16 KiB each are 1 MiB per connection, ~2 MiB of Python objects), no deadline for
receiving it (a slowloris client keeps its connection for the keep-alive time, an hour by
default) and no cap on connections.  :class:`EdgeHandler` is aiohttp's per-connection protocol
(:class:`aiohttp.web.RequestHandler`) with those three added where the bytes arrive, so they
hold before authentication:

* **header budget**: the bytes of a request line + headers not yet complete may not exceed
  ``max_header_block_bytes``; beyond it the client gets 431 and the connection ends;
* **header deadline**: the first request's head must be complete ``header_timeout_s`` after the
  accept, a later one ``header_timeout_s`` after its first byte; beyond it 408 (a fresh
  connection that sent nothing is closed without an answer);
* **connection cap** (:class:`EdgeGuard`, per listener): a connection beyond
  ``max_connections`` gets 503 + ``Retry-After`` at once and is closed; it never reaches
  aiohttp's parser, so it costs no parsing and no buffers.

Head bytes are told from body bytes with what aiohttp's parser reports (its message queue,
``RequestHandler._messages``, the one internal this relies on; the edge tests fail if it
changes): each completed head appears as a message with its payload stream; the bytes of a chunk
minus the bytes that reached payloads are head bytes, and a completed head's size (re-assembled
from its message) leaves the count.  A chunk that only continues a body is not counted.  A
request with a chunked body ends its connection after its answer (the API answers it 411: the
gateway buffers bodies, so it asks for a ``Content-Length``), so chunk framing is never mistaken
for head bytes.  While a request is being answered, a pipelined head counts against the budget
and its deadline starts once the connection is idle again.  Answers the edge makes itself are
whole HTTP/1.1 responses in OpenAI's error shape; the connection is then half-closed and
lingers briefly, so the client reads the answer instead of a reset.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol

from .errors import raw_error
from .metrics import Metrics


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_connections: int
    max_header_block_bytes: int
    header_timeout_s: float
    linger_s: float = 1.0  # how long an ended connection waits for the client to close


class EdgeGuard:
    """The open connections of one listener, their cap, and what the edge refused."""

    def __init__(self, listener: str, limits: EdgeLimits, metrics: Metrics) -> None:
        self.listener = listener
        self.limits = limits
        self.open = 0
        self.handlers: set[EdgeHandler] = set()
        self._gauge = metrics.connections.labels(listener)
        self._rejected = metrics.edge_rejected
        self.refusal = raw_error(
            503,
            "Service Unavailable",
            f"the gateway replica has {limits.max_connections} open connections, its limit "
            "(--max-connections); retry",
            "too_many_connections",
            kind="server_error",
            retry_after=1,
        )

    def factory(self, manager: web.Server, **handler_kwargs: Any) -> Callable[[], EdgeHandler]:
        """The protocol factory for ``loop.create_server`` (``manager``: the runner's server)."""
        loop = asyncio.get_running_loop()
        return lambda: EdgeHandler(manager, guard=self, loop=loop, **handler_kwargs)

    def reject(self, reason: str) -> None:
        self._rejected.labels(self.listener, reason).inc()

    def close_idle(self) -> None:
        """Close every connection that has no request and no partial head (drain)."""
        for h in list(self.handlers):
            h.close_if_idle()

    def opened(self) -> bool:
        """Count a new connection; whether it is within the cap."""
        self.open += 1
        self._gauge.set(self.open)
        return self.open <= self.limits.max_connections

    def closed(self, handler: EdgeHandler) -> None:
        self.open -= 1
        self._gauge.set(self.open)
        self.handlers.discard(handler)


def _raw_size(payload: Any) -> int:
    """Bytes a payload stream received as sent (before decompression when compressed)."""
    raw = getattr(payload, "total_compressed_bytes", None)
    return int(raw if raw is not None else payload.total_bytes)


def _head_size(msg: Any) -> int:
    """The bytes of a parsed head: ``METHOD target HTTP/1.1\\r\\n``, each ``name: value\\r\\n``
    and the empty line (optional whitespace beyond one space, which the parser drops, is not
    seen: it stays counted until the connection is idle, see :data:`_RESIDUE`)."""
    raw = msg.raw_headers
    return (
        len(msg.method)
        + len(msg.path)
        + 14
        + sum(map(len, chain.from_iterable(raw)))
        + (4 * len(raw))
    )


# What may stay counted once a request is answered without being a partial head: optional
# whitespace the re-assembled head size does not see.  More than this waiting at an idle
# connection is the start of the next (pipelined) head, and its deadline starts then.
_RESIDUE = 256


class EdgeHandler(web.RequestHandler):
    """aiohttp's per-connection protocol plus the edge's header budget, header deadline and
    connection cap (module docstring)."""

    __slots__ = (
        "_body",
        "_busy",
        "_done",
        "_first",
        "_guard",
        "_head_timer",
        "_linger",
        "_pending",
    )

    def __init__(self, manager: web.Server, *, guard: EdgeGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._done = False  # refused or ended: what arrives is dropped, nothing is parsed
        self._pending = 0  # bytes of the head being received
        self._head_timer: asyncio.TimerHandle | None = None
        self._body: Any = None  # payload stream of the last parsed request, until its end
        self._first = True  # no head completed on this connection yet
        self._busy = False  # a parsed request is queued or being answered
        self._linger: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.opened():
            BaseProtocol.connection_made(self, transport)  # no request loop, no parser use
            self._guard.reject("connection_cap")
            self._end(self._guard.refusal)
            return
        super().connection_made(transport)
        self._guard.handlers.add(self)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        room = self._guard.limits.max_header_block_bytes - self._pending + 1
        if self._body is None and len(data) > room > 0:
            # Without a body under way the chunk starts with head bytes: the parser sees no more
            # of them than the budget allows (it builds objects for every header it completes).
            self._count(data[:room])
            self.data_received(data[room:])
            return
        self._count(data)

    def _count(self, data: bytes) -> None:
        """Feed aiohttp's parser; count head bytes; enforce the budget and the deadline."""
        if self._done:
            return
        body = self._body
        before = _raw_size(body) if body is not None else 0
        queued = len(self._messages)
        super().data_received(data)
        head = len(data)
        if body is not None:
            if len(self._messages) == queued and not body.is_eof():
                return  # the chunk continued a body
            head -= _raw_size(body) - before
            self._body = None  # it ended in this chunk
        if len(self._messages) > queued:
            last: Any = None
            for msg, payload in islice(self._messages, queued, None):
                if getattr(msg, "raw_headers", None) is None or msg.chunked:
                    # A parse error (aiohttp answers 400) or a chunked body (the API answers
                    # 411: its framing is not told from head bytes): the connection ends after
                    # this answer, and nothing more is counted.
                    self._done = True
                    self.close()
                    return
                head -= _raw_size(payload) + _head_size(msg)
                last = payload
            self._body = None if last.is_eof() else last
            self._busy = True
            self._first = False
            self._disarm()
        self._pending = max(0, self._pending + head)
        if self._pending > self._guard.limits.max_header_block_bytes:
            self._guard.reject("header_budget")
            self._end(
                raw_error(
                    431,
                    "Request Header Fields Too Large",
                    "the request line and headers exceed the gateway's limit of "
                    f"{self._guard.limits.max_header_block_bytes} bytes",
                    "headers_too_large",
                )
            )
            return
        if self._pending and not self._busy and self._head_timer is None:
            self._arm()

    # ---- aiohttp's request loop ----

    async def finish_response(self, request: Any, resp: Any, start_time: Any) -> Any:
        result = await super().finish_response(request, resp, start_time)
        if not self._messages:
            self._busy = False
            if self._pending <= _RESIDUE:
                self._pending = 0
            elif self._head_timer is None and not self._done:
                self._arm()  # a pipelined head is under way: its deadline starts now
        return result

    # ---- the edge ----

    def close_if_idle(self) -> None:
        if not self._busy and not self._pending and not self._done:
            self.force_close()

    def _arm(self) -> None:
        self._head_timer = asyncio.get_running_loop().call_later(
            self._guard.limits.header_timeout_s, self._head_timeout
        )

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport is None or self._done or self._busy:
            return
        if not (self._pending or self._first):
            return
        self._guard.reject("header_timeout")
        answer = None
        if self._pending:
            answer = raw_error(
                408,
                "Request Timeout",
                "the request line and headers did not arrive within the gateway's limit of "
                f"{self._guard.limits.header_timeout_s:g} s",
                "request_timeout",
            )
        self._end(answer)

    def _end(self, answer: bytes | None) -> None:
        """Answer (when no response is under way) and end the connection: half-close, drop what
        still arrives, close when the client does or after the linger time."""
        self._disarm()
        transport = self.transport
        if transport is None:
            return
        if self._busy:  # a response may be half written: no second answer on this connection
            self._done = True
            self.force_close()
            return
        if not self._done:
            self._done = True
            self.close()  # aiohttp: end the request loop
        if answer is not None:
            transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = asyncio.get_running_loop().call_later(
            self._guard.limits.linger_s, transport.abort
        )
