"""Tracing of the operator's decisions (OpenTelemetry; off unless ``--otlp-traces-endpoint``).

Every decision the operator carries out (:class:`~warmserve_operator.act.Actor`) is one span
covering its agent call: ``operator.start`` (with the instance it started, whether it was a
prewarm hit, the activation time), ``operator.prewarm``, ``operator.evict``, ``operator.drain``,
``operator.end``.  Attributes name the model, node, GPUs and the call's request id; a refused or
failed call sets the span's status to error with the agent's code.

A start span is **linked** (span links, not parentage: one start serves many requests and
outlives none of them) to the held requests that woke it: each poll reads, with the held counts,
the ``traceparent`` of up to ``MAX_TRACES`` held requests per model from every gateway replica
(:mod:`.gateway_demand`), and :func:`note_held` keeps the latest; a start of that model links to
them.  The operator samples every decision span (a handful per minute): the sample ratio of
``--trace-sample-ratio`` applies to requests at the gateway.

Process-wide (the operator is one loop per process): :func:`enable` at start-up; with tracing off
every hook is a call that returns at once, and the SDK is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from warmserve.control.decisions import Decision, Drain, EndGrace, Evict, Prewarm, Start
from warmserve.tracing import TracingConfig, provider, span_context_of

_NAME = {Start: "start", Drain: "drain", EndGrace: "end", Prewarm: "prewarm", Evict: "evict"}


class DecisionTracing:
    def __init__(self, cfg: TracingConfig, exporter: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link

        # Decision spans are rare and each one matters: all of them are sampled.
        self.provider = provider(replace(cfg, sample_ratio=1.0), exporter)
        self.tracer = self.provider.get_tracer("warmserve.operator")
        self._trace = trace
        self._link = Link
        self.held: Mapping[str, tuple[str, ...]] = {}

    def begin(self, d: Decision, verb: str, request_id: str) -> Any:
        attrs: dict[str, Any] = {
            "warmserve.decision": _NAME[type(d)],
            "warmserve.agent.call": verb,
            "warmserve.model": d.model,
            "warmserve.node": d.node,
            "warmserve.gpus": list(d.gpus),
            "warmserve.request_id": request_id,
        }
        links = []
        if isinstance(d, Start):
            attrs["warmserve.prewarm_hit"] = d.hit  # as decided; the call's result follows
            attrs["warmserve.slot_id"] = d.slot_id or ""
            attrs["warmserve.evicts"] = len(d.evicts)
            traces = self.held.get(d.model, ())
            attrs["warmserve.linked_requests"] = len(traces)
            links = [
                self._link(span_context_of(tp), {"warmserve.link": "held_request"}) for tp in traces
            ]
        elif isinstance(d, Prewarm):
            attrs.update(
                {
                    "warmserve.prewarm.kind": d.kind.value,
                    "warmserve.prewarm.rank": d.rank,
                    "warmserve.prewarm.score": d.score,
                    "warmserve.prewarm.layers": d.layers,
                }
            )
        elif isinstance(d, Evict):
            attrs["warmserve.slot_id"] = d.slot_id
        elif isinstance(d, Drain | EndGrace):
            attrs["warmserve.instance.id"] = d.instance_id
        if not isinstance(d, Prewarm) and d.reason:
            attrs["warmserve.reason"] = d.reason
        return self.tracer.start_span(f"operator.{_NAME[type(d)]}", attributes=attrs, links=links)


_state: DecisionTracing | None = None


def enable(cfg: TracingConfig, exporter: Any = None) -> DecisionTracing:
    """Turn decision spans on for this process (replacing an earlier setting)."""
    global _state
    disable()
    _state = DecisionTracing(cfg, exporter)
    return _state


def disable() -> None:
    """Export what is queued and turn tracing off."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


def enabled() -> bool:
    return _state is not None


def note_held(traces: Mapping[str, tuple[str, ...]]) -> None:
    """The held requests' traceparents per model, as this poll read them from the gateways."""
    if _state is not None:
        _state.held = traces


def begin(d: Decision, verb: str, request_id: str) -> Any:
    """A span for carrying out ``d`` (``None`` with tracing off); end it with :func:`end`."""
    return _state.begin(d, verb, request_id) if _state is not None else None


def started(span: Any, instance_id: str, hit: bool, activation_s: float) -> None:
    if span is not None:
        span.set_attribute("warmserve.instance.id", instance_id)
        span.set_attribute("warmserve.prewarm_hit", hit)
        span.set_attribute("warmserve.activation_s", activation_s)


def failed(span: Any, code: str, message: str) -> None:
    if span is not None and _state is not None:
        span.set_attribute("warmserve.error.code", code)
        span.set_status(_state._trace.StatusCode.ERROR, message[:256])


def end(span: Any) -> None:
    if span is not None:
        span.end()
