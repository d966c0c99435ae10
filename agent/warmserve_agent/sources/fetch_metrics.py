"""Prometheus metrics of the model fetcher and the store (collected at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from warmserve_agent.sources.fetch_records import FetchState
from warmserve_agent.sources.fetcher import ModelFetcher


class FetchCollector(Collector):
    def __init__(self, fetcher: ModelFetcher, node: str) -> None:
        self.fetcher = fetcher
        self.node = node

    def collect(self) -> Iterator[object]:
        f, node = self.fetcher, self.node
        stats = dict(f.stats)
        downloaded = CounterMetricFamily(
            "warmserve_agent_fetch_bytes",
            "Bytes downloaded from model sources (checked or not)",
            labels=["node"],
        )
        downloaded.add_metric([node], stats.get("bytes", 0))
        yield downloaded
        fetches = CounterMetricFamily(
            "warmserve_agent_fetches", "Model fetches finished", labels=["node", "result"]
        )
        for result in ("ok", "failed"):
            fetches.add_metric([node, result], stats.get(result, 0))
        yield fetches
        retries = CounterMetricFamily(
            "warmserve_agent_fetch_retries",
            "Files fetched again: checksum or size mismatch, or a transient error",
            labels=["node", "reason"],
        )
        for reason in ("checksum", "size", "error"):
            retries.add_metric([node, reason], stats.get(f"retries:{reason}", 0))
        yield retries
        progress = GaugeMetricFamily(
            "warmserve_agent_fetch_progress_bytes",
            "Bytes of each model fetch in progress (done and total)",
            labels=["node", "model", "of"],
        )
        eta = GaugeMetricFamily(
            "warmserve_agent_fetch_eta_seconds",
            "Estimated seconds until each fetch in progress finishes",
            labels=["node", "model"],
        )
        for st in f.statuses():
            if st.state in (FetchState.DONE, FetchState.FAILED):
                continue
            progress.add_metric([node, st.model, "done"], st.bytes_done)
            progress.add_metric([node, st.model, "total"], st.bytes_total)
            eta.add_metric([node, st.model], st.eta_s)
        yield progress
        yield eta
        usage = f.usage()
        store = GaugeMetricFamily(
            "warmserve_agent_store_bytes",
            "Weight store bytes (used, budget)",
            labels=["node", "kind"],
        )
        store.add_metric([node, "used"], usage.used_bytes)
        store.add_metric([node, "budget"], usage.budget_bytes)
        yield store
        ev = CounterMetricFamily(
            "warmserve_agent_store_evictions", "Cold models evicted from the store", labels=["node"]
        )
        ev.add_metric([node], usage.evictions)
        yield ev
