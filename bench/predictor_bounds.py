"""How far can a forecaster of these traces get?  The bounds behind docs/prediction.md.

Issue 12 asks the default predictor for (a) an average volume-weighted error (VWE) <= 0.85x the
better of CSP and persistence and (b) peak coverage >= 90 % with a mean over-forecast <= 30 %,
on every multi-day bundled trace.  Three tables, one row per trace of the goals table:

1. **In-sample linear models** (fitted on the whole trace: they see the future):
   least-absolute-deviation regression of the log-load change on 34 lag and time-of-day
   features, as a ratio to persistence's VWE; quantile regression (q = 0.90) of the log peak:
   its coverage and volume-weighted over-forecast ``sum max(p - a, 0) / sum a``.
2. **Oracles** (``predictor_oracles``): the least over-forecast at 90 % coverage of *any*
   forecast (randomised ones included, coverage shared unevenly between windows) for an oracle
   that knows the window's actual average, and for one that knows the load's smooth rate
   (a centred moving average over 11, 31 and 61 steps, past and future) and draws each window's
   deviations from it as whole blocks from the windows at the nearest level; the least VWE of
   the average for the 31-step oracle (each window's median) against the 0.85x target; the
   deviations' autocorrelation at lags 1-5 steps (the oracle assumes they are unpredictable), and
   the middle bandwidth's bound again for an oracle that also knows the step just before the
   window.
3. **Nonlinear models** (``predictor_boosting``: gradient-boosted trees with ``warm``'s members,
   lags, 1/2/7-day seasonal lags, time of day, and for ServeGen models the other models' series
   and the sum): walk-forward (refitted daily on the past, the protocol of ``warmserve predict
   --compare``) VWE ratio alone and as the geometric mean with ``warm``; the same trees under
   day-blocked cross-validation (fitted on every *other* day, future days included: optimistic
   without being scored on their own training windows) for the VWE, and a 0.9-quantile model
   under the same protocol with one log shift chosen on the whole trace for exactly 90 %
   coverage, for the peak's over-forecast.  The walk-forward peak (the trees' median of the
   peak as the base of ``warm``'s calibrated upper forecast) is in the JSON.

Run: ``python bench/predictor_bounds.py [--rows LABEL,...] [--json OUT.json]`` (about 3 minutes
on one core; ``--skip-boosting`` under 1; ``--smoke`` seconds).  Deterministic.  Needs
scikit-learn (the ``dev`` extra) for table 3.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

import numpy as np
import predictor_oracles as oracles

from warmserve.testing.smoke import add_smoke_flag, apply_smoke

SERVEGEN = "servegen_language_14d_10min_per_model.csv.gz"
SERVEGEN_MODELS = ("language/m-large", "language/m-mid", "language/m-small")
MINUTES = (11, 31, 61)  # smooth-rate bandwidths in steps for per-minute series
COARSE = (3, 7, 15)  # ... for ServeGen's 10-minute steps and BurstGPT's days
# (label, trace, window s, series, smooth-rate bandwidths in steps: the middle one is the headline)
TRACES = [
    ("azure_lmm 1 week", "azure_lmm_2025_multimodal_1week_per_minute.csv.gz", 300, None, MINUTES),
    ("servegen sum", SERVEGEN, 600, None, COARSE),
    ("servegen m-large", SERVEGEN, 600, "language/m-large", COARSE),
    ("servegen m-mid", SERVEGEN, 600, "language/m-mid", COARSE),
    ("servegen m-small", SERVEGEN, 600, "language/m-small", COARSE),
    ("burstgpt tokens/s", "burstgpt1_week1_tokens_per_s_per_minute.csv.gz", 300, None, MINUTES),
    ("burstgpt daily 61 d", "burstgpt1_daily_61d.csv.gz", 86400, None, COARSE),
]
TARGET_COVERAGE = 0.9
# the shortest trace: tables 1-2 whole, table 3's trees stop at "too few windows" (their fit is
# minutes; tests/test_predictor_bounds.py runs it on a small series)
SMOKE = {"rows": "burstgpt daily 61 d"}


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


def _windowed(trace: str, window: int, series: str | None) -> Any:
    from warmserve.cli.predict import windowed

    return windowed(
        argparse.Namespace(
            trace=trace, series=series, window=float(window), prefill_rate=None, decode_rate=None
        )
    )


def _steps(trace: str, series: str | None) -> tuple[np.ndarray, float]:
    """The trace's per-step values in the windows' unit (per second), and the step."""
    from warmserve.traces import load_trace

    t = load_trace(trace)
    _, values = t.select(series)
    values = np.asarray(values, dtype=float)
    return (values if t.is_rate else values / t.step_s), float(t.step_s)


def vwe(pred: np.ndarray, actual: np.ndarray) -> float:
    return float(np.abs(pred - actual).sum() / actual.sum())


def coverage_over(pred: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    return (
        float(np.mean(actual <= pred)),
        float(np.maximum(pred - actual, 0).sum() / actual.sum()),
    )


def shift_to_coverage(pred: np.ndarray, actual: np.ndarray, target: float) -> np.ndarray:
    """``pred * e^s`` with the least ``s`` that covers ``target`` of the windows (in-sample)."""
    need = int(np.ceil(target * actual.size - 1e-9)) - int(np.sum(actual <= 0))
    busy = actual > 0
    ratio = np.sort(np.log(actual[busy] / np.maximum(pred[busy], 1e-12 * actual[busy].max())))
    if need <= 0:
        return pred.copy()
    return pred * np.exp(ratio[need - 1])


def oracle_row(
    avg: np.ndarray, peak: np.ndarray, steps: np.ndarray, per_window: int, start: int,
    bandwidths: tuple[int, ...], reference_vwe: float,
) -> dict[str, Any]:
    """Table 2's numbers for one trace (windows ``start..``)."""
    row: dict[str, Any] = {}
    if per_window > 1:
        known = oracles.known_average_samples(avg, peak)[start:]
        bound = oracles.coverage_bound(known, TARGET_COVERAGE)
        row["known_avg_over"] = bound.over_forecast
        row["known_avg_realised"] = coverage_over(bound.forecasts, peak[start:])
    n = avg.size
    for bw in bandwidths:
        peaks, avgs, _ = oracles.smooth_rate_samples(steps[: n * per_window], per_window, bw)
        bound = oracles.coverage_bound(peaks[start:], TARGET_COVERAGE)
        row[f"rate{bw}_over"] = bound.over_forecast
        row[f"rate{bw}_realised"] = coverage_over(bound.forecasts, peak[start:])
        row[f"rate{bw}_vwe_floor"] = oracles.median_error_floor(avgs[start:])
        row[f"rate{bw}_vwe_floor_ratio"] = row[f"rate{bw}_vwe_floor"] / reference_vwe
        row[f"rate{bw}_acf"] = oracles.deviation_autocorrelation(steps, bw).tolist()
    mid = bandwidths[1]
    peaks, _, _ = oracles.smooth_rate_samples(
        steps[: n * per_window], per_window, mid, given_previous=True
    )
    row[f"rate{mid}_given_previous_over"] = oracles.coverage_bound(
        peaks[start:], TARGET_COVERAGE
    ).over_forecast
    return row


def boosting_row(
    avg: np.ndarray, peak: np.ndarray, per_day: int, start: int, cross: list[np.ndarray],
    warm_avg: np.ndarray, warm_point_peak: np.ndarray, reference_vwe: float,
) -> dict[str, Any]:
    """Table 3's numbers for one trace (windows ``start..``)."""
    import predictor_boosting as boosting

    from warmserve.policy.peak_forecast import UpperForecaster
    from warmserve.policy.warm_predictor import fold

    if avg.size < boosting.MIN_TRAIN:
        return {}
    s = slice(start, None)
    wf = boosting.boosted(avg, peak, per_day, warm_avg, cross)
    cv = boosting.boosted(avg, peak, per_day, warm_avg, cross, blocked=True)
    row: dict[str, Any] = {
        "wf_vwe_ratio": vwe(wf[s], avg[s]) / reference_vwe,
        "wf_warm_vwe_ratio": vwe(np.sqrt(wf * warm_avg)[s], avg[s]) / reference_vwe,
        "cv_vwe_ratio": vwe(cv[s], avg[s]) / reference_vwe,
    }
    q90 = boosting.boosted(
        peak, avg, per_day, warm_point_peak, cross, quantile=0.9, blocked=True
    )
    shifted = shift_to_coverage(q90[s], peak[s], TARGET_COVERAGE)
    row["cv_q90_coverage"], row["cv_q90_over"] = coverage_over(shifted, peak[s])

    class Precomputed:  # the trees' median of the peak as the calibrated forecast's base
        def __init__(self, values: np.ndarray) -> None:
            self.values = np.append(values, 0.0)

        def forecast(self, h: np.ndarray) -> float:
            return float(self.values[h.size])

        def observe(self, h: np.ndarray) -> None:
            pass

    base = boosting.boosted(peak, avg, per_day, warm_point_peak, cross)
    upper = fold(UpperForecaster(Precomputed(base), per_day if per_day > 1 else 7), peak)
    row["wf_peak_coverage"], row["wf_peak_over"] = coverage_over(
        np.maximum(upper, warm_avg)[s], peak[s]
    )
    return row


def measure(label: str, trace: str, window: int, series: str | None,
            bandwidths: tuple[int, ...], boosting: bool) -> dict[str, Any]:
    """Every number of the three tables for one trace."""
    from warmserve.policy.predictor import make_predictor, predict_peak_series, predict_series

    data = _windowed(trace, window, series)
    avg, peak, per_day = np.asarray(data.avg), np.asarray(data.peak), data.windows_per_day
    start = per_day  # as `warmserve predict` on a multi-day trace: from day 2
    preds = {n: predict_series(make_predictor(n), avg, per_day)
             for n in ("warm", "csp", "persistence")}
    s = slice(start, None)
    reference = min(vwe(preds["csp"][s], avg[s]), vwe(preds["persistence"][s], avg[s]))
    row: dict[str, Any] = {"trace": label, "reference_vwe": reference,
                           "warm_vwe_ratio": vwe(preds["warm"][s], avg[s]) / reference}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # statsmodels' iteration-limit notes
        lad, pers = vwe_bound(avg, peak, per_day)
        cover, over = peak_bound(avg, peak, per_day)
    row.update(lad_vwe=lad, persistence_vwe=pers, ratio=lad / pers, qr_coverage=cover,
               qr_over_forecast=over)
    steps, step_s = _steps(trace, series)
    row.update(oracle_row(avg, peak, steps, round(window / step_s), start, bandwidths,
                          reference))
    row["bandwidths"] = list(bandwidths)
    if boosting:
        cross: list[np.ndarray] = []
        if trace == SERVEGEN:
            models = {m: np.asarray(_windowed(trace, window, m).avg) for m in SERVEGEN_MODELS}
            cross = [v for m, v in models.items() if m != series]
            if series is not None:
                cross.append(sum(models.values()))
        warm_point = predict_peak_series(make_predictor("warm-point"), peak, per_day)
        row.update(boosting_row(avg, peak, per_day, start, cross, preds["warm"], warm_point,
                                reference))
    return row


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def print_tables(rows: list[dict[str, Any]]) -> None:
    print("\n1. in-sample linear models (fitted on every window, the future included)")
    print(f"{'trace':22s} {'LAD VWE':>8s} {'pers VWE':>8s} {'ratio':>6s} "
          f"{'QR0.9 cover':>11s} {'QR0.9 over':>10s}")
    for r in rows:
        print(f"{r['trace']:22s} {_pct(r['lad_vwe']):>8s} {_pct(r['persistence_vwe']):>8s} "
              f"{_ratio(r['ratio']):>6s} {_pct(r['qr_coverage']):>11s} "
              f"{_pct(r['qr_over_forecast']):>10s}")
    print("\n2. oracles: least over-forecast at 90 % coverage; least VWE of the average")
    print(f"{'trace':22s} {'bw (steps)':>10s} {'knows avg':>9s} {'rate bw1':>8s} "
          f"{'rate bw2':>8s} {'rate bw3':>8s} {'bw2+prev':>8s} {'bw2 real cov':>12s} "
          f"{'VWE floor bw2':>13s} "
          f"{'/ref':>6s} {'|acf| max':>9s}")
    for r in rows:
        b = r["bandwidths"]
        mid = b[1]
        print(f"{r['trace']:22s} {'/'.join(map(str, b)):>10s} "
              f"{_pct(r.get('known_avg_over')):>9s} "
              + " ".join(f"{_pct(r[f'rate{w}_over']):>8s}" for w in b)
              + f" {_pct(r[f'rate{mid}_given_previous_over']):>8s}"
              + f" {_pct(r[f'rate{mid}_realised'][0]):>12s}"
              + f" {_pct(r[f'rate{mid}_vwe_floor']):>13s} "
              f"{_ratio(r[f'rate{mid}_vwe_floor_ratio']):>6s} "
              f"{max(abs(x) for x in r[f'rate{mid}_acf']):9.3f}")
    print("\n3. gradient-boosted trees (VWE of the average / better of csp, persistence; "
          "peak over-forecast)")
    print(f"{'trace':22s} {'warm':>6s} {'wf':>6s} {'wf*warm':>7s} {'cv':>6s} "
          f"{'cv q0.9 over':>12s} {'wf peak cov/over':>17s}")
    for r in rows:
        if "wf_vwe_ratio" not in r:
            print(f"{r['trace']:22s} {_ratio(r['warm_vwe_ratio']):>6s}   (too few windows "
                  "to fit trees)")
            continue
        print(f"{r['trace']:22s} {_ratio(r['warm_vwe_ratio']):>6s} "
              f"{_ratio(r['wf_vwe_ratio']):>6s} {_ratio(r['wf_warm_vwe_ratio']):>7s} "
              f"{_ratio(r['cv_vwe_ratio']):>6s} {_pct(r['cv_q90_over']):>12s} "
              f"{_pct(r['wf_peak_coverage']):>8s}/{_pct(r['wf_peak_over']):<8s}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT.json", help="also write the rows as JSON")
    parser.add_argument("--rows", help="comma-separated trace labels (default: all)")
    parser.add_argument("--skip-boosting", action="store_true",
                        help="leave out table 3 (needs scikit-learn; most of the time)")
    add_smoke_flag(parser, SMOKE)
    args = parser.parse_args(argv)
    apply_smoke(args, SMOKE, {"json": "predictor_bounds.json"} if args.smoke else None)
    wanted = None if args.rows is None else {x.strip() for x in args.rows.split(",")}
    known = {t[0] for t in TRACES}
    if wanted is not None and not wanted <= known:
        parser.error(f"unknown rows {sorted(wanted - known)} (known: {', '.join(sorted(known))})")
    rows = []
    for label, trace, window, series, bandwidths in TRACES:
        if wanted is not None and label not in wanted:
            continue
        t0 = time.monotonic()
        rows.append(measure(label, trace, window, series, bandwidths, not args.skip_boosting))
        print(f"predictor_bounds: {label} {time.monotonic() - t0:.0f} s", file=sys.stderr,
              flush=True)
    print_tables(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
        print(f"saved {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
