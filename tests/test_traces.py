"""Trace reading: format detection, bundled names, validation errors."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from warmserve.policy.cluster import PolicyInputError
from warmserve.traces import (
    CountSeries,
    RequestTrace,
    TraceError,
    bundled_traces,
    detect_format,
    load_trace,
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("header", "fmt"),
    [
        ("arrival_s,input_tokens,output_tokens", "request"),
        ("start_s,model_or_function_id,count", "count"),
        ("start_s,model_or_function_id,tokens_per_s", "tokens_per_s"),
        ("start_s,model_or_function_id,count,total_tokens", "daily"),
    ],
)
def test_detect_format(header: str, fmt: str) -> None:
    assert detect_format(header.split(",")) == fmt


def test_detect_format_rejects_unknown_columns() -> None:
    with pytest.raises(TraceError, match="unrecognised columns 'time,n'"):
        detect_format(["time", "n"])
    assert issubclass(TraceError, PolicyInputError)


def test_bundled_traces_load_by_name() -> None:
    names = bundled_traces()
    assert "azure_conv_2023_1h.csv.gz" in names
    assert "burstgpt1_daily_61d.csv.gz" in names
    conv = load_trace("azure_conv_2023_1h.csv.gz")
    assert isinstance(conv, RequestTrace) and conv.arrival_s.size == 19366
    lmm = load_trace("azure_lmm_2025_multimodal_1week_per_minute")  # suffix optional
    assert isinstance(lmm, CountSeries) and lmm.step_s == 60 and lmm.span_s == 7 * 86400
    tok = load_trace("burstgpt1_week1_tokens_per_s_per_minute.csv.gz")
    assert isinstance(tok, CountSeries) and tok.is_rate
    daily = load_trace("burstgpt1_daily_61d.csv.gz")
    assert isinstance(daily, CountSeries) and daily.measure == "count"
    assert daily.step_s == 86400 and daily.values["burstgpt_1_all"][0] == 3389


def test_count_series_select_and_sum(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "s.csv.gz",
        "start_s,model_or_function_id,count\n0,a,1\n0,b,10\n60,a,2\n60,b,20\n",
    )
    series = load_trace(path)
    assert isinstance(series, CountSeries) and series.ids == ("a", "b")
    label, values = series.select(None)
    assert label == "sum of 2 series (a,b)" and list(values) == [11, 22]
    assert list(series.select("b")[1]) == [10, 20]
    with pytest.raises(TraceError, match="unknown series 'c'"):
        series.select("c")


def test_request_trace_plain_csv(tmp_path: Path) -> None:
    path = write(tmp_path, "r.csv", "arrival_s,input_tokens,output_tokens\n0,10,5\n1.5,20,0\n")
    trace = load_trace(path)
    assert isinstance(trace, RequestTrace)
    np.testing.assert_array_equal(trace.input_tokens, [10, 20])
    assert trace.span_s == 1.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("arrival_s,input_tokens,output_tokens\n", "no requests"),
        ("arrival_s,input_tokens,output_tokens\n2,1,1\n1,1,1\n", r":3: arrivals not sorted"),
        ("arrival_s,input_tokens,output_tokens\n0,-1,1\n", r":2: input_tokens must be >= 0"),
        ("arrival_s,input_tokens,output_tokens\n0,1,-3\n", "output_tokens must be >= 0"),
        ("arrival_s,input_tokens,output_tokens\n0,x,1\n", "input_tokens is not a number"),
        ("arrival_s,input_tokens,output_tokens\n0,1\n", "expected 3 fields"),
        ("arrival_s,prompt,output_tokens\n0,1,1\n", "unrecognised columns"),
        ("start_s,model_or_function_id,count\n0,a,1\n60,a,1\n180,a,1\n", "not contiguous"),
        ("start_s,model_or_function_id,count\n0,a,1\n60,a,-1\n", "count must be >= 0"),
        ("start_s,model_or_function_id,count\n0,a,1\n", "fewer than 2 steps"),
        ("start_s,model_or_function_id,count\n60,a,1\n0,a,1\n", "not strictly increasing"),
        ("start_s,model_or_function_id,count\n0,a,1\n60,a,1\n0,b,1\n120,b,1\n", "same time grid"),
        ("start_s,model_or_function_id,count\n0,,1\n", "empty model_or_function_id"),
    ],
)
def test_bad_traces(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_missing_and_corrupt(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"trace not found: nope\.csv"):
        load_trace("nope.csv")
    with pytest.raises(TraceError, match="trace not found"):
        load_trace(tmp_path / "absent.csv.gz")
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(TraceError, match="corrupt gzip"):
        load_trace(bad)


GENTD_HEADER = (
    "arrival_s,predict_type,predict_status,exec_time_s,group_id,prompt_chars,"
    "negative_prompt_chars,num_images_per_prompt,num_inference_steps,model_id,num_lora"
)


def test_service_time_trace_reads_measured_durations(tmp_path: Path) -> None:
    # The Alibaba GenTD26 shape: arrival first, exec_time_s among other columns.
    p = tmp_path / "gentd.csv"
    p.write_text(
        GENTD_HEADER + "\n"
        "0.000,TXT_2_IMG,SUCCEED,32,G0000,63,26,1,30,M0000,0\n"
        "10.000,TXT_2_IMG,SUCCEED,43,G0001,93,,1,40,M0001,0\n"
    )
    assert detect_format(GENTD_HEADER.split(",")) == "service"
    t = load_trace(p)
    assert isinstance(t, RequestTrace)
    assert t.arrival_s.tolist() == [0.0, 10.0]
    assert t.duration_s is not None and t.duration_s.tolist() == [32.0, 43.0]


@pytest.mark.parametrize(
    "rows, message",
    [
        ("0,T,S,-1,G,1,,1,1,M,0\n", "exec_time_s must be >= 0"),
        ("5,T,S,1,G,1,,1,1,M,0\n1,T,S,1,G,1,,1,1,M,0\n", "arrivals not sorted"),
        ("0,T,S,1\n", "expected 11 fields"),
    ],
)
def test_service_time_trace_bad_rows(tmp_path: Path, rows: str, message: str) -> None:
    p = tmp_path / "gentd.csv"
    p.write_text(GENTD_HEADER + "\n" + rows)
    with pytest.raises(PolicyInputError, match=message):
        load_trace(p)
