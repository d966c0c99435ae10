"""The tracing flags of ``warmserve gateway``, ``operator`` and ``agent`` (:mod:`warmserve.tracing`
has what they configure)."""

from __future__ import annotations

import argparse

from warmserve.flags import default
from warmserve.tracing import TracingConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--otlp-traces-endpoint",
        default="",
        metavar="URL",
        help="send OpenTelemetry traces to this OTLP/HTTP receiver, e.g. "
        "http://otel-collector:4318 (off when empty; the chart's tracing.endpoint)",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=default(TracingConfig, "sample_ratio"),
        metavar="R",
        help="fraction of new traces sampled, 0-1 (a request with a sampled parent follows it)",
    )


def from_args(args: argparse.Namespace, service: str) -> TracingConfig | None:
    """The flags as a :class:`TracingConfig` (``None``: tracing off); raises
    :class:`~warmserve.tracing.TracingConfigError` with the flag named."""
    if not args.otlp_traces_endpoint:
        return None
    return TracingConfig(args.otlp_traces_endpoint, args.trace_sample_ratio, service)
