"""Numbers of one replay: per model and in total, from the requests' results and the sampled
statuses (shared by the live view, the summary table and the report)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .observe import GPU_STATES, ModelSample, NodeSample
from .replay import CANCELLED, CAPPED, DROPPED, OK, Result


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


@dataclass
class Row:
    """One model (or ``total``) of one run, over the measured period."""

    model: str
    sent: int = 0
    ok: int = 0
    capped: int = 0
    dropped: int = 0
    cancelled: int = 0
    ttft: list[float] = field(default_factory=list)
    hits: int = 0  # instances started on a prewarmed replica during the measured period
    cold: int = 0  # instances started cold

    @property
    def p50(self) -> float | None:
        return pct(self.ttft, 50)

    @property
    def p90(self) -> float | None:
        return pct(self.ttft, 90)

    @property
    def p99(self) -> float | None:
        return pct(self.ttft, 99)

    @property
    def hit_ratio(self) -> float | None:
        n = self.hits + self.cold
        return self.hits / n if n else None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "sent": self.sent,
            "ok": self.ok,
            "capped": self.capped,
            "dropped": self.dropped,
            "cancelled": self.cancelled,
            "ttft_p50_s": self.p50,
            "ttft_p90_s": self.p90,
            "ttft_p99_s": self.p99,
            "ttft_max_s": max(self.ttft) if self.ttft else None,
            "prewarm_hits": self.hits,
            "cold_starts": self.cold,
            "hit_ratio": self.hit_ratio,
        }


def rows(
    models: Sequence[str],
    results: Iterable[Result],
    samples: Sequence[ModelSample],
    *,
    measured_only: bool = True,
) -> list[Row]:
    """Per model rows plus a ``total`` row (last)."""
    by = {m: Row(m) for m in models}
    total = Row("total")
    for r in results:
        if measured_only and r.planned_s < 0:
            continue
        for row in (by.get(r.model), total):
            if row is None:
                continue
            row.sent += 1
            if r.outcome == OK:
                row.ok += 1
                if r.ttft_s is not None:
                    row.ttft.append(r.ttft_s)
            elif r.outcome == CAPPED:
                row.capped += 1
            elif r.outcome == DROPPED:
                row.dropped += 1
            elif r.outcome == CANCELLED:
                row.cancelled += 1
    for m in models:
        mine = [s for s in samples if s.model == m and (s.t >= 0 or not measured_only)]
        if mine:
            # The counters count since the deployment was created: subtract the warm-up's.
            base_hits, base_cold = (mine[0].hits, mine[0].misses) if measured_only else (0, 0)
            by[m].hits = mine[-1].hits - base_hits
            by[m].cold = mine[-1].misses - base_cold
            total.hits += by[m].hits
            total.cold += by[m].cold
    return [*by.values(), total]


def gpu_seconds(nodes: Sequence[NodeSample], interval_s: float = 1.0) -> dict[str, float]:
    """GPU-seconds spent in each worker state over the measured period."""
    out = dict.fromkeys(GPU_STATES, 0.0)
    for s in nodes:
        if s.t < 0:
            continue
        for k, v in s.counts().items():
            out[k] = out.get(k, 0.0) + v * interval_s
    return out


def fmt_s(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
