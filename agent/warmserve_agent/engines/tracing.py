"""The simulated engine's side of a trace: it continues the gateway's (W3C ``traceparent``).

With ``EngineSpec.traces_endpoint`` set (the agent's ``--otlp-traces-endpoint``), every
``/v1/*`` request is a server span ``POST /v1/chat/completions`` in the trace of the request's
``traceparent`` — the gateway's client span — as vLLM's ``llm_request`` span is when vLLM runs
with ``--otlp-traces-endpoint``; its time to first token is ``gen_ai.latency.time_to_first_token``
(vLLM's attribute).  One tracer provider per endpoint and process (several instances of a worker
share it); the SDK is imported only then.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from warmserve.tracing import TracingConfig, provider

_span: contextvars.ContextVar[Any] = contextvars.ContextVar("warmserve_engine_span", default=None)


@functools.cache
def _tracer(endpoint: str, ratio: float) -> Any:
    p = provider(TracingConfig(endpoint, ratio, "warmserve-engine"))
    return p.get_tracer("warmserve.engine")


def middleware(endpoint: str, ratio: float, model: str, instance_id: str) -> Any:
    """An aiohttp middleware tracing the engine's ``/v1/*`` requests."""
    from aiohttp import web
    from opentelemetry.trace import SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer = _tracer(endpoint, ratio)
    propagator = TraceContextTextMapPropagator()

    @web.middleware
    async def traced(request: web.Request, handler: Any) -> Any:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        span = tracer.start_span(
            f"{request.method} {request.path}",
            context=propagator.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "gen_ai.request.model": model,
                "warmserve.instance.id": instance_id,
            },
        )
        token = _span.set(span)
        status = 499
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        finally:
            _span.reset(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(StatusCode.ERROR)
            span.end()

    return traced


def note(**attributes: Any) -> None:
    """Attributes on the current request's span (none: not traced)."""
    span = _span.get()
    if span is not None:
        for k, v in attributes.items():
            span.set_attribute(k, v)
