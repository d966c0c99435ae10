"""Prometheus metrics of the gateway (prefix ``warmserve_gateway_``, and the OpenTelemetry GenAI
conventions' names in Prometheus form, ``gen_ai_*``; listed in docs/gateway.md).

A private registry per :class:`Metrics`, served on the admin port's ``/metrics``.  The ``model``
label is always a served ``spec.model.name`` (or ``_unknown`` / ``_none``), never a string a
client made up, so clients cannot blow up the label cardinality.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "warmserve_gateway"
UNKNOWN_MODEL = "_unknown"  # a request whose model no deployment serves
NO_MODEL = "_none"  # a request rejected before its model was known (400, 401, 413)

# From a few ms (a warm route) to minutes (a cold start held in the queue).
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
# The GenAI conventions' advised buckets (token counts; request duration, holding included, up
# to the hold limit; time per output token).
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92, 300,
)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's children of the per-request metrics, resolved once (``labels()`` per request
    costs more than the observation itself)."""

    queue_wait: Any
    ttft_stream: Any
    ttft_unary: Any
    inflight: Any


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._models: dict[str, ModelMetrics] = {}
        self._answered: dict[tuple[str, int], Any] = {}
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests_total",
            "Requests answered, by model and HTTP status code",
            ["model", "code"],
            registry=r,
        )
        self.held = Gauge(
            f"{PREFIX}_held_requests",
            "Requests held in the model's queue now (no instance with room)",
            ["model"],
            registry=r,
        )
        self.inflight = Gauge(
            f"{PREFIX}_inflight_requests",
            "Requests forwarded to an instance and not finished",
            ["model"],
            registry=r,
        )
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "Time from arrival to dispatch to an instance (0 when not held)",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_ttft_seconds",
            "Time from arrival to the first response byte sent to the client",
            ["model", "stream"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.held_left = Counter(
            f"{PREFIX}_held_disconnects_total",
            "Held requests whose client disconnected (they left the queue)",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            f"{PREFIX}_rejected_total",
            "Requests the gateway refused, by reason (queue_full, hold_timeout, ...)",
            ["model", "reason"],
            registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_retries_total",
            "Requests retried on another instance after an engine failed before the first byte",
            ["model"],
            registry=r,
        )
        self.upstream_errors = Counter(
            f"{PREFIX}_upstream_errors_total",
            "Engine failures seen (connect, ttfb_timeout, status, reset mid-stream)",
            ["model", "kind"],
            registry=r,
        )
        self.instances = Gauge(
            f"{PREFIX}_serving_instances",
            "Serving instances this replica routes to",
            ["model"],
            registry=r,
        )
        self.connections = Gauge(
            f"{PREFIX}_connections",
            "Open client connections, by listener (api, admin)",
            ["listener"],
            registry=r,
        )
        self.edge_rejected = Counter(
            f"{PREFIX}_edge_rejected_total",
            "Connections the edge refused or ended before a handler ran, by listener and reason "
            "(connection_cap, header_budget, header_timeout)",
            ["listener", "reason"],
            registry=r,
        )
        self.catalog_synced = Gauge(
            f"{PREFIX}_catalog_synced",
            "1 once the ModelDeployments were listed (the replica is ready)",
            registry=r,
        )
        self.key_requests = Counter(
            f"{PREFIX}_key_requests_total",
            "Requests forwarded or held per API key id (the Secret's data key name, never the "
            "key; _anonymous without keys) and the model's namespace",
            ["key", "namespace"],
            registry=r,
        )

        # Tokens, from the engines' usage (usage.py; docs/gateway.md "Token metrics").
        self.tokens = Counter(
            f"{PREFIX}_tokens_total",
            "Tokens of answers from engines, by model, the model's namespace, API key id (never "
            "the key; _anonymous without keys, as key_requests_total) and type (input: prompt, "
            "output: completion)",
            ["model", "namespace", "key", "type"],
            registry=r,
        )
        self.usage_errors = Counter(
            f"{PREFIX}_usage_errors_total",
            "Answers whose usage was not counted, by reason (malformed, invalid, oversized, "
            "encoded)",
            ["model", "reason"],
            registry=r,
        )
        genai = ["gen_ai_operation_name", "gen_ai_request_model"]
        self.token_usage = Histogram(
            "gen_ai_client_token_usage",
            "Tokens per answer from an engine (gen_ai.client.token.usage), by type",
            [*genai, "gen_ai_token_type"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from arrival to the last byte of an engine's answer, holding included "
            '(gen_ai.server.request.duration); error_type: the HTTP status from 400, else ""',
            [*genai, "error_type"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first of a streamed answer (first to last byte / "
            "(output tokens - 1); gen_ai.server.time_per_output_token)",
            genai,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )

    def model(self, model: str) -> ModelMetrics:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(
                self.queue_wait.labels(model),
                self.ttft.labels(model, "true"),
                self.ttft.labels(model, "false"),
                self.inflight.labels(model),
            )
        return m

    def answered(self, model: str, code: int) -> None:
        """Count one answer (``warmserve_gateway_requests_total``)."""
        child = self._answered.get((model, code))
        if child is None:
            child = self._answered[(model, code)] = self.requests.labels(model, str(code))
        child.inc()
