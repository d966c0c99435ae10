"""Tracing of the gateway's requests (OpenTelemetry; off unless ``--otlp-traces-endpoint``).

Per forwarded request (``/v1/*``), in the trace of the client's W3C ``traceparent`` when it sent
a valid one:

* a **server span** ``POST /v1/chat/completions`` (HTTP server conventions: ``http.route`` is a
  fixed OpenAI route or ``/v1/*``, never the client's path; ``gen_ai.request.model`` the served
  ``spec.model.name``; ``http.response.status_code``);
* a child **``gateway.hold``** span while the request waits in its model's queue (only when it is
  held): how long, how it ended, the instance it got and whether that instance's start was a
  prewarm hit.  Its context goes into this replica's ``/demand`` report (at most
  :data:`~warmserve.api.demand.MAX_TRACES` per model), so the operator's start span
  links to the requests that woke it;
* the **routing** decision as an event ``gateway.routed`` (instance id, endpoint) on the server
  span, or, when the gateway answers itself (a hold cap's 429, the hold deadline's 503),
  ``warmserve.rejected`` (the error code) on it — a request a cap refuses was never held;
* a child **client span** per attempt at an engine, ``chat <model>`` (GenAI conventions): the
  upstream time, ``warmserve.ttft_s`` (arrival at the gateway to the first byte) and an event at
  the first byte.  Its context is what the engine receives as ``traceparent`` (the client's own
  ``traceparent``/``tracestate`` are replaced, never passed on), so vLLM started with
  ``--otlp-traces-endpoint`` (and the simulated engine) continue the trace;
* ``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens`` on the server span and the
  client span of the answered attempt, when the engine reported usage (:mod:`.usage`).

With tracing off none of this exists: the server does not install :meth:`middleware`, and
:func:`current` returns ``None`` to every hook (a context-variable read), so no span, no SDK
import and no header change — a client's ``traceparent`` reaches the engine untouched, and none
is invented.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from warmserve.api.demand import MAX_TRACES
from warmserve.tracing import TracingConfig, provider, traceparent_of

if TYPE_CHECKING:
    from .catalog import Deployment
    from .routing import Endpoint


class _Outgoing(Protocol):
    """What :meth:`RequestTrace.upstream` reads of ``proxy.Outgoing`` (a frozen dataclass)."""

    method: str
    path: str
    headers: Sequence[tuple[str, str]]
    stream: bool


_O = TypeVar("_O", bound=_Outgoing)

# The fixed routes a span may be named after; anything else under /v1/ is "/v1/*".
ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models"}
)
_OPERATION = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
MAX_ATTRIBUTE_CHARS = 256  # a client's path or model name never makes a span bigger than this

_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "warmserve_gateway_request_trace", default=None
)


def current() -> RequestTrace | None:
    """The trace of the request this task handles (``None``: tracing off or not traced)."""
    return _current.get()


def _route(path: str) -> str:
    return path if path in ROUTES else "/v1/*"


class GatewayTracing:
    """One replica's tracer provider, request middleware and held-request registry."""

    def __init__(self, cfg: TracingConfig, exporter: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.cfg = cfg
        self.provider = provider(cfg, exporter)
        self.tracer = self.provider.get_tracer("warmserve.gateway")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        # model -> {request: traceparent of its hold span}, in arrival order (dicts keep it)
        self._held: dict[str, dict[RequestTrace, str]] = {}

    # ---- the server span -------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        route = _route(request.path)
        parent = self._propagator.extract(request.headers)  # invalid values: a new trace
        span = self.tracer.start_span(
            f"{request.method} {route}",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "http.route": route,
                "url.path": request.path[:MAX_ATTRIBUTE_CHARS],
                "url.scheme": request.scheme,
            },
        )
        tr = RequestTrace(self, span)
        token = _current.set(tr)
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (as the gateway's metrics count it)
            raise
        finally:
            _current.reset(token)
            tr.end(status)

    # ---- held requests, for /demand -------------------------------------------------------

    def held_changed(self, model: str, held: int, before: int) -> None:
        """The dispatcher's held count of ``model`` changed; a rise happens in the task of the
        request that joined the queue (``Dispatcher.acquire``), so that request is held now."""
        if held > before:
            tr = current()
            if tr is not None:
                tr.hold_begin(model)

    def held_traces(self, model: str) -> tuple[str, ...]:
        """``traceparent``s of the (sampled) requests held for ``model``, oldest first."""
        held = self._held.get(model)
        if not held:
            return ()
        out = []
        for tp in held.values():
            out.append(tp)
            if len(out) >= MAX_TRACES:
                break
        return tuple(out)

    def _register(self, model: str, tr: RequestTrace, traceparent: str) -> None:
        self._held.setdefault(model, {})[tr] = traceparent

    def _unregister(self, model: str, tr: RequestTrace) -> None:
        held = self._held.get(model)
        if held is not None and held.pop(tr, None) is not None and not held:
            del self._held[model]

    def shutdown(self) -> None:
        """Export what is queued, then stop (bounded by the exporter's timeout)."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one request (see the module docstring); ended by :meth:`end`."""

    __slots__ = ("_hold", "_hold_model", "_upstream", "attempts", "model", "span", "tracing")

    def __init__(self, tracing: GatewayTracing, span: Any) -> None:
        self.tracing = tracing
        self.span = span
        self.model = ""
        self.attempts = 0
        self._hold: Any = None
        self._hold_model = ""
        self._upstream: Any = None

    def _child(self, name: str, kind: Any = None, **attributes: Any) -> Any:
        t = self.tracing
        ctx = t._trace.set_span_in_context(self.span)
        kw = {"kind": kind} if kind is not None else {}
        return t.tracer.start_span(name, context=ctx, attributes=attributes, **kw)

    def _set_model(self, model: str) -> None:
        if not self.model:
            self.model = model
            self.span.set_attribute("gen_ai.request.model", model[:MAX_ATTRIBUTE_CHARS])

    def hold_begin(self, model: str) -> None:
        self._set_model(model)
        if self._hold is not None:
            return
        self._hold = self._child("gateway.hold", **{"gen_ai.request.model": model})
        self._hold_model = model
        ctx = self._hold.get_span_context()
        if ctx.trace_flags.sampled:
            self.tracing._register(model, self, traceparent_of(ctx))

    def _hold_end(self, outcome: str, error: bool = False) -> None:
        hold, self._hold = self._hold, None
        if hold is None:
            return
        self.tracing._unregister(self._hold_model, self)
        hold.set_attribute("warmserve.hold.outcome", outcome)
        if error:
            hold.set_status(self.tracing._trace.StatusCode.ERROR, outcome)
        hold.end()

    def rejected(self, model: str, code: str) -> None:
        """The gateway answers the request itself (``holding.Rejected``: a hold cap, the hold
        deadline, the model gone); a request a cap refuses was never held (no hold span)."""
        self._set_model(model)
        self.span.set_attribute("warmserve.rejected", code)
        self._hold_end(code, error=True)

    def routed(self, model: str, ep: Endpoint, dep: Deployment) -> None:
        """An instance was acquired for the request (after holding, or at once)."""
        self._set_model(model)
        inst = next((i for i in dep.instances if i.instance_id == ep.instance_id), None)
        hit = bool(inst is not None and inst.prewarm_hit)
        if self._hold is not None:
            self._hold.set_attribute("warmserve.instance.id", ep.instance_id)
            self._hold.set_attribute("warmserve.prewarm_hit", hit)
            self._hold_end("dispatched")
        self.span.add_event(
            "gateway.routed",
            {"warmserve.instance.id": ep.instance_id, "server.address": ep.url},
        )

    def upstream(self, ep: Endpoint, out: _O) -> _O:
        """Start the client span of one attempt; ``out`` with its ``traceparent``."""
        self._upstream_end(None)  # a previous attempt that raised
        self.attempts += 1
        op = _OPERATION.get(out.path, "")
        self._upstream = span = self._child(
            f"{op or out.method} {self.model}",
            self.tracing._trace.SpanKind.CLIENT,
            **{
                "gen_ai.request.model": self.model,
                "server.address": ep.url,
                "warmserve.instance.id": ep.instance_id,
                "warmserve.attempt": self.attempts,
                "warmserve.stream": out.stream,
            },
        )
        if op:
            span.set_attribute("gen_ai.operation.name", op)
        carrier: dict[str, str] = {}
        self.tracing._propagator.inject(
            carrier, context=self.tracing._trace.set_span_in_context(span)
        )
        headers = (*_without_trace_headers(out.headers), *carrier.items())
        return replace(out, headers=headers)  # type: ignore[type-var]

    def first_byte(self, ttft_s: float) -> None:
        self.span.set_attribute("warmserve.ttft_s", ttft_s)
        if self._upstream is not None:
            self._upstream.set_attribute("warmserve.ttft_s", ttft_s)
            self._upstream.add_event("gateway.first_byte")

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        """The engine's token counts (GenAI conventions), on the request's span and the
        attempt's."""
        attrs = {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        }
        self.span.set_attributes(attrs)
        if self._upstream is not None:
            self._upstream.set_attributes(attrs)

    def upstream_done(self, status: int | None) -> None:
        """The attempt ended: the engine's status, or ``None`` (refused or broken: retried)."""
        self._upstream_end(status)

    def _upstream_end(self, status: int | None) -> None:
        span, self._upstream = self._upstream, None
        if span is None:
            return
        if status is None:
            span.set_status(self.tracing._trace.StatusCode.ERROR, "no answer from the engine")
        else:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(self.tracing._trace.StatusCode.ERROR)
        span.end()

    def end(self, status: int) -> None:
        self._hold_end(f"answered_{status}", error=True)  # still held: the request failed
        self._upstream_end(None)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(self.tracing._trace.StatusCode.ERROR)
        self.span.end()


def _without_trace_headers(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _TRACE_HEADERS]
