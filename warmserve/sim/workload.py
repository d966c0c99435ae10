"""Workloads for the simulator from the bundled real traces (WarmServe §7.1).

The paper drives each model with requests sampled from a *different day* of the trace, scales the
per-model rates with a power law of exponent α (as MuxServe does) and takes input/output lengths
straight from the Azure 2023 traces.  We do the same with the data bundled in
``warmserve/data/traces``:

- **Arrival shape**: a per-minute count series (default: the Azure multimodal week).  Model ``i``
  reads day ``trace_day[i]`` starting at the scenario's time of day; its counts are scaled so the
  model's mean rate over the simulated period is ``share[i] * total_rps``.
- **Within a minute** (:class:`ArrivalTemplate`): minute ``j`` gets ``n ~ Poisson(scaled count)``
  arrivals, not uniform in the minute: they are the next ``n`` arrivals of a request-level trace
  (default: the Azure 2023 trace the lengths come from) after a uniformly random point of it, with
  the window up to the arrival after them stretched onto the minute. So the per-minute counts are
  the count series' while the gaps inside a minute keep the real trace's proportions: its clusters
  and lulls, i.e. its sub-second burstiness (per-second variance/mean 1.1-1.25 with conv, 23-35 with
  code at the paper testbed's rates; 1.0 for Poisson; docs/simulator.md). Nothing is added at the
  minute scale, where the count series already is real. ``poisson`` places them uniformly.
- **Shares**: ``share[i] ∝ (i + 1) ** -α`` in the scenario's model order (α = 2 gives the first
  model 70.2 % of the requests with four models, the figure §7.3 reports for Llama2-7B-0).
- **Lengths**: (input, output) pairs sampled jointly, with replacement, from a request-level trace
  (Azure conv or code 2023), so their correlation is kept.
- **History**: the days before the simulated period are generated with the same procedure and
  the same scale, so the predictor (§5.1) has a seasonal history from the first simulated window.

**Streaming**: requests are generated in chunks of ``CHUNK_S`` seconds on demand
(:class:`RequestStream`), each chunk from random streams keyed by (seed, model, chunk), so the
requests are the same whether a run pulls them chunk by chunk, a baseline reads one model's
whole period, or the history is drawn before the period: every system sees the same requests,
and no run holds more than a chunk of requests that have not arrived yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from warmserve.policy.cluster import PolicyInputError
from warmserve.traces import CountSeries, RequestTrace, load_trace

MINUTE_S = 60.0
DAY_S = 86400.0
MINUTES_PER_DAY = 1440


class WorkloadError(PolicyInputError):
    """A workload that cannot be built (missing trace, bad shape); one-line message."""


def read_minute_series(name: str, series_id: str | None = None) -> np.ndarray:
    """Per-minute request counts of one series (read by :mod:`warmserve.traces`)."""
    trace = load_trace(name)
    if not isinstance(trace, CountSeries) or trace.is_rate:
        raise WorkloadError(f"arrival trace {name} is not a request-count series")
    if trace.step_s != MINUTE_S:
        raise WorkloadError(f"arrival trace {name} has {trace.step_s:g} s steps; need 60 s")
    _, counts = trace.select(series_id)
    return np.asarray(counts, dtype=float)


def read_lengths(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(input, output) token counts of a request-level trace, requests with no tokens dropped."""
    trace = load_trace(name)
    if not isinstance(trace, RequestTrace):
        raise WorkloadError(f"length trace {name} is not a request-level trace")
    inp = np.asarray(trace.input_tokens, dtype=np.int64)
    out = np.asarray(trace.output_tokens, dtype=np.int64)
    keep = (inp > 0) & (out > 0)
    if not keep.any():
        raise WorkloadError(f"length trace {name} has no request with tokens")
    return inp[keep], out[keep]


def power_law_shares(n: int, alpha: float) -> np.ndarray:
    """share_i ∝ (i+1)^-α, normalised (MuxServe's and WarmServe's rate split)."""
    if n < 1:
        raise WorkloadError("need at least one model")
    if not np.isfinite(alpha) or alpha < 0:
        raise WorkloadError(f"alpha must be a finite number >= 0, got {alpha}")
    w = (np.arange(n, dtype=float) + 1.0) ** (-alpha)
    return w / w.sum()


def busiest_start_minute(counts: np.ndarray, days: list[int], duration_min: int) -> int:
    """Time of day (minute) where the summed counts of the models' days over the period peak.

    The paper evaluates a busy period; picking it from the data (not by hand) keeps the choice
    reproducible.  Periods that would run past the end of a day are allowed only if the trace
    continues (the next day's minutes are used).
    """
    total = np.zeros(MINUTES_PER_DAY)
    for d in days:
        lo = d * MINUTES_PER_DAY
        day = counts[lo : lo + MINUTES_PER_DAY + duration_min]
        for s in range(MINUTES_PER_DAY):
            if s + duration_min > day.size:
                total[s] = -np.inf
        csum = np.concatenate([[0.0], np.cumsum(day)])
        n = min(MINUTES_PER_DAY, day.size - duration_min + 1)
        if n <= 0:
            raise WorkloadError(f"trace day {d} has no room for a {duration_min}-minute period")
        total[:n] += csum[duration_min : duration_min + n] - csum[:n]
    return int(np.argmax(total))


@dataclass(frozen=True)
class Requests:
    """Requests sorted by arrival; parallel arrays (times relative to the period start)."""

    arrival: np.ndarray  # float64 seconds
    model: np.ndarray  # int32 model index
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.arrival.size)

    @staticmethod
    def concat(parts: list[Requests]) -> Requests:
        if not parts:
            z = np.zeros(0)
            return Requests(z, z.astype(np.int32), z.astype(np.int64), z.astype(np.int64))
        arr = np.concatenate([p.arrival for p in parts])
        order = np.argsort(arr, kind="stable")
        return Requests(
            arr[order],
            np.concatenate([p.model for p in parts])[order],
            np.concatenate([p.input_tokens for p in parts])[order],
            np.concatenate([p.output_tokens for p in parts])[order],
        )



CHUNK_S = 600.0  # requests are generated this many seconds at a time
POISSON = "poisson"


def _rng(seed: int, model: int, chunk: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, model, chunk + (1 << 40), stream])


@dataclass(frozen=True)
class ArrivalTemplate:
    """A unit-rate arrival process taken from a request-level trace (module docstring).

    ``points``: the trace's arrivals in units of its mean gap, from 0, sorted; ``period``: the
    length they span plus one mean gap (the wrap-around gap when a block runs past the end).
    """

    name: str
    points: np.ndarray
    period: float

    @classmethod
    def from_trace(cls, name: str) -> ArrivalTemplate:
        trace = load_trace(name)
        if not isinstance(trace, RequestTrace):
            raise WorkloadError(f"arrival template {name} is not a request-level trace")
        a = np.sort(np.asarray(trace.arrival_s, dtype=float))
        if a.size < 100 or a[-1] <= a[0]:
            raise WorkloadError(
                f"arrival template {name} needs at least 100 arrivals over a positive span"
            )
        gap = (a[-1] - a[0]) / (a.size - 1)
        pts = (a - a[0]) / gap
        return cls(name, pts, float(pts[-1] + 1.0))

    def within_minutes(
        self, minutes: np.ndarray, counts: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """Arrival times (in minutes) placing ``counts[j]`` arrivals in minute ``minutes[j]``
        with the template's inter-arrival structure: from a uniformly random point of the
        template, the next ``counts[j]`` arrivals, the window up to the one after them
        stretched onto the minute (random phase at the start, gaps in their real proportions)."""
        pts, per, size = self.points, self.period, self.points.size
        starts = rng.random(minutes.size) * per
        nz = np.flatnonzero(counts)
        if not nz.size:
            return np.zeros(0)
        # every minute's block at once (the same elementwise arithmetic as one block at a time)
        k = counts[nz].astype(np.int64)
        u0 = starts[nz]
        a = np.searchsorted(pts, u0, "right")
        owner = np.repeat(np.arange(nz.size), k + 1)  # block of each index, k + 1 per block
        begin = np.cumsum(k + 1) - (k + 1)
        idx = a[owner] + (np.arange(owner.size) - begin[owner])
        u = pts[idx % size] + (idx // size) * per
        last = begin + k  # the arrival after each block's k
        frac = np.minimum((u - u0[owner]) / (u[last] - u0)[owner], 1.0 - 1e-9)
        inner = np.ones(owner.size, dtype=bool)
        inner[last] = False
        return (minutes[nz][owner] + frac)[inner]


@dataclass(frozen=True)
class ModelShape:
    """One model's expected arrivals per minute, history then period, contiguous.

    ``rates[j]`` is minute ``j - history_min`` of the period (negative: history).
    """

    rates: np.ndarray
    history_min: int

    @property
    def rate_per_minute(self) -> np.ndarray:
        """Expected arrivals per minute of the simulated period."""
        return self.rates[self.history_min :]

    @property
    def history_rate_per_minute(self) -> np.ndarray:
        return self.rates[: self.history_min]


def model_shapes(
    counts: np.ndarray,
    days: list[int],
    start_minute: int,
    duration_min: int,
    shares: np.ndarray,
    total_rps: float,
    history_days: int,
) -> list[ModelShape]:
    """Scale each model's day slice to ``share * total_rps`` and prepend its history (as much of
    ``history_days`` as the trace has before it)."""
    if total_rps < 0 or not np.isfinite(total_rps):
        raise WorkloadError(f"total_rps must be a finite number >= 0, got {total_rps}")
    out = []
    for day, share in zip(days, shares, strict=True):
        lo = day * MINUTES_PER_DAY + start_minute
        period = counts[lo : lo + duration_min]
        if period.size < duration_min:
            raise WorkloadError(f"trace day {day} ends before the simulated period does")
        mean = float(period.mean())
        if mean <= 0:
            raise WorkloadError(f"trace day {day} has no requests in the simulated period")
        scale = share * total_rps * MINUTE_S / mean
        hist_lo = max(0, lo - history_days * MINUTES_PER_DAY)
        rates = counts[hist_lo : lo + duration_min] * scale
        out.append(ModelShape(np.asarray(rates, dtype=float), lo - hist_lo))
    return out


def dispersion(
    arrivals: np.ndarray, window_s: float = 1.0, baseline_s: float | None = 60.0
) -> float:
    """Variance / mean of arrival counts per ``window_s`` window: 1 for a Poisson process (the
    issue's burstiness measure; the Azure 2023 hours give 1.38 for conv and 13.2 for code per
    second, raw).  With ``baseline_s``, the variance is taken around each ``baseline_s``
    window's own mean, so slow rate changes (the per-minute shape) do not count as burstiness;
    ``None``: raw, around the overall mean."""
    a = np.asarray(arrivals, dtype=float)
    if a.size < 2:
        return float("nan")
    c = np.bincount(((a - a.min()) / window_s).astype(np.int64)).astype(float)
    if baseline_s is None:
        return float(c.var() / c.mean())
    per = max(1, round(baseline_s / window_s))
    n = c.size // per * per
    if n == 0:
        return float("nan")
    blocks = c[:n].reshape(-1, per)
    resid = blocks - blocks.mean(axis=1, keepdims=True)
    return float((resid**2).sum() / (per - 1) / blocks.shape[0] / c[:n].mean())


def sample_lengths(
    rng: np.random.Generator, lengths: tuple[np.ndarray, np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray]:
    idx = rng.integers(0, lengths[0].size, size=n)
    return lengths[0][idx], lengths[1][idx]


class RequestStream:
    """The requests of a run, generated on demand (module docstring).

    Chunk ``c`` covers ``[c·CHUNK_S, (c+1)·CHUNK_S)`` seconds from the period start (negative
    ``c``: history).  A model's arrivals in a chunk depend only on (seed, model, the template
    blocks or the chunk), its lengths on (seed, model, chunk), so any way of slicing time gives
    the same requests.
    """

    def __init__(
        self,
        seed: int,
        shapes: list[ModelShape],
        lengths: tuple[np.ndarray, np.ndarray],
        template: ArrivalTemplate | None,
        duration_s: float,
        chunk_s: float = CHUNK_S,
    ) -> None:
        self.seed = seed
        self.shapes = shapes
        self.lengths = lengths
        self.template = template
        self.duration_s = duration_s
        self.chunk_s = chunk_s

    # -- one model ------------------------------------------------------------------------

    def _arrivals(self, m: int, c: int) -> np.ndarray:
        """Model ``m``'s arrivals in chunk ``c``, sorted."""
        shape = self.shapes[m]
        t0, t1 = c * self.chunk_s, (c + 1) * self.chunk_s
        first = int(np.floor(t0 / MINUTE_S))
        minutes = np.arange(first, int(np.ceil(t1 / MINUTE_S)))
        idx = minutes + shape.history_min
        ok = (idx >= 0) & (idx < shape.rates.size)
        rate = np.zeros(minutes.size)
        rate[ok] = shape.rates[idx[ok]]
        rng = _rng(self.seed, m, c, 2)
        n = rng.poisson(np.maximum(rate, 0.0))
        if self.template is None:
            t = (np.repeat(minutes, n) + rng.random(int(n.sum()))) * MINUTE_S
        else:
            t = self.template.within_minutes(minutes, n, rng) * MINUTE_S
        return np.sort(t[(t >= t0) & (t < t1)])

    def model_chunk(self, m: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival, input tokens, output tokens) of model ``m`` in chunk ``c``."""
        t = self._arrivals(m, c)
        inp, out = sample_lengths(_rng(self.seed, m, c, 1), self.lengths, t.size)
        return t, inp, out

    def model_requests(
        self, m: int, t0: float, t1: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Model ``m``'s requests arriving in ``[t0, t1)`` (whole chunks are generated)."""
        parts = [
            self.model_chunk(m, c)
            for c in range(int(np.floor(t0 / self.chunk_s)), int(np.ceil(t1 / self.chunk_s)))
        ]
        if not parts:
            z = np.zeros(0)
            return z, z.astype(np.int64), z.astype(np.int64)
        t, inp, out = (np.concatenate(x) for x in zip(*parts, strict=True))
        keep = (t >= t0) & (t < t1)
        return t[keep], inp[keep], out[keep]

    # -- the period, all models -----------------------------------------------------------

    def chunk(self, c: int) -> Requests:
        """Every model's requests of period chunk ``c``, sorted by arrival (stable by model)."""
        parts = []
        for m in range(len(self.shapes)):
            t, inp, out = self.model_chunk(m, c)
            keep = t < self.duration_s
            parts.append(
                Requests(t[keep], np.full(int(keep.sum()), m, dtype=np.int32), inp[keep], out[keep])
            )
        return Requests.concat(parts)

    def chunks(self) -> Iterator[Requests]:
        """The period's requests, chunk by chunk, in time order."""
        for c in range(int(np.ceil(self.duration_s / self.chunk_s))):
            yield self.chunk(c)

    def materialize(self) -> Requests:
        """All of the period's requests at once (small runs, tests, plots)."""
        return Requests.concat(list(self.chunks()))
