"""The ``warmserve predict --plot`` figure: actual load first, then one panel per predictor.

Top: the whole trace, actual average (black) over the band up to the actual peak (grey), the
history windows (not evaluated) shaded, and the zoomed day marked.  Below: one panel per
predictor over that day, each with the actual load drawn the same way and only that predictor's
forecasts on top: average (blue), peak (red, dashed), and a red mark on each window whose actual
peak went above the predicted peak (a burst the burst replicas would not have covered).  Six
forecasts over seven days in one axis hid the actual load; one predictor per panel
over one day keeps every line readable.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from warmserve.cli import CliError


def zoom_range(n: int, windows_per_day: int, start: int, day: int | None) -> tuple[int, int]:
    """Window indices ``[lo, hi)`` the per-predictor panels show.

    Windows shorter than a day: one day of the trace (``day``, 1-based; default the last full
    day).  Day-long windows or traces shorter than two days: every evaluated window.
    """
    full_days = n // windows_per_day
    if windows_per_day == 1 or full_days < 2:
        if day is not None:
            raise CliError(
                "--plot-day needs windows shorter than a day and at least two days of trace"
            )
        return start, n
    first = start // windows_per_day + 1  # the first day with predictions
    if day is None:
        day = full_days
    if not first <= day <= full_days:
        raise CliError(
            f"--plot-day must be between {first} and {full_days} (day 1 is history only)"
            if first > 1
            else f"--plot-day must be between 1 and {full_days}"
        )
    lo = max((day - 1) * windows_per_day, start)
    return lo, day * windows_per_day


def plot(
    path: str,
    data: Any,
    start: int,
    predictions: dict[str, tuple[np.ndarray, np.ndarray]],
    results: dict[str, dict[str, Any]],
    default: str,
    day: int | None,
) -> None:
    """Write the figure to ``path`` (PNG).

    ``data`` is a :class:`~warmserve.cli.predict_report.WindowedTrace`; ``predictions[name]`` the
    average and peak forecasts per window; ``results[name]`` that predictor's metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    avg = np.asarray(data.avg, dtype=float)
    peak = np.asarray(data.peak, dtype=float)
    n = avg.size
    lo, hi = zoom_range(n, data.windows_per_day, start, day)
    span_days = n * data.window_s / 86400.0
    scale, unit = (86400.0, "days") if span_days > 3 else (3600.0, "hours")
    x = np.arange(n) * data.window_s / scale

    names = list(predictions)
    cols = 1 if len(names) == 1 else 2
    rows = math.ceil(len(names) / cols)
    fig = plt.figure(figsize=(14, 3.4 + 2.7 * rows))
    grid = GridSpec(1 + rows, cols, figure=fig, height_ratios=[1.25] + [1.0] * rows)

    top = fig.add_subplot(grid[0, :])
    top.fill_between(x, avg, peak, color="0.8", lw=0, label="actual peak (band top)")
    top.plot(x, avg, color="black", lw=0.9, label="actual average")
    if start > 0:
        top.axvspan(x[0], x[start], color="0.93", zorder=0, label="history (not evaluated)")
    zoom_end = x[hi - 1] + data.window_s / scale
    top.axvspan(x[lo], zoom_end, color="tab:orange", alpha=0.18, lw=0, label="panels below")
    top.set_xlim(x[0], x[-1] + data.window_s / scale)
    top.set_ylim(bottom=0)
    top.set_ylabel(data.unit)
    top.set_xlabel(f"{unit} since trace start")
    top.set_title(f"{data.label}: actual load, window {data.window_s:g} s", fontsize=11)
    top.legend(loc="upper left", fontsize=8, ncol=4)

    zx, zunit = _zoom_axis(lo, hi, data.window_s)
    ymax = max(float(peak[lo:hi].max(initial=0.0)), 1e-9)
    for i, name in enumerate(names):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols])
        pa, pp = predictions[name]
        ax.fill_between(zx, avg[lo:hi], peak[lo:hi], color="0.82", lw=0, step="post")
        ax.step(zx, peak[lo:hi], where="post", color="0.55", lw=0.6, label="actual peak")
        ax.step(zx, avg[lo:hi], where="post", color="black", lw=1.5, label="actual average")
        ax.step(zx, pa[lo:hi], where="post", color="tab:blue", lw=1.0, label="predicted average")
        ax.step(
            zx, pp[lo:hi], where="post", color="tab:red", lw=1.0, ls="--",
            label="predicted peak",
        )
        miss = peak[lo:hi] > pp[lo:hi]
        width = zx[1] - zx[0] if zx.size > 1 else 1.0
        ax.plot(zx[miss] + width / 2, peak[lo:hi][miss], "v", color="tab:red", ms=3.5,
                label="peak above predicted")
        r = results[name]
        ax.set_title(
            f"{name}{' (default)' if name == default else ''}: avg VWE "
            f"{_pct(r['avg_vw_error'])}, peak cover {_pct(r['peak_coverage'])}, "
            f"over {_pct(r['peak_over_forecast'])}",
            fontsize=9,
        )
        ax.set_xlim(zx[0], zx[-1] + width)
        # a predictor's blunder may leave the frame; the actual load always fits
        ax.set_ylim(0, ymax * 1.6)
        ax.tick_params(labelsize=8)
        if i % cols == 0:
            ax.set_ylabel(data.unit, fontsize=8)
        if i // cols == rows - 1 or i + cols >= len(names):
            ax.set_xlabel(zunit, fontsize=8)
        if i == 0:
            ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=90)
    except OSError as exc:
        raise CliError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _zoom_axis(lo: int, hi: int, window_s: float) -> tuple[np.ndarray, str]:
    """x values for windows ``lo..hi-1``: hour of that day, or days for long spans."""
    span = (hi - lo) * window_s
    idx = np.arange(lo, hi)
    if window_s >= 86400 or span > 3 * 86400:
        return idx * window_s / 86400.0, "days since trace start"
    day = math.floor(lo * window_s / 86400.0)
    if span <= 86400 and (hi * window_s) <= (day + 1) * 86400 + 1e-9:
        return idx * window_s / 3600.0 - 24 * day, f"hour of day {day + 1} (since trace start)"
    return idx * window_s / 3600.0, "hours since trace start"


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.1f}%"
