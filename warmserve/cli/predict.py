"""``warmserve predict``: how well each load predictor would have done on a trace (§5.1, §7.4).

For every window from the second day on, each predictor sees only the windows before it and
predicts the window's average and peak load; we report the mean relative error (windows whose
actual load is 0 left out), the under-prediction rate (under-prediction is what costs cold
starts) and the number of windows evaluated.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from warmserve.cli import CliError

DEFAULT_WINDOW_S = 300.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "predict",
        help="evaluate load predictors over a trace",
        description=(
            "Evaluate load predictors over a trace: each window's average and peak load is "
            "predicted from the windows before it only, from the first window with a full day "
            "of history on.  TRACE is a path (.csv or .csv.gz) or the file name of a bundled "
            "trace (e.g. azure_lmm_2025_multimodal_1week_per_minute.csv.gz).  Request-level "
            "traces give load in requests in flight; count series in requests (or tokens) per "
            "second.  See docs/prediction.md."
        ),
    )
    parser.add_argument("trace", metavar="TRACE", help="trace path or bundled trace file name")
    parser.add_argument(
        "--series",
        metavar="ID",
        help="model_or_function_id to evaluate in a count series (default: sum over all ids)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help="window length W (default 300); a multiple of a count series' step; must divide a "
        "day or be whole days",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=None,
        metavar="TOK_S",
        help="prefill tokens/s per request for request-level traces (default 5000)",
    )
    parser.add_argument(
        "--decode-rate",
        type=float,
        default=None,
        metavar="TOK_S",
        help="decode tokens/s per request for request-level traces (default 30)",
    )
    parser.add_argument(
        "--predictor", metavar="NAME", help="predictor to evaluate (default: warm)"
    )
    parser.add_argument("--compare", action="store_true", help="evaluate every predictor")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="save actual vs predicted load over time"
    )
    parser.set_defaults(func=run)


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


def windowed(args: argparse.Namespace) -> WindowedTrace:
    """Read the trace and turn it into per-window average and peak load."""
    from warmserve.policy.load import (
        DEFAULT_DECODE_TOK_S,
        DEFAULT_PREFILL_TOK_S,
        inflight_load,
        request_durations,
        series_load,
    )
    from warmserve.policy.predictor import season_length
    from warmserve.traces import CountSeries, load_trace

    window = float(args.window)
    if not math.isfinite(window) or window <= 0:
        raise CliError(f"--window must be a positive number of seconds (got {args.window})")
    per_day = season_length(window)
    for flag, rate in (("--prefill-rate", args.prefill_rate), ("--decode-rate", args.decode_rate)):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise CliError(f"{flag} must be a positive number of tokens/s (got {rate:g})")
    trace = load_trace(args.trace)
    notes: list[str] = []
    if isinstance(trace, CountSeries):
        if args.prefill_rate is not None or args.decode_rate is not None:
            notes.append("--prefill-rate/--decode-rate ignored: count series carry no token sizes")
        label, values = trace.select(args.series)
        if args.series is None and len(trace.ids) > 1:
            notes.append(f"no --series given: evaluating the {label}")
        loads = series_load(
            values, trace.step_s, window, start_s=trace.start_s, values_are_rates=trace.is_rate
        )
        unit = "tokens/s" if trace.is_rate else "requests/s"
    else:
        if args.series is not None:
            raise CliError(
                f"--series {args.series!r}: {trace.name} is a request-level trace "
                "with no series ids"
            )
        if trace.duration_s is not None:
            durations = trace.duration_s
            if args.prefill_rate is not None or args.decode_rate is not None:
                notes.append(
                    "--prefill-rate/--decode-rate ignored: the trace carries measured exec_time_s"
                )
        else:
            durations = request_durations(
                trace.input_tokens,
                trace.output_tokens,
                DEFAULT_PREFILL_TOK_S if args.prefill_rate is None else args.prefill_rate,
                DEFAULT_DECODE_TOK_S if args.decode_rate is None else args.decode_rate,
            )
        start = float(trace.arrival_s[0])
        full = int(trace.span_s // window)
        if full < 1:
            raise CliError(
                f"{trace.name} spans {trace.span_s:.0f} s, shorter than one --window ({window:g} s)"
            )
        loads = inflight_load(
            trace.arrival_s, durations, window, start_s=start, end_s=start + full * window
        )
        label, unit = "all requests", "requests in flight"
    return WindowedTrace(
        label=label,
        unit=unit,
        window_s=window,
        windows_per_day=per_day,
        avg=[x.avg for x in loads],
        peak=[x.peak for x in loads],
        notes=notes,
    )


def evaluation_start(data: WindowedTrace, lookback: int) -> tuple[int, str | None]:
    """First window evaluated: one full day of history; else after ``lookback`` windows."""
    n = len(data.avg)
    if n > data.windows_per_day:
        return data.windows_per_day, None
    start = min(lookback, n - 1)
    if start < 1:
        raise CliError(f"only {n} window(s) of {data.window_s:g} s: nothing to evaluate")
    span = n * data.window_s
    return start, (
        f"trace spans {span:.0f} s, shorter than a day plus a window: no seasonal history, "
        f"evaluating from window {start + 1} with the recent-window (no-history) fallback"
    )


def run(args: argparse.Namespace) -> int:
    from warmserve.policy.predictor import (
        DEFAULT_LOOKBACK,
        DEFAULT_PREDICTOR,
        PREDICTORS,
        evaluate,
        make_predictor,
    )

    names = list(PREDICTORS) if args.compare else [args.predictor or DEFAULT_PREDICTOR]
    predictors = [make_predictor(n) for n in names]  # unknown names fail before any work
    data = windowed(args)
    start, note = evaluation_start(data, DEFAULT_LOOKBACK)
    if note:
        data.notes.append(note)
    results: dict[str, dict[str, Any]] = {}
    predictions: dict[str, tuple[Any, Any]] = {}
    for name, pred in zip(names, predictors, strict=True):
        ev_avg = evaluate(pred, data.avg, data.windows_per_day, start)
        ev_peak = evaluate(pred, data.peak, data.windows_per_day, start)
        results[name] = {
            "avg_rel_error": ev_avg.rel_error,
            "peak_rel_error": ev_peak.rel_error,
            "avg_under_rate": ev_avg.under_rate,
            "peak_under_rate": ev_peak.under_rate,
            "windows": ev_avg.windows,
        }
        predictions[name] = (ev_avg.predictions, ev_peak.predictions)
    if args.plot:
        _plot(args.plot, data, start, predictions)
    if args.json:
        print(json.dumps(_json_safe({
            "series": data.label,
            "window_s": data.window_s,
            "predictors": results,
            "default": DEFAULT_PREDICTOR,
        })))
    else:
        _print_table(args.trace, data, start, results, DEFAULT_PREDICTOR)
    return 0


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    return obj


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.2f}%"


def _print_table(
    trace: str, data: WindowedTrace, start: int, results: dict[str, dict[str, Any]], default: str
) -> None:
    for note in data.notes:
        print(f"note: {note}")
    print(
        f"trace {trace}  series {data.label}  window {data.window_s:g} s  "
        f"({data.windows_per_day} per day)  load unit: {data.unit}"
    )
    print(f"evaluated windows {start + 1}..{len(data.avg)} of {len(data.avg)}")
    header = ("predictor", "avg rel err", "peak rel err", "avg under", "peak under", "windows")
    rows = [
        (
            name + (" *" if name == default else ""),
            _pct(r["avg_rel_error"]),
            _pct(r["peak_rel_error"]),
            _pct(r["avg_under_rate"]),
            _pct(r["peak_under_rate"]),
            str(r["windows"]),
        )
        for name, r in results.items()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(row, widths, strict=True))))
    print("rel err: mean |predicted - actual| / actual (windows with actual 0 excluded); "
          "under: share of windows predicted below actual; * default")


def _plot(path: str, data: WindowedTrace, start: int, predictions: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    span_days = len(data.avg) * data.window_s / 86400.0
    scale, unit = (86400.0, "days") if span_days > 3 else (3600.0, "hours")
    hours = np.arange(len(data.avg)) * data.window_s / scale
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for ax, actual, idx, title in (
        (axes[0], data.avg, 0, "average"),
        (axes[1], data.peak, 1, "peak"),
    ):
        ax.plot(hours, actual, color="black", lw=1.0, label="actual")
        for name, preds in predictions.items():
            ax.plot(hours[start:], preds[idx][start:], lw=0.8, alpha=0.8, label=name)
        ax.set_ylabel(f"{title} ({data.unit})")
        ax.legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel(f"{unit} since trace start")
    fig.suptitle(f"{data.label}: window {data.window_s:g} s")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise CliError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
