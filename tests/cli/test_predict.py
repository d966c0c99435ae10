"""Tests of ``warmserve predict``: output contract, bad input, and the default's claim."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from warmserve import cli
from warmserve.cli.predict import evaluation_start, windowed
from warmserve.policy.predictor import DEFAULT_PREDICTOR, PREDICTORS, evaluate, make_predictor


@pytest.fixture(autouse=True)
def _only_predict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("predict",))


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


def test_json_contract_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = series_file(tmp_path, ids=("a", "b"))
    rc, out, err = run(["predict", str(path), "--window", "3600", "--compare", "--json"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert set(obj) == {"series", "window_s", "predictors", "default"}
    assert obj["series"] == "sum of 2 series (a,b)"
    assert obj["window_s"] == 3600 and obj["default"] == "warm"
    assert set(obj["predictors"]) == set(PREDICTORS)
    for stats in obj["predictors"].values():
        assert set(stats) == {
            "avg_rel_error",
            "peak_rel_error",
            "avg_under_rate",
            "peak_under_rate",
            "windows",
        }
        assert stats["windows"] == 48  # 72 hourly windows, evaluated from the second day
        assert 0 <= stats["avg_under_rate"] <= 1 and stats["avg_rel_error"] >= 0


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
    path = series_file(tmp_path, days=2)
    png = tmp_path / "out.png"
    rc, _, err = run(["predict", str(path), "--window", "3600", "--plot", str(png)], capsys)
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    argv = (
        ["predict", trace, "--window", "3600", *extra]
        if content == "series"
        else ["predict", trace, *extra]
    )
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


@pytest.mark.parametrize(("trace", "window", "series"), MULTI_DAY)
def test_default_beats_csp_and_persistence(trace: str, window: int, series: str | None) -> None:
    """The project's claim for its default, on every multi-day bundled trace (avg and peak)."""
    args = argparse.Namespace(
        trace=trace, series=series, window=float(window), prefill_rate=None, decode_rate=None
    )
    data = windowed(args)
    start, note = evaluation_start(data, 10)
    assert note is None and start == data.windows_per_day
    for actual in (data.avg, data.peak):
        err = {
            name: evaluate(make_predictor(name), actual, data.windows_per_day, start).rel_error
            for name in (DEFAULT_PREDICTOR, "csp", "persistence")
        }
        assert err[DEFAULT_PREDICTOR] < err["csp"], err
        assert err[DEFAULT_PREDICTOR] < err["persistence"], err
