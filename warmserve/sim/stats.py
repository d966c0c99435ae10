"""Online latency statistics of a run: log-bucketed histograms and per-model counters.

Low in the simulator's layers (the event loop fills them; :mod:`warmserve.sim.result_rows` turns
them into result rows).  Definitions: :mod:`warmserve.sim.result_rows`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

LO_S = 1e-4  # smallest bucket edge (0.1 ms); anything below lands in bucket 0
DECADES = 10
PER_DECADE = 200
NBUCKETS = DECADES * PER_DECADE
_LOG_LO = math.log10(LO_S)


class LogHistogram:
    """Counts of positive values in log-spaced buckets, plus exact count, sum, min and max."""

    __slots__ = ("counts", "hi", "lo", "n", "total")

    def __init__(self) -> None:
        self.counts = [0] * NBUCKETS
        self.n = 0
        self.total = 0.0
        self.lo = math.inf
        self.hi = -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        if x < self.lo:
            self.lo = x
        if x > self.hi:
            self.hi = x
        i = int((math.log10(x) - _LOG_LO) * PER_DECADE) if x > LO_S else 0
        self.counts[i if i < NBUCKETS else NBUCKETS - 1] += 1

    def merge(self, other: LogHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.n += other.n
        self.total += other.total
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)

    @staticmethod
    def edge(i: int) -> float:
        return 10.0 ** (_LOG_LO + i / PER_DECADE)

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0..1), interpolated log-linearly inside its bucket and clipped to
        the exact min and max; ``None`` when empty."""
        if self.n == 0:
            return None
        target = q * (self.n - 1) + 1  # rank of numpy's 'linear' percentile, 1-based
        c = np.cumsum(self.counts)
        i = int(np.searchsorted(c, target, "left"))
        i = min(i, NBUCKETS - 1)
        before = c[i - 1] if i else 0
        inside = self.counts[i]
        frac = (target - before) / inside if inside else 0.5
        lo, hi = math.log10(self.edge(i)), math.log10(self.edge(i + 1))
        v = 10.0 ** (lo + frac * (hi - lo))
        return min(max(v, self.lo), self.hi)

    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def cdf(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket upper edges, cumulative share) over the non-empty range, for plots."""
        c = np.cumsum(self.counts)
        nz = np.flatnonzero(self.counts)
        if not nz.size:
            return np.zeros(0), np.zeros(0)
        idx = np.arange(nz[0], nz[-1] + 1)
        return np.array([self.edge(i + 1) for i in idx]), c[idx] / self.n


@dataclass
class ModelStats:
    """Online results of one model (see the module docstring for the definitions)."""

    ttft: LogHistogram = field(default_factory=LogHistogram)
    tpot: LogHistogram = field(default_factory=LogHistogram)
    requests: int = 0
    served: int = 0
    ttft_under_100ms: int = 0
    tpot_under_50ms: int = 0
    tpot_over_100ms: int = 0
    start_delayed: int = 0
    start_delay_s: float = 0.0
    queued: int = 0
    queue_wait_s: float = 0.0
    drops: Counter[str] = field(default_factory=Counter)

    def served_request(
        self, arrival: float, assigned: float, first: float, finish: float, out_tokens: int,
        start_delayed: bool,
    ) -> None:
        self.served += 1
        ttft = first - arrival
        self.ttft.add(ttft)
        if ttft < 0.1:
            self.ttft_under_100ms += 1
        if out_tokens > 1:
            tpot = (finish - first) / (out_tokens - 1)
            self.tpot.add(tpot)
            if tpot < 0.05:
                self.tpot_under_50ms += 1
            elif tpot > 0.1:
                self.tpot_over_100ms += 1
        wait = assigned - arrival
        if wait > 1e-9:
            self.queued += 1
            self.queue_wait_s += wait
        if start_delayed:
            self.start_delayed += 1
            self.start_delay_s += wait

    def merge(self, o: ModelStats) -> None:
        self.ttft.merge(o.ttft)
        self.tpot.merge(o.tpot)
        for k in ("requests", "served", "ttft_under_100ms", "tpot_under_50ms", "tpot_over_100ms",
                  "start_delayed", "start_delay_s", "queued", "queue_wait_s"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.drops.update(o.drops)


