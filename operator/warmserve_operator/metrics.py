"""Prometheus metrics of the operator (``prometheus-client``).

A private :class:`CollectorRegistry` per :class:`Metrics` object, so tests (and two operators in
one process) never collide on the global registry.  ``warmserve operator --metrics-port`` serves
it over HTTP.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("warmserve.operator")

PREFIX = "warmserve_operator"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.leader = Gauge(
            f"{PREFIX}_leader",
            "1 when this replica is the active (leader) operator: it holds the loop's Lease and "
            "renewed it within the renew deadline (0 at once when it cannot)",
            registry=r,
        )
        self.leadership_lost = Counter(
            f"{PREFIX}_leadership_lost_total",
            "Times this replica stopped leading (reason: lost = another replica holds the Lease, "
            "released = handed over to a higher priority, renew_deadline = not renewed in "
            "time, stopped = shutdown, fenced_by_agent = an agent refused this term's fencing "
            "token: a newer leader reached it)",
            ["reason"],
            registry=r,
        )
        self.windows = Counter(f"{PREFIX}_windows_total", "Prediction windows closed", registry=r)
        self.polls = Counter(f"{PREFIX}_polls_total", "Agent poll rounds", registry=r)
        self.actions = Counter(
            f"{PREFIX}_actions_total", "Agent calls issued", ["verb", "outcome"], registry=r
        )
        self.starts = Counter(
            f"{PREFIX}_instance_starts_total", "Instances started", ["model", "start"], registry=r
        )
        self.predicted = Gauge(
            f"{PREFIX}_predicted_load",
            "Predicted load for the current window (requests in flight)",
            ["model", "stat"],
            registry=r,
        )
        self.observed = Gauge(
            f"{PREFIX}_observed_load",
            "Load of the last closed window (requests in flight)",
            ["model", "stat"],
            registry=r,
        )
        self.inflight = Gauge(f"{PREFIX}_inflight", "Requests in flight now", ["model"], registry=r)
        self.instances = Gauge(f"{PREFIX}_instances", "Serving instances", ["model"], registry=r)
        self.replicas = Gauge(
            f"{PREFIX}_prewarm_replicas", "Resident prewarm replicas", ["model"], registry=r
        )
        self.unplaced = Gauge(
            f"{PREFIX}_unplaced_replicas", "Requested replicas not placed", ["model"], registry=r
        )
        self.hit_ratio = Gauge(
            f"{PREFIX}_prewarm_hit_ratio", "Prewarm hits / starts", ["model"], registry=r
        )
        self.gateway_held = Gauge(
            f"{PREFIX}_gateway_held",
            "Requests held at the gateways now (summed over replicas), part of the demand",
            ["model"],
            registry=r,
        )
        self.gateway_replicas = Gauge(
            f"{PREFIX}_gateway_replicas", "Gateway replicas read at the last poll", registry=r
        )
        self.agents_up = Gauge(
            f"{PREFIX}_agents_reachable", "Agents answering Describe", registry=r
        )
        self.plan_seconds = Histogram(
            f"{PREFIX}_plan_seconds",
            "Time to plan a window (policy core)",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.events_dropped = Counter(
            f"{PREFIX}_events_dropped_total",
            "Events not posted because a burst exceeded the Event budget",
            registry=r,
        )
        self.poll_seconds = Histogram(
            f"{PREFIX}_poll_seconds",
            "Time one poll of the loop takes, by phase",
            ["phase"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.activation_seconds = Histogram(
            f"{PREFIX}_activation_seconds",
            "Instance activation time reported by agents",
            ["start"],
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )

        # Every label set a dashboard rates over exists (at 0) from the start: a counter or
        # histogram series that appears with its first observation already counted hides that
        # observation from rate()/increase() (the dashboard test caught exactly that).
        for start in ("hit", "cold"):
            self.activation_seconds.labels(start)

    def model_seen(self, model: str) -> None:
        """Create a model's per-model series at 0 when the operator first serves it."""
        for start in ("hit", "cold"):
            self.starts.labels(model, start)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


class Phases:
    """Seconds each phase of one poll took: a metric always, a log line when a poll is slow."""

    SLOW_S = 2.0

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.t = time.perf_counter()
        self.spent: dict[str, float] = {}

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] = now - self.t
        self.metrics.poll_seconds.labels(phase).observe(now - self.t)
        self.t = now

    def log(self, deployments: int, **counts: int) -> None:
        total = sum(self.spent.values())
        if total >= self.SLOW_S:
            detail = " ".join(
                [f"{k}={v:.2f}" for k, v in self.spent.items()]
                + [f"{k}={v}" for k, v in counts.items()]
            )
            log.info("event=slow_poll seconds=%.2f deployments=%d %s", total, deployments, detail)
