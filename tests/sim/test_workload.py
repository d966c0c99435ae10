"""Workload generation: sub-second structure from the request-level traces,
per-minute counts from the count series, streaming that does not depend on how time is cut."""

from __future__ import annotations

import numpy as np
import pytest

from warmserve.sim import workload as wl
from warmserve.traces import load_trace

CONV = "azure_conv_2023_1h.csv.gz"
CODE = "azure_code_2023_1h.csv.gz"
LMM = "azure_lmm_2025_multimodal_1week_per_minute.csv.gz"


@pytest.fixture(scope="module")
def shapes():
    counts = wl.read_minute_series(LMM)
    return wl.model_shapes(counts, [2, 3], 245, 120, wl.power_law_shares(2, 0.5), 12.0, 1)


def test_dispersion_of_the_bundled_traces_is_what_the_issue_measured():
    conv = np.asarray(load_trace(CONV).arrival_s)
    code = np.asarray(load_trace(CODE).arrival_s)
    assert wl.dispersion(conv, 1.0, None) == pytest.approx(1.38, abs=0.01)
    assert wl.dispersion(code, 1.0, None) == pytest.approx(13.2, abs=0.05)
    rng = np.random.default_rng(0)
    poisson = np.sort(rng.random(20000) * 3600)
    assert wl.dispersion(poisson, 1.0) == pytest.approx(1.0, abs=0.05)


def test_template_arrivals_are_bursty_inside_the_minute_poisson_ones_are_not(shapes):
    lengths = wl.read_lengths(CONV)
    disp = {}
    for name in (CONV, CODE, None):
        tpl = wl.ArrivalTemplate.from_trace(name) if name else None
        r = wl.RequestStream(1, shapes, lengths, tpl, 7200).materialize()
        disp[name] = [wl.dispersion(r.arrival[r.model == m], 1.0) for m in range(2)]
    assert all(0.9 < d < 1.1 for d in disp[None])
    assert all(d > 1.08 for d in disp[CONV])  # conv's own within-minute structure: 1.12
    assert all(d > 5 for d in disp[CODE])  # code's (13.2 raw), compressed to these rates


def test_per_minute_counts_follow_the_count_series_whatever_the_template(shapes):
    lengths = wl.read_lengths(CONV)
    tpl = wl.ArrivalTemplate.from_trace(CODE)
    a = wl.RequestStream(3, shapes, lengths, tpl, 7200).materialize()
    b = wl.RequestStream(3, shapes, lengths, None, 7200).materialize()
    for m in range(2):
        ca = np.bincount((a.arrival[a.model == m] // 60).astype(int), minlength=120)
        cb = np.bincount((b.arrival[b.model == m] // 60).astype(int), minlength=120)
        np.testing.assert_array_equal(ca, cb)  # same Poisson draw per minute, placed differently
        expected = shapes[m].rate_per_minute
        assert ca.sum() == pytest.approx(expected.sum(), rel=0.03)


def test_streaming_gives_the_same_requests_however_time_is_cut(shapes):
    lengths = wl.read_lengths(CONV)
    tpl = wl.ArrivalTemplate.from_trace(CONV)
    st = wl.RequestStream(5, shapes, lengths, tpl, 7200)
    whole = st.materialize()
    for m in range(2):
        t, inp, _out = st.model_requests(m, 0.0, 7200.0)
        mine = whole.model == m
        np.testing.assert_array_equal(t, whole.arrival[mine])
        np.testing.assert_array_equal(inp, whole.input_tokens[mine])
        # an uneven cut gives the same requests
        t1, _, _ = st.model_requests(m, 0.0, 1234.5)
        t2, _, _ = st.model_requests(m, 1234.5, 7200.0)
        np.testing.assert_array_equal(np.concatenate([t1, t2]), t)
    # history is generated the same way, before the period
    h, _, _ = st.model_requests(0, -86400.0, 0.0)
    assert h.size > 0 and h.max() < 0 and h.min() >= -86400.0
    assert (np.diff(whole.arrival) >= 0).all()
    other = wl.RequestStream(6, shapes, lengths, tpl, 7200).materialize()
    assert not np.array_equal(other.arrival[: len(whole)], whole.arrival[: len(other)])


def test_template_errors():
    with pytest.raises(wl.WorkloadError, match="not a request-level trace"):
        wl.ArrivalTemplate.from_trace(LMM)
