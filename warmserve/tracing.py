"""OpenTelemetry tracing shared by the gateway, the operator and the node agent's engines.

Off by default.  ``--otlp-traces-endpoint URL`` (the chart's ``tracing.endpoint``; the flags are
:mod:`warmserve.flags.tracing`) turns it on in each component; only then is the OpenTelemetry
SDK imported (:func:`provider`), so a component with tracing off pays no import and has no SDK
object on its request path.

Each component builds **its own** ``TracerProvider`` (never the process-global one): tests run a
gateway, an operator and engines in one process, each with its own ``service.name``, and a
library that sets the global provider (vLLM does) cannot redirect warmserve's spans.

Spans go to an OTLP/HTTP receiver (``URL`` is its base, e.g. ``http://collector:4318``; spans are
posted to ``URL/v1/traces``) through a batch processor: a bounded queue exported by a background
thread, so a slow or absent collector drops spans instead of slowing or growing a request path.
Sampling: a trace starts sampled with probability ``sample_ratio``; a span with a parent follows
its parent's decision (W3C ``traceparent`` from a client, the gateway's from an engine's view).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# W3C Trace Context, version 00: what warmserve writes and accepts where it parses one itself.
TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16

# The batch processor's bounds: a queue of at most this many spans (more are dropped, counted by
# the SDK), exported every second in batches.
MAX_QUEUE = 2048
EXPORT_DELAY_MS = 1000
EXPORT_TIMEOUT_S = 5.0
MAX_ATTRIBUTE_CHARS = 1024


class TracingConfigError(ValueError):
    """A bad tracing flag; the message names it."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go and how many traces start sampled (``--otlp-traces-endpoint``,
    ``--trace-sample-ratio``); ``service`` is the ``service.name`` of the spans."""

    endpoint: str
    sample_ratio: float = 1.0
    service: str = "warmserve"

    def __post_init__(self) -> None:
        check_endpoint(self.endpoint)
        r = self.sample_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise TracingConfigError(f"--trace-sample-ratio must be a number, got {r!r}")
        if not 0.0 <= r <= 1.0:
            raise TracingConfigError(f"--trace-sample-ratio must be in [0, 1], got {r}")

    @property
    def traces_url(self) -> str:
        """The OTLP/HTTP traces URL (the exporter posts protobuf there)."""
        return traces_url(self.endpoint)


def check_endpoint(url: str) -> str:
    """``url`` if it is an ``http(s)://host[:port][/base]`` OTLP/HTTP base URL, else a clear
    :class:`TracingConfigError` (no credentials in it: they would show in every log line)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TracingConfigError(f"--otlp-traces-endpoint {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingConfigError(
            f"--otlp-traces-endpoint {url!r}: use http(s)://HOST:PORT, the collector's OTLP/HTTP "
            "receiver (port 4318 by default)"
        )
    if parts.username is not None or parts.password is not None:
        raise TracingConfigError(f"--otlp-traces-endpoint {url!r}: no credentials in the URL")
    if parts.query or parts.fragment:
        raise TracingConfigError(f"--otlp-traces-endpoint {url!r}: no query or fragment")
    if port == 0:
        raise TracingConfigError(f"--otlp-traces-endpoint {url!r}: port 0")
    return url


def traces_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def valid_traceparent(value: str) -> bool:
    """A W3C version-00 ``traceparent`` with non-zero ids."""
    m = TRACEPARENT_RE.match(value)
    return bool(m) and m.group(1) != _ZERO_TRACE and m.group(2) != _ZERO_SPAN


def provider(cfg: TracingConfig, exporter: Any = None) -> Any:
    """A new SDK ``TracerProvider`` exporting to ``cfg``'s endpoint (``exporter``: another span
    exporter, for a test).  The SDK is imported here, at the first use."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=cfg.traces_url, timeout=EXPORT_TIMEOUT_S)
    p = TracerProvider(
        resource=Resource.create({"service.name": cfg.service}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        # Attribute values can come from clients (a model name, a path): bounded.
        span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS),
    )
    p.add_span_processor(
        BatchSpanProcessor(
            exporter,
            max_queue_size=MAX_QUEUE,
            schedule_delay_millis=EXPORT_DELAY_MS,
            export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000),
        )
    )
    return p


def traceparent_of(span_context: Any) -> str:
    """The W3C ``traceparent`` of an SDK ``SpanContext``."""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{int(span_context.trace_flags):02x}"
    )


def span_context_of(traceparent: str) -> Any:
    """A remote ``SpanContext`` from a valid ``traceparent`` (:func:`valid_traceparent`)."""
    from opentelemetry.trace import SpanContext, TraceFlags

    m = TRACEPARENT_RE.match(traceparent)
    if m is None:
        raise ValueError(f"not a traceparent: {traceparent!r}")
    return SpanContext(
        int(m.group(1), 16), int(m.group(2), 16), True, TraceFlags(int(m.group(3), 16))
    )


def vllm_tracing_env(sample_ratio: float) -> dict[str, str]:
    """Environment for vLLM's tracer (with ``--otlp-traces-endpoint``): OTLP over HTTP like the
    rest of warmserve (vLLM's default is gRPC), warmserve's service name and sampler."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "warmserve-engine",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": repr(float(sample_ratio)),
    }
