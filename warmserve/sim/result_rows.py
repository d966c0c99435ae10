"""Per-system results: latency percentiles, starts, GPU-hours, served/dropped.

Metrics are collected **online** while the simulation runs: no per-request array is
kept unless a test asks for one.  Latencies go into fixed log-spaced histograms
(:class:`LogHistogram`, 200 buckets per decade from 0.1 ms to 10^6 s: a percentile read from it
is within half a bucket, 0.6 %, of the exact one; ``tests/sim/test_result_rows.py`` checks it
against ``numpy.percentile``), counts and sums are exact.

Definitions:

* **TTFT** = first token − arrival (queueing + start-up wait + prefill, §7.1); **TPOT** =
  (finish − first token) / (output tokens − 1), for requests with more than one output token.
  Both over *served* requests (finished; a request cut off mid-decode is dropped).
* **Delayed by a start**: a served request whose instance was not yet serving when the request
  arrived (it waited for that instance's start; static layouts never are).  Reported as a share
  of served requests with the mean of its wait (assignment − arrival).  **Queued**: any wait
  at all (assignment after arrival), whatever the reason.
* **Prewarm hit ratio**: warm starts over all starts made during the run (instances that exist
  when the run begins are not starts).
* **GPU-hours**: GPUs held by instances (starting, serving, grace) over the simulated period;
  GPUs that only hold prewarm replicas are reported separately (``prewarm_gpu_hours``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from warmserve.sim.model import SimOutput
from warmserve.sim.stats import LogHistogram, ModelStats

__all__ = ["LogHistogram", "ModelStats", "check_conservation", "latency_stats", "summarize"]

def _frac(num: int, den: int) -> float | None:
    return num / den if den else None


def latency_stats(s: ModelStats) -> dict[str, Any]:
    return {
        "ttft_p50_s": s.ttft.quantile(0.50),
        "ttft_p95_s": s.ttft.quantile(0.95),
        "ttft_p99_s": s.ttft.quantile(0.99),
        "ttft_p999_s": s.ttft.quantile(0.999),
        "ttft_mean_s": s.ttft.mean(),
        "ttft_max_s": s.ttft.hi if s.ttft.n else None,
        "tpot_p50_s": s.tpot.quantile(0.50),
        "tpot_p99_s": s.tpot.quantile(0.99),
        "tpot_mean_s": s.tpot.mean(),
        "ttft_under_100ms": _frac(s.ttft_under_100ms, s.served),
        "tpot_under_50ms": _frac(s.tpot_under_50ms, s.tpot.n),
        "tpot_over_100ms": _frac(s.tpot_over_100ms, s.tpot.n),
        "start_delayed_share": _frac(s.start_delayed, s.served),
        "start_delay_mean_s": s.start_delay_s / s.start_delayed if s.start_delayed else None,
        "queued_share": _frac(s.queued, s.served),
        "queue_wait_mean_s": s.queue_wait_s / s.queued if s.queued else None,
    }


def summarize(
    out: SimOutput, model_names: list[str], wall_s: float | None = None,
    cpu_s: float | None = None,
) -> dict[str, Any]:
    """One system's row (and per-model breakdown) as plain JSON-ready values."""
    stats: list[ModelStats] = out.stats  # type: ignore[assignment]
    extra = dict(out.extra)
    cpu_s = extra.pop("cpu_s", cpu_s)  # type: ignore[assignment]
    setup_cpu_s = extra.pop("setup_cpu_s", None)  # measured, not simulated: beside cpu_s
    total = ModelStats()
    for s in stats:
        total.merge(s)
    hits = sum(1 for s in out.starts if s.hit)
    drops = total.drops
    row: dict[str, Any] = {
        "system": out.system,
        **latency_stats(total),
        "hit_ratio": hits / len(out.starts) if out.starts else None,
        "warm_starts": hits,
        "cold_starts": len(out.starts) - hits,
        "start_latency_p50_s": (
            float(np.percentile([s.latency_s for s in out.starts], 50)) if out.starts else None
        ),
        "gpu_hours": out.gpu_seconds / 3600.0,
        "prewarm_gpu_hours": out.universal_gpu_seconds / 3600.0,
        "served": total.served,
        "dropped": int(sum(drops.values())),
        "drop_reasons": dict(sorted(drops.items())),
        "requests": total.requests,
        "start_failures": out.start_failures,
        "start_failure_kinds": out.failure_kinds,
        "plans": out.plans,
        "lent_placements": out.lent_placements,
        "lent_evictions": out.lent_evictions,
        "events": out.events,
        **extra,
    }
    if wall_s is not None:
        row["wall_s"] = wall_s
        row["sim_requests_per_wall_s"] = total.requests / wall_s if wall_s > 0 else math.inf
    if cpu_s is not None:
        row["cpu_s"] = cpu_s
        row["sim_requests_per_cpu_s"] = total.requests / cpu_s if cpu_s > 0 else math.inf
        if setup_cpu_s is not None:
            row["setup_cpu_s"] = setup_cpu_s
    per_model = {}
    for name, s in zip(model_names, stats, strict=True):
        starts = [x for x in out.starts if x.model == name]
        per_model[name] = {
            **latency_stats(s),
            "requests": s.requests,
            "served": s.served,
            "dropped": int(sum(s.drops.values())),
            "drop_reasons": dict(sorted(s.drops.items())),
            "warm_starts": sum(1 for x in starts if x.hit),
            "cold_starts": sum(1 for x in starts if not x.hit),
        }
    row["per_model"] = per_model
    return row


def check_conservation(row: dict[str, Any]) -> None:
    """Every request either completed or was dropped with a reason (raises if not)."""
    if row["served"] + row["dropped"] != row["requests"]:
        raise AssertionError(
            f"{row['system']}: served {row['served']} + dropped {row['dropped']} != "
            f"requests {row['requests']}"
        )
    for name, m in row.get("per_model", {}).items():
        if m["served"] + m["dropped"] != m["requests"]:
            raise AssertionError(f"{row['system']}/{name}: per-model conservation broken")
