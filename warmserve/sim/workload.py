"""Workloads for the simulator from the bundled real traces (issue 3, WarmServe §7.1).

The paper drives each model with requests sampled from a *different day* of the trace, scales the
per-model rates with a power law of exponent α (as MuxServe does) and takes input/output lengths
straight from the Azure 2023 traces.  We do the same with the data bundled in
``warmserve/data/traces``:

- **Arrival shape**: a per-minute count series (default: the Azure multimodal week).  Model ``i``
  reads day ``trace_day[i]`` starting at the scenario's time of day; its counts are scaled so the
  model's mean rate over the simulated period is ``share[i] * total_rps``.  Within a minute,
  arrivals are Poisson: ``n ~ Poisson(scaled count)`` placed uniformly in the minute.
- **Shares**: ``share[i] ∝ (i + 1) ** -α`` in the scenario's model order (α = 2 gives the first
  model 70.2 % of the requests with four models, the figure §7.3 reports for Llama2-7B-0).
- **Lengths**: (input, output) pairs sampled jointly, with replacement, from a request-level trace
  (Azure conv or code 2023), so their correlation is kept.
- **History**: the days before the simulated period are generated with the same procedure and
  the same scale, so the predictor (§5.1) has a seasonal history from the first simulated window.

Everything is drawn from one ``numpy.random.Generator``, so a seed fixes the workload.
"""

from __future__ import annotations

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


def poisson_arrivals(
    rng: np.random.Generator, rate_per_minute: np.ndarray, t0: float = 0.0
) -> np.ndarray:
    """Poisson arrivals with a piecewise-constant rate per minute, sorted, starting at ``t0``."""
    n = rng.poisson(np.maximum(rate_per_minute, 0.0))
    minute = np.repeat(np.arange(rate_per_minute.size, dtype=float), n)
    t = t0 + (minute + rng.random(minute.size)) * MINUTE_S
    return np.sort(t)


@dataclass(frozen=True)
class ModelWorkload:
    """One model's simulated period and history, already scaled."""

    rate_per_minute: np.ndarray  # expected arrivals per minute in the simulated period
    history_rate_per_minute: np.ndarray  # the same for the history days, contiguous, oldest first


def model_shapes(
    counts: np.ndarray,
    days: list[int],
    start_minute: int,
    duration_min: int,
    shares: np.ndarray,
    total_rps: float,
    history_days: int,
) -> list[ModelWorkload]:
    """Scale each model's day slice to ``share * total_rps`` and cut its history before it."""
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
        out.append(ModelWorkload(period * scale, counts[hist_lo:lo] * scale))
    return out


def sample_lengths(
    rng: np.random.Generator, lengths: tuple[np.ndarray, np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray]:
    idx = rng.integers(0, lengths[0].size, size=n)
    return lengths[0][idx], lengths[1][idx]


def generate(
    rng: np.random.Generator,
    shapes: list[ModelWorkload],
    lengths: tuple[np.ndarray, np.ndarray],
) -> Requests:
    """The simulated period's requests for all models (arrivals from 0)."""
    parts = []
    for i, shape in enumerate(shapes):
        t = poisson_arrivals(rng, shape.rate_per_minute)
        inp, out = sample_lengths(rng, lengths, t.size)
        parts.append(Requests(t, np.full(t.size, i, dtype=np.int32), inp, out))
    return Requests.concat(parts)


def generate_history(
    rng: np.random.Generator,
    shape: ModelWorkload,
    lengths: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One model's history requests, arrivals negative (ending at 0, the period start)."""
    rate = shape.history_rate_per_minute
    t = poisson_arrivals(rng, rate, t0=-rate.size * MINUTE_S)
    inp, out = sample_lengths(rng, lengths, t.size)
    return t, inp, out
