"""Per-system results: latency percentiles, starts, GPU-hours, served/dropped (issue 3 §4).

TTFT is first token minus arrival (queueing + start-up wait + prefill, §7.1's definition);
TPOT is (finish - first token) / (output tokens - 1) for requests with more than one output
token.  The prewarm hit ratio is warm starts over all starts made during the run (instances that
exist when the run begins are not starts).  GPU-hours count GPUs held by instances (starting,
serving or in grace); GPUs that only hold prewarm replicas are reported separately, since they
serve nobody and could be lent to batch work.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from warmserve.sim.model import SimOutput


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _frac(mask: np.ndarray) -> float | None:
    return float(mask.mean()) if mask.size else None


def latency_stats(ttft: np.ndarray, tpot: np.ndarray) -> dict[str, float | None]:
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "tpot_mean_s": float(tpot.mean()) if tpot.size else None,
    }


def summarize(
    out: SimOutput,
    arrival: np.ndarray,
    model_of: np.ndarray,
    output_tokens: np.ndarray,
    model_names: list[str],
    wall_s: float | None = None,
) -> dict[str, Any]:
    """One system's row (and per-model breakdown) as plain JSON-ready values."""
    served = ~np.isnan(out.finish)
    ttft_all = out.first_token - arrival
    multi = served & (output_tokens > 1)
    tpot_all = np.full(arrival.size, np.nan)
    tpot_all[multi] = (out.finish[multi] - out.first_token[multi]) / (output_tokens[multi] - 1)
    drops = Counter(d for d in out.drop if d is not None)
    hits = sum(1 for s in out.starts if s.hit)
    row: dict[str, Any] = {
        "system": out.system,
        **latency_stats(ttft_all[served], tpot_all[multi]),
        "ttft_under_100ms": _frac(ttft_all[served] < 0.1),
        "tpot_under_50ms": _frac(tpot_all[multi] < 0.05),
        "tpot_over_100ms": _frac(tpot_all[multi] > 0.1),
        "hit_ratio": hits / len(out.starts) if out.starts else None,
        "warm_starts": hits,
        "cold_starts": len(out.starts) - hits,
        "start_latency_p50_s": _pct(np.array([s.latency_s for s in out.starts]), 50),
        "gpu_hours": out.gpu_seconds / 3600.0,
        "prewarm_gpu_hours": out.universal_gpu_seconds / 3600.0,
        "served": int(served.sum()),
        "dropped": int(sum(drops.values())),
        "drop_reasons": dict(sorted(drops.items())),
        "requests": int(arrival.size),
        "start_failures": out.start_failures,
        "start_failure_kinds": out.failure_kinds,
        "plans": out.plans,
        "lent_placements": out.lent_placements,
        "lent_evictions": out.lent_evictions,
        "events": out.events,
    }
    if wall_s is not None:
        row["wall_s"] = wall_s
        row["sim_requests_per_wall_s"] = arrival.size / wall_s if wall_s > 0 else math.inf
    per_model = {}
    for i, name in enumerate(model_names):
        mine = model_of == i
        ms = mine & served
        mm = mine & multi
        starts = [s for s in out.starts if s.model == name]
        m_drops = Counter(out.drop[k] for k in np.flatnonzero(mine) if out.drop[k] is not None)
        per_model[name] = {
            **latency_stats(ttft_all[ms], tpot_all[mm]),
            "requests": int(mine.sum()),
            "served": int(ms.sum()),
            "dropped": int(sum(m_drops.values())),
            "drop_reasons": dict(sorted(m_drops.items())),
            "warm_starts": sum(1 for s in starts if s.hit),
            "cold_starts": sum(1 for s in starts if not s.hit),
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
