"""Tests of ``warmserve predict``: output contract, bad input, and the default's claim."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from warmserve import cli
from warmserve.cli.predict import evaluate_predictor, evaluation_start, windowed
from warmserve.policy.predictor import PREDICTORS


@pytest.fixture(autouse=True)
def _only_predict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("warmserve.cli.predict",))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def series_file(
    tmp_path: Path, days: int = 3, step: int = 3600, ids: tuple[str, ...] = ("m",)
) -> Path:
    rng = np.random.default_rng(0)
    lines = ["start_s,model_or_function_id,count"]
    n = days * 86400 // step
    for i in range(n):
        for k, ident in enumerate(ids):
            base = 100 * (k + 1) * (1.5 + np.sin(2 * np.pi * i * step / 86400))
            lines.append(f"{i * step},{ident},{int(base * rng.lognormal(0, 0.1))}")
    path = tmp_path / "series.csv.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def request_file(tmp_path: Path, text: str | None = None) -> Path:
    if text is None:
        rows = [f"{i * 2.0:.1f},{100 + i},{20 + i % 7}" for i in range(200)]
        text = "arrival_s,input_tokens,output_tokens\n" + "\n".join(rows) + "\n"
    path = tmp_path / "requests.csv"
    path.write_text(text)
    return path


STAT_KEYS = {
    "avg_rel_error", "peak_rel_error", "avg_vw_error", "peak_vw_error", "peak_coverage",
    "peak_over_forecast", "peak_over_forecast_rel", "avg_under_rate", "peak_under_rate",
    "windows", "avg", "peak",
}
QUALITY_KEYS = {
    "windows", "mean_rel_error", "volume_weighted_error", "under_rate", "coverage",
    "over_forecast", "over_forecast_rel",
}


def test_json_contract_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = series_file(tmp_path, ids=("a", "b"))
    rc, out, err = run(
        ["predict", str(path), "--window", "3600", "--compare", "--json", "--quiet"], capsys
    )
    assert rc == 0, err
    assert err == ""  # --quiet: no progress
    obj = json.loads(out)
    assert set(obj) == {"series", "window_s", "predictors", "default", "default_summary"}
    assert obj["series"] == "sum of 2 series (a,b)"
    assert obj["window_s"] == 3600 and obj["default"] == "warm"
    assert set(obj["predictors"]) == set(PREDICTORS)
    for stats in obj["predictors"].values():
        assert set(stats) == STAT_KEYS
        assert set(stats["avg"]) == set(stats["peak"]) == QUALITY_KEYS
        assert stats["windows"] == 48  # 72 hourly windows, evaluated from the second day
        assert 0 <= stats["avg_under_rate"] <= 1 and stats["avg_rel_error"] >= 0
        assert stats["peak_coverage"] == pytest.approx(1 - stats["peak_under_rate"])
        assert stats["avg_vw_error"] == stats["avg"]["volume_weighted_error"]
        assert stats["peak_over_forecast"] == stats["peak"]["over_forecast"]
    summary = obj["default_summary"]
    warm, best = obj["predictors"]["warm"], obj["predictors"][summary["best_baseline"]]
    assert summary["best_baseline"] in ("csp", "persistence")
    assert summary["avg_vw_error_ratio"] == pytest.approx(
        warm["avg_vw_error"] / best["avg_vw_error"]
    )
    assert summary["coverage_goal_met"] == (
        warm["peak_coverage"] >= 0.9 and warm["peak_over_forecast"] <= 0.3
    )
    # one predictor: no summary (it needs the baselines)
    rc, out, _ = run(["predict", str(path), "--window", "3600", "--json", "--quiet"], capsys)
    assert "default_summary" not in json.loads(out)


def test_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = series_file(tmp_path)
    rc, out, err = run(["predict", str(path), "--window", "3600", "--json"], capsys)
    assert rc == 0
    json.loads(out)  # stdout is the result alone
    lines = err.splitlines()
    assert lines[0].startswith("predict: read ") and "72 windows of 3600 s" in lines[0]
    assert lines[1].startswith("predict: [1/1] warm ... ") and lines[1].endswith(" s")


def test_table_single_series(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = series_file(tmp_path, ids=("a", "b"))
    rc, out, _ = run(
        ["predict", str(path), "--window", "7200", "--series", "b", "--predictor", "csp"], capsys
    )
    assert rc == 0
    assert "series b  window 7200 s  (12 per day)" in out
    assert "evaluated windows 13..36 of 36" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("csp")]
    assert len(lines) == 1 and lines[0].split()[-1] == "24"
    header = next(ln for ln in out.splitlines() if ln.startswith("predictor"))
    assert header.split() == [
        "predictor", "avg", "MRE", "avg", "VWE", "peak", "MRE", "peak", "VWE", "peak", "cover",
        "peak", "over", "avg", "under", "windows",
    ]
    assert "default warm" not in out  # the goal line needs --compare


def test_sum_is_announced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = series_file(tmp_path, ids=("a", "b"))
    rc, out, _ = run(["predict", str(path), "--window", "3600"], capsys)
    assert rc == 0
    assert "note: no --series given: evaluating the sum of 2 series (a,b)" in out
    assert "warm *" in out


def test_short_request_trace_uses_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = request_file(tmp_path)  # 398 s of arrivals
    rc, out, err = run(["predict", str(path), "--window", "30", "--json"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["series"] == "all requests"
    assert obj["predictors"]["warm"]["windows"] == 13 - 10  # windows 11..13
    rc, out, _ = run(["predict", str(path), "--window", "30"], capsys)
    assert "shorter than a day plus a window" in out and "from window 11" in out


def test_request_load_uses_speed_profile(tmp_path: Path) -> None:
    path = request_file(tmp_path, "arrival_s,input_tokens,output_tokens\n0,1000,10\n20,0,0\n")
    args = argparse.Namespace(
        trace=str(path), series=None, window=10.0, prefill_rate=1000.0, decode_rate=2.0
    )
    data = windowed(args)
    # one request in flight for 1 + 5 = 6 s of the first 10 s window
    assert data.avg == pytest.approx([0.6, 0.0]) and data.peak == [1.0, 0.0]
    assert data.unit == "requests in flight"


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = series_file(tmp_path, days=3)
    png = tmp_path / "out.png"
    rc, _, err = run(
        ["predict", str(path), "--window", "3600", "--compare", "--plot", str(png),
         "--plot-day", "2"],
        capsys,
    )
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in err
    rc, _, err = run(["predict", str(path), "--window", "86400", "--plot", str(png)], capsys)
    assert rc == 0, err  # day-long windows: the panels show every evaluated window


def test_plot_zoom_range() -> None:
    from warmserve.cli import CliError
    from warmserve.cli.predict_plot import zoom_range

    assert zoom_range(72, 24, 24, None) == (48, 72)  # the last full day
    assert zoom_range(80, 24, 24, 2) == (24, 48)
    assert zoom_range(61, 1, 1, None) == (1, 61)
    assert zoom_range(12, 24, 10, None) == (10, 12)  # under a day: all evaluated windows
    with pytest.raises(CliError, match="between 2 and 3"):
        zoom_range(72, 24, 24, 1)
    with pytest.raises(CliError, match="needs windows shorter than a day"):
        zoom_range(61, 1, 1, 3)


@pytest.mark.parametrize(
    ("extra", "content", "message"),
    [
        ([], None, "trace not found"),
        ([], "time,n\n0,1\n", "unrecognised columns"),
        ([], "arrival_s,input_tokens,output_tokens\n5,1,1\n1,1,1\n", "arrivals not sorted"),
        ([], "arrival_s,input_tokens,output_tokens\n0,-4,1\n", "input_tokens must be >= 0"),
        (["--predictor", "oracle"], "series", "unknown predictor 'oracle'"),
        (["--series", "zzz"], "series", "unknown series 'zzz'"),
        (["--window", "5400"], "series", "must be a whole multiple of the series step"),
        (["--window", "7000"], "series", "must divide a day"),
        (["--window", "-3"], "series", "--window must be a positive"),
        (["--window", "600"], "requests", "shorter than one --window"),
        (["--series", "x"], "requests", "request-level trace with no series ids"),
        (["--decode-rate", "0"], "requests", "--decode-rate must be a positive number"),
        (["--plot", "/nonexistent-dir/x.png"], "series", "cannot write plot"),
        (["--plot-day", "2"], "series", "--plot-day needs --plot"),
        (["--plot", "PNG", "--plot-day", "1"], "series", "--plot-day must be between 2 and 2"),
    ],
)
def test_bad_input_exits_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    content: str | None,
    message: str,
) -> None:
    if content is None:
        trace = str(tmp_path / "missing.csv")
    elif content == "series":
        trace = str(series_file(tmp_path, days=2))
    elif content == "requests":
        trace = str(request_file(tmp_path, "arrival_s,input_tokens,output_tokens\n0,1,1\n60,1,1\n"))
    else:
        trace = str(request_file(tmp_path, content))
    extra = [str(tmp_path / "p.png") if x == "PNG" else x for x in extra]
    argv = ["predict", trace, "--window", "3600", *extra] if content == "series" else [
        "predict", trace, *extra
    ]
    rc, out, err = run(argv, capsys)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("warmserve predict: error: ")
    assert message in err
    assert "Traceback" not in err


MULTI_DAY = [
    ("azure_lmm_2025_multimodal_1week_per_minute.csv.gz", 300, None),
    ("servegen_language_14d_10min_per_model.csv.gz", 600, None),
    ("servegen_language_14d_10min_per_model.csv.gz", 600, "language/m-large"),
    ("servegen_language_14d_10min_per_model.csv.gz", 600, "language/m-mid"),
    ("servegen_language_14d_10min_per_model.csv.gz", 600, "language/m-small"),
    ("burstgpt1_week1_tokens_per_s_per_minute.csv.gz", 300, None),
    ("burstgpt1_daily_61d.csv.gz", 86400, None),
]


def _multi_day(trace: str, window: int, series: str | None) -> tuple[Any, int]:
    args = argparse.Namespace(
        trace=trace, series=series, window=float(window), prefill_rate=None, decode_rate=None
    )
    data = windowed(args)
    start, note = evaluation_start(data, 10)
    assert note is None and start == data.windows_per_day
    return data, start


@pytest.mark.parametrize(("trace", "window", "series"), MULTI_DAY)
def test_default_claims_on_bundled_traces(trace: str, window: int, series: str | None) -> None:
    """What docs/prediction.md claims for the default, on every multi-day bundled trace.

    - the average: lower mean relative error than CSP and persistence (the point forecast
      is unchanged from ``warm-point``);
    - ``warm-point``'s peak: lower mean relative error than CSP's and persistence's;
    - the peak: at least 90 % of windows covered (the predictor's goal), where every point
      forecast covers about half;
    - the mean over-forecast <= 30 % holds on the ServeGen series only (not asserted elsewhere:
      docs/prediction.md gives the numbers and why).
    """
    data, start = _multi_day(trace, window, series)
    r = {
        name: evaluate_predictor(name, data, start)[0]
        for name in ("warm", "warm-point", "csp", "persistence")
    }
    for base in ("csp", "persistence"):
        assert r["warm"]["avg_rel_error"] < r[base]["avg_rel_error"], base
        assert r["warm-point"]["peak_rel_error"] < r[base]["peak_rel_error"], base
        assert r[base]["peak_coverage"] < 0.65, base
    assert r["warm"]["avg"] == r["warm-point"]["avg"]
    assert r["warm"]["peak_coverage"] >= 0.90
    assert r["warm-point"]["peak_coverage"] < 0.56
    if trace.startswith("servegen"):
        assert r["warm"]["peak_over_forecast"] <= 0.30
