"""Prometheus metrics of the node agent, read from the core at scrape time.

A custom collector (rather than gauges updated at every change) keeps the numbers consistent with
the state the agent reports over gRPC: worker states, slot bytes and layers, page pool usage,
load bandwidth, activation latency (histogram, split by prewarm hit) and its stages (histogram by
stage and kind of start), worker restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from warmserve.policy.cluster import WorkerState
from warmserve_agent.fencing import Fence
from warmserve_agent.node import NodeCore

ACTIVATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AgentCollector(Collector):
    def __init__(
        self,
        core: NodeCore,
        restarts: Callable[[int], int] = lambda g: 0,
        fence: Fence | None = None,
    ) -> None:
        self.core = core
        self.restarts = restarts
        self.fence = fence if fence is not None else Fence()

    def collect(self) -> Iterator[object]:
        core = self.core
        node = core.node_name
        ws = GaugeMetricFamily(
            "warmserve_agent_worker_state",
            "1 for the state each GPU worker is in (Figure 5)",
            labels=["node", "gpu", "state"],
        )
        pages = GaugeMetricFamily(
            "warmserve_agent_gpu_pages", "Physical pages by use", labels=["node", "gpu", "use"]
        )
        restarts = CounterMetricFamily(
            "warmserve_agent_worker_restarts", "Worker processes replaced", labels=["node", "gpu"]
        )
        for g, rec in core.gpus.items():
            for s in WorkerState:
                ws.add_metric([node, str(g), s.value], 1.0 if rec.state == s else 0.0)
            free = core.mm.free_pages(g)
            pages.add_metric([node, str(g), "free"], free)
            pages.add_metric([node, str(g), "mapped"], core.mm.num_pages(g) - free)
            # of the mapped: given up, waiting for the background unmap (memory_deferred.py)
            pages.add_metric([node, str(g), "withdrawn"], core.mm.pending_pages(g))
            restarts.add_metric([node, str(g)], self.restarts(g))
        yield ws
        yield pages
        yield restarts
        sb = GaugeMetricFamily(
            "warmserve_agent_slot_bytes",
            "Resident weight bytes per GPU of each slot",
            labels=["node", "slot", "model", "state"],
        )
        sl = GaugeMetricFamily(
            "warmserve_agent_slot_layers",
            "Resident layers of each slot",
            labels=["node", "slot", "model"],
        )
        bw = GaugeMetricFamily(
            "warmserve_agent_load_bandwidth_bytes_per_second",
            "Host-to-slot copy bandwidth of each slot's load so far (whole group)",
            labels=["node", "slot", "model"],
        )
        for s in list(core.slots.values()):
            sb.add_metric([node, s.slot_id, s.model, s.state.value], s.resident_bytes)
            sl.add_metric([node, s.slot_id, s.model], s.layers_resident)
            bw.add_metric([node, s.slot_id, s.model], s.bandwidth)
        yield sb
        yield sl
        yield bw
        h = HistogramMetricFamily(
            "warmserve_agent_activation_seconds",
            "Activate latency until the endpoint answers",
            labels=["node", "prewarm_hit"],
        )
        for hit in (True, False):
            samples = [secs for ok, secs in core.activation_log if ok == hit]
            buckets = [
                (str(b), float(sum(1 for x in samples if x <= b))) for b in ACTIVATION_BUCKETS
            ]
            buckets.append(("+Inf", float(len(samples))))
            h.add_metric([node, str(hit).lower()], buckets, sum_value=sum(samples))
        yield h
        yield self._stages(node)
        yield from self._fencing(node)

    def _stages(self, node: str) -> object:
        """When each stage of the activations completed (activation_stages.py), by the kind of
        start: a prewarm hit with a prepared engine, a hit that built one, a cold start."""
        hist = self.core.activator.stage_histograms
        h = HistogramMetricFamily(
            "warmserve_agent_activation_stage_seconds",
            "Seconds from Activate until each activation stage completed",
            labels=["node", "stage", "start"],
        )
        for (stage, start), (counts, total) in sorted(hist.snapshot().items()):
            buckets = [(str(b), float(c)) for b, c in zip(hist.buckets, counts, strict=False)]
            buckets.append(("+Inf", float(counts[-1])))
            h.add_metric([node, stage.value, start.value], buckets, sum_value=total)
        return h

    def _fencing(self, node: str) -> Iterator[object]:
        fenced = CounterMetricFamily(
            "warmserve_agent_fenced_calls",
            "Calls refused for a stale fencing token (a deposed operator leader), none, or an "
            "implausible one (reason future/jump)",
            labels=["node", "method", "reason"],
        )
        for (method, reason), n in sorted(self.fence.refused.items()):
            fenced.add_metric([node, method, reason], n)
        yield fenced
        token = GaugeMetricFamily(
            "warmserve_agent_fencing_token",
            "The highest operator leadership term (fencing token) this agent has seen",
            labels=["node"],
        )
        token.add_metric([node], self.fence.highest)
        yield token
        resets = CounterMetricFamily(
            "warmserve_agent_fence_resets",
            "Fences an admin reset (warmserve agent reset-fence) while this agent ran",
            labels=["node"],
        )
        resets.add_metric([node], self.fence.resets)
        yield resets
