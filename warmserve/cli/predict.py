"""``warmserve predict``: how well each load predictor would have done on a trace (§5.1, §7.4).

For every window from the second day on, each predictor sees only the windows before it and
predicts the window's average and peak load exactly as the operator would (the peak raised to
the average, :func:`~warmserve.policy.predictor.forecast`).  Reported per predictor
(:mod:`warmserve.policy.forecast_quality`): mean relative error and volume-weighted error of the
average and the peak, the peak's coverage (share of windows whose actual peak is at or below the
predicted one) and mean over-forecast, and the average's under-prediction rate.  Progress goes
to stderr (``--quiet`` silences it); results to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from warmserve.cli import CliError
from warmserve.cli.predict_report import WindowedTrace, default_summary, json_safe, print_table

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
        "--plot",
        metavar="FILE.png",
        help="save a plot: the whole trace, then one panel per predictor over one day",
    )
    parser.add_argument(
        "--plot-day",
        type=int,
        metavar="DAY",
        help="day of the trace (1 = first) the per-predictor panels show (default: the last "
        "full day)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr"
    )
    parser.set_defaults(func=run)


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


class Progress:
    """Progress lines on stderr (silent with ``--quiet``); stdout stays the result alone."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def say(self, message: str, end: str = "\n") -> None:
        if not self.quiet:
            print(f"predict: {message}", file=sys.stderr, end=end, flush=True)

    def step(self, label: str) -> float:
        """Announce a step, ended by :meth:`done` on the same line; returns its start time."""
        self.say(f"{label} ...", end="")
        return time.monotonic()

    def done(self, started: float) -> None:
        if not self.quiet:
            print(f" {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def _check_plot_path(path: str) -> None:
    """Fail before the work, not after it, when the plot cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"cannot write plot {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise CliError(f"cannot write plot {path}: directory {folder} is not writable")


def evaluate_predictor(
    name: str, data: WindowedTrace, start: int
) -> tuple[dict[str, Any], tuple[Any, Any]]:
    """Score one predictor on the trace's average and peak series (as the operator sees them)."""
    from warmserve.policy.predictor import evaluate, make_predictor

    pred = make_predictor(name)
    ev_avg = evaluate(pred, data.avg, data.windows_per_day, start)
    avg_all = ev_avg.predictions.copy()
    # forecast() raises the peak to the average: score what the placement would receive
    ev_peak = evaluate(
        pred, data.peak, data.windows_per_day, start, peak=True, floor=avg_all
    )
    assert ev_avg.quality is not None and ev_peak.quality is not None
    qa, qp = ev_avg.quality, ev_peak.quality
    stats = {
        "avg_rel_error": qa.mean_rel_error,
        "peak_rel_error": qp.mean_rel_error,
        "avg_vw_error": qa.volume_weighted_error,
        "peak_vw_error": qp.volume_weighted_error,
        "peak_coverage": qp.coverage,
        "peak_over_forecast": qp.over_forecast,
        "peak_over_forecast_rel": qp.over_forecast_rel,
        "avg_under_rate": qa.under_rate,
        "peak_under_rate": qp.under_rate,
        "windows": qa.windows,
        "avg": qa.as_dict(),
        "peak": qp.as_dict(),
    }
    return stats, (ev_avg.predictions, ev_peak.predictions)


def run(args: argparse.Namespace) -> int:
    from warmserve.policy.predictor import (
        DEFAULT_LOOKBACK,
        DEFAULT_PREDICTOR,
        PREDICTORS,
        make_predictor,
    )

    names = list(PREDICTORS) if args.compare else [args.predictor or DEFAULT_PREDICTOR]
    for n in names:
        make_predictor(n)  # unknown names fail before any work
    if args.plot:
        _check_plot_path(args.plot)
    elif args.plot_day is not None:
        raise CliError("--plot-day needs --plot")
    progress = Progress(args.quiet)
    started = time.monotonic()
    data = windowed(args)
    start, note = evaluation_start(data, DEFAULT_LOOKBACK)
    if note:
        data.notes.append(note)
    if args.plot:
        from warmserve.cli.predict_plot import zoom_range

        zoom_range(len(data.avg), data.windows_per_day, start, args.plot_day)
    progress.say(
        f"read {args.trace} in {time.monotonic() - started:.1f} s: {len(data.avg)} windows of "
        f"{data.window_s:g} s ({data.label}); evaluating {len(names)} predictor(s) on windows "
        f"{start + 1}..{len(data.avg)}"
    )
    results: dict[str, dict[str, Any]] = {}
    predictions: dict[str, tuple[Any, Any]] = {}
    for i, name in enumerate(names, start=1):
        started = progress.step(f"[{i}/{len(names)}] {name}")
        results[name], predictions[name] = evaluate_predictor(name, data, start)
        progress.done(started)
    if args.plot:
        from warmserve.cli.predict_plot import plot

        plot(args.plot, data, start, predictions, results, DEFAULT_PREDICTOR, args.plot_day)
        progress.say(f"plot written to {args.plot}")
    summary = default_summary(results, DEFAULT_PREDICTOR)
    if args.json:
        out: dict[str, Any] = {
            "series": data.label,
            "window_s": data.window_s,
            "predictors": results,
            "default": DEFAULT_PREDICTOR,
        }
        if summary is not None:
            out["default_summary"] = summary
        print(json.dumps(json_safe(out)))
    else:
        print_table(args.trace, data, start, results, DEFAULT_PREDICTOR, summary)
    return 0
