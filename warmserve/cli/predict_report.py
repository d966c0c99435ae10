"""``warmserve predict``'s verdict and table: the default predictor against its goals.

Split from :mod:`warmserve.cli.predict` (which reads the trace into a :class:`WindowedTrace` and
runs the predictors); pure formatting and arithmetic over the per-predictor results of
:mod:`warmserve.policy.forecast_quality`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from warmserve.textfmt import columns

BASELINES = ("csp", "persistence")
GOAL_COVERAGE = 0.90
GOAL_OVER_FORECAST = 0.30
GOAL_VWE_RATIO = 0.85


@dataclass
class WindowedTrace:
    """Per-window actual load of the chosen series, and how to read it."""

    label: str
    unit: str
    window_s: float
    windows_per_day: int
    avg: list[float]
    peak: list[float]
    notes: list[str]


def default_summary(results: dict[str, dict[str, Any]], default: str) -> dict[str, Any] | None:
    """The default against its goals (needs ``csp`` and ``persistence`` in ``results``).

    Peak coverage >= 90 % with mean (volume-weighted) over-forecast <= 30 %, and average
    volume-weighted error <= 0.85x the better of CSP and persistence.
    """
    if default not in results or any(b not in results for b in BASELINES):
        return None
    best = min(BASELINES, key=lambda b: _nan_last(results[b]["avg_vw_error"]))
    base = results[best]["avg_vw_error"]
    own = results[default]
    ratio = own["avg_vw_error"] / base if base and math.isfinite(base) else float("nan")
    return {
        "predictor": default,
        "peak_coverage": own["peak_coverage"],
        "peak_over_forecast": own["peak_over_forecast"],
        "coverage_goal_met": bool(
            own["peak_coverage"] >= GOAL_COVERAGE
            and own["peak_over_forecast"] <= GOAL_OVER_FORECAST
        ),
        "best_baseline": best,
        "avg_vw_error_ratio": ratio,
        "vw_error_goal_met": bool(ratio <= GOAL_VWE_RATIO),
    }


def _nan_last(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    return obj


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.2f}%"


def print_table(
    trace: str,
    data: WindowedTrace,
    start: int,
    results: dict[str, dict[str, Any]],
    default: str,
    summary: dict[str, Any] | None,
) -> None:
    for note in data.notes:
        print(f"note: {note}")
    print(
        f"trace {trace}  series {data.label}  window {data.window_s:g} s  "
        f"({data.windows_per_day} per day)  load unit: {data.unit}"
    )
    print(f"evaluated windows {start + 1}..{len(data.avg)} of {len(data.avg)}")
    header = (
        "predictor", "avg MRE", "avg VWE", "peak MRE", "peak VWE", "peak cover", "peak over",
        "avg under", "windows",
    )
    rows = [
        (
            name + (" *" if name == default else ""),
            _pct(r["avg_rel_error"]),
            _pct(r["avg_vw_error"]),
            _pct(r["peak_rel_error"]),
            _pct(r["peak_vw_error"]),
            _pct(r["peak_coverage"]),
            _pct(r["peak_over_forecast"]),
            _pct(r["avg_under_rate"]),
            str(r["windows"]),
        )
        for name, r in results.items()
    ]
    print(columns([header, *rows], right=range(1, len(header))))
    for line in (
        "MRE: mean |predicted - actual| / actual over windows with actual > 0",
        "VWE: volume-weighted error, sum |predicted - actual| / sum actual",
        "peak cover: share of windows whose actual peak is at or below the predicted peak",
        "peak over: mean over-forecast of the peak, sum max(predicted - actual, 0) / sum actual",
        "avg under: share of windows whose average is predicted below actual;  * default",
        "peaks are scored as the placement receives them (raised to the predicted average)",
    ):
        print(line)
    if summary is not None:
        print(
            f"default {summary['predictor']}: peak coverage {_pct(summary['peak_coverage'])} "
            f"with over-forecast {_pct(summary['peak_over_forecast'])} "
            f"(goal >= 90% with <= 30%: {'met' if summary['coverage_goal_met'] else 'not met'}); "
            f"average VWE {summary['avg_vw_error_ratio']:.3f}x the better of csp and "
            f"persistence ({summary['best_baseline']}) "
            f"(goal <= 0.85x: {'met' if summary['vw_error_goal_met'] else 'not met'})"
        )


