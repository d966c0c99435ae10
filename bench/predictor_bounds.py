"""How far can a forecaster of these traces get?  In-sample bounds behind docs/prediction.md.

Issue 12 asks the default predictor for (a) an average volume-weighted error (VWE) <= 0.85x the
better of CSP and persistence and (b) peak coverage >= 90 % with a mean over-forecast <= 30 %,
on every multi-day bundled trace.  This script fits models *on the whole trace* (they see the
future: an optimistic bound, not a predictor) to show where those goals are out of reach for
any forecaster built from the per-window average and peak history:

1. VWE: least-absolute-deviation regression of the log-load change on 34 features (the last 12
   windows, the last 3 peaks, the same time 1-3 days back, time-of-day harmonics), fitted on all
   windows; reported as a ratio to persistence's VWE on the same windows.
2. Peak: quantile regression (q = 0.90) of the log peak on the last 6 averages and peaks, the
   peak a day back and time-of-day harmonics, fitted on all windows; its coverage and
   volume-weighted over-forecast ``sum max(p - a, 0) / sum a``.

Run: ``python bench/predictor_bounds.py [--json OUT.json]`` (about a minute on one core).
Prints one table; the numbers are deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np

TRACES = [
    ("azure_lmm 1 week", "azure_lmm_2025_multimodal_1week_per_minute.csv.gz", 300, None),
    ("servegen sum", "servegen_language_14d_10min_per_model.csv.gz", 600, None),
    ("servegen m-large", "servegen_language_14d_10min_per_model.csv.gz", 600, "language/m-large"),
    ("servegen m-mid", "servegen_language_14d_10min_per_model.csv.gz", 600, "language/m-mid"),
    ("servegen m-small", "servegen_language_14d_10min_per_model.csv.gz", 600, "language/m-small"),
    ("burstgpt tokens/s", "burstgpt1_week1_tokens_per_s_per_minute.csv.gz", 300, None),
    ("burstgpt daily 61 d", "burstgpt1_daily_61d.csv.gz", 86400, None),
]


def _lag(x: np.ndarray, idx: np.ndarray, lag: int) -> np.ndarray:
    return x[idx - lag]


def vwe_bound(avg: np.ndarray, peak: np.ndarray, p: int) -> tuple[float, float]:
    """(in-sample LAD VWE, persistence VWE) on the same windows."""
    from statsmodels.regression.quantile_regression import QuantReg

    floor = 0.01 * avg[avg > 0].mean()
    la, lp = np.log(np.maximum(avg, floor)), np.log(np.maximum(peak, floor))
    period = p if p > 1 else 7
    tt = np.arange(3 * period + 2, avg.size)
    last = _lag(la, tt, 1)
    cols = [np.ones(tt.size)]
    cols += [_lag(la, tt, k) - last for k in range(2, 13)]
    cols += [_lag(lp, tt, k) - last for k in (1, 2, 3)]
    for d in (1, 2, 3):
        cols += [_lag(la, tt, d * period - o) - _lag(la, tt, d * period + 1) for o in (-1, 0, 1, 2)]
    if p > 1:
        phase = 2 * np.pi * (tt % p) / p
        for f in (1, 2, 3):
            cols += [np.sin(f * phase), np.cos(f * phase)]
    x = np.column_stack(cols)
    fit = QuantReg(la[tt] - last, x).fit(q=0.5, max_iter=5000)
    pred = np.exp(last + x @ fit.params)
    actual = avg[tt]
    return (
        float(np.abs(pred - actual).sum() / actual.sum()),
        float(np.abs(avg[tt - 1] - actual).sum() / actual.sum()),
    )


def peak_bound(avg: np.ndarray, peak: np.ndarray, p: int, q: float = 0.9) -> tuple[float, float]:
    """(coverage, volume-weighted over-forecast) of an in-sample quantile regression."""
    from statsmodels.regression.quantile_regression import QuantReg

    floor = 0.01 * avg[avg > 0].mean()
    la, lp = np.log(np.maximum(avg, floor)), np.log(np.maximum(peak, floor))
    period = p if p > 1 else 7
    tt = np.arange(max(2 * period + 2, 14), avg.size)
    cols = [np.ones(tt.size)]
    for k in range(1, 7):
        cols += [_lag(la, tt, k), _lag(lp, tt, k)]
    cols += [_lag(lp, tt, period + o) for o in (-1, 0, 1)]
    if p > 1:
        phase = 2 * np.pi * (tt % p) / p
        for f in (1, 2):
            cols += [np.sin(f * phase), np.cos(f * phase)]
    x = np.column_stack(cols)
    pred = np.exp(QuantReg(lp[tt], x).fit(q=q, max_iter=5000).predict(x))
    actual = peak[tt]
    return (
        float(np.mean(actual <= pred)),
        float(np.maximum(pred - actual, 0).sum() / actual.sum()),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT.json", help="also write the rows as JSON")
    args = parser.parse_args()
    from warmserve.cli.predict import windowed

    rows = []
    print(
        f"{'trace':22s} {'LAD VWE':>8s} {'pers VWE':>8s} {'ratio':>6s}  "
        f"{'QR0.9 cover':>11s} {'QR0.9 over':>10s}"
    )
    for label, trace, window, series in TRACES:
        t0 = time.monotonic()
        data = windowed(
            argparse.Namespace(
                trace=trace, series=series, window=float(window), prefill_rate=None,
                decode_rate=None,
            )
        )
        avg, peak = np.asarray(data.avg), np.asarray(data.peak)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # statsmodels' iteration-limit notes
            lad, pers = vwe_bound(avg, peak, data.windows_per_day)
            cover, over = peak_bound(avg, peak, data.windows_per_day)
        rows.append(
            {"trace": label, "lad_vwe": lad, "persistence_vwe": pers, "ratio": lad / pers,
             "qr_coverage": cover, "qr_over_forecast": over}
        )
        print(
            f"{label:22s} {100 * lad:7.2f}% {100 * pers:7.2f}% {lad / pers:6.3f}  "
            f"{100 * cover:10.1f}% {100 * over:9.1f}%   ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
