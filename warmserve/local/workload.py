"""The replay plan of ``warmserve up``: which request goes to which model when, and the load
history the operator would have seen before.

Time compression.  The trace's clock runs ``speed`` times faster than the wall clock: a trace
minute lasts ``60 / speed`` seconds, and the operator runs with its window and its seasonal day
divided by ``speed`` (``--window-seconds 15 --day-seconds 4320`` at speed 20), so a 5-minute
window of the trace is one operator window and a trace day is one seasonal period.  The request
*rate* is set in wall-clock time (``rps``): the trace shapes how it varies (per-minute counts, a
different day per model, as the simulator's workload does — :mod:`warmserve.sim.workload`, the
same code), and requests last as long as the agents' engines take (prefill + decode at the
model's rates), which is not compressed.  So a cold start of 6 s still meets the load of 6 s
of real traffic; what runs faster is the daily pattern the predictor learns.

Two trace shapes:

* per-minute **count series** (the bundled Azure multimodal week): the simulator's procedure —
  model *i* reads trace day ``trace_day[i]`` from the busiest period of those days, shares
  ``∝ (i+1)^-α``, Poisson arrivals within each minute, (input, output) pairs sampled from the
  lengths trace; the ``history_days`` before the period become the seeded history;
* **request-level** traces (Azure 2023 conversation / code hours): their own arrivals and
  lengths, thinned to ``rps``, each request given to a model by the same shares; no history
  (the trace is one hour), so the predictor learns as it goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from warmserve.policy.load import inflight_load, request_durations
from warmserve.sim import workload as wl
from warmserve.traces import CountSeries, RequestTrace, TraceError, load_trace

from .model_mix import ModelMix, UpConfigError

DAY_S = 86400.0


class PlanError(UpConfigError):
    """A replay that cannot be planned (unknown trace, too short, bad speed); one line."""


@dataclass(frozen=True)
class ReplayPlan:
    """Requests in wall-clock seconds from the start of the measured period (warm-up < 0)."""

    trace: str
    description: str
    models: tuple[str, ...]
    arrival: np.ndarray
    model: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    speed: float
    window_s: float  # the operator's window (wall-clock)
    day_s: float  # the operator's seasonal day (wall-clock)
    warmup_s: float
    duration_s: float
    # Per model: (avg, peak) requests in flight per window, ending where the warm-up starts.
    history: dict[str, tuple[list[float], list[float]]]
    # Per model: (avg, peak) per window over warm-up + replay, as the trace asks (the oracle).
    planned: dict[str, tuple[list[float], list[float]]]

    def __len__(self) -> int:
        return int(self.arrival.size)

    @property
    def measured(self) -> int:
        return int(np.count_nonzero(self.arrival >= 0))


def operator_times(mix: ModelMix, speed: float) -> tuple[float, float]:
    """(window, day) in wall-clock seconds at ``speed``; the window must divide the day."""
    if not (math.isfinite(speed) and 1 <= speed <= 1000):
        raise PlanError(f"--speed must be between 1 and 1000, got {speed:g}")
    window, day = mix.window_s / speed, DAY_S / speed
    per_day = day / window
    if abs(per_day - round(per_day)) > 1e-9 or abs(window * 1000 - round(window * 1000)) > 1e-6:
        raise PlanError(
            f"--speed {speed:g} gives a {window:g} s window, which does not divide the "
            f"{day:g} s day in whole milliseconds; use a divisor of 300 such as 10, 20, 30 or 60"
        )
    return window, day


def durations(mix: ModelMix, idx: int, inp: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Seconds the agents' simulated engine keeps a request of model ``idx`` in flight."""
    m = mix.models[idx]
    # The engine sleeps input/prefill before the first token and 1/decode before each other one.
    return request_durations(inp, np.maximum(out - 1, 0), m.prefill_tok_s, m.decode_tok_s)


def _windows(
    mix: ModelMix,
    idx: int,
    t: np.ndarray,
    inp: np.ndarray,
    out: np.ndarray,
    start: float,
    end: float,
    window: float,
) -> tuple[list[float], list[float]]:
    if end - start < window - 1e-9:
        return [], []
    loads = inflight_load(t, durations(mix, idx, inp, out), window, start_s=start, end_s=end)
    return [w.avg for w in loads], [w.peak for w in loads]


def plan(mix: ModelMix, trace: str, speed: float, minutes: float) -> ReplayPlan:
    window, day = operator_times(mix, speed)
    if not (math.isfinite(minutes) and minutes > 0):
        raise PlanError(f"--minutes must be > 0, got {minutes:g}")
    win_min = mix.window_s / 60
    if minutes < win_min:
        raise PlanError(f"--minutes must cover one window ({win_min:g} trace minutes) at least")
    try:
        t = load_trace(trace)
    except TraceError as exc:
        raise PlanError(str(exc)) from None
    if isinstance(t, RequestTrace):
        return _plan_requests(mix, t, speed, minutes, window, day)
    assert isinstance(t, CountSeries)
    return _plan_series(mix, trace, speed, minutes, window, day)


def _capped(mix: ModelMix, inp: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scenario's caps on request lengths (a real model's context, a CPU's pace)."""
    if mix.max_input_tokens:
        inp = np.minimum(inp, mix.max_input_tokens)
    if mix.max_output_tokens:
        out = np.minimum(out, mix.max_output_tokens)
    return inp, out


def _plan_series(
    mix: ModelMix, trace: str, speed: float, minutes: float, window: float, day: float
) -> ReplayPlan:
    try:
        counts = wl.read_minute_series(trace)
        lengths = _capped(mix, *wl.read_lengths(mix.lengths))
    except (wl.WorkloadError, TraceError) as exc:
        raise PlanError(
            f"{exc}; warmserve up replays per-minute request-count series or request-level "
            "traces (e.g. azure_lmm_2025_multimodal_1week_per_minute, azure_conv_2023_1h)"
        ) from None
    n_days = counts.size // wl.MINUTES_PER_DAY
    if n_days < 1:
        raise PlanError(f"{trace} is shorter than a day; use a request-level trace instead")
    days = [m.trace_day % n_days for m in mix.models]
    hist_days = min(mix.history_days, min(days))
    win_min = int(mix.window_s // 60)
    warm_min = mix.warmup_windows * win_min
    dur_min = math.ceil(minutes / win_min) * win_min
    total_min = warm_min + dur_min
    if total_min > wl.MINUTES_PER_DAY:
        raise PlanError(f"--minutes {minutes:g}: at most {wl.MINUTES_PER_DAY - warm_min} (a day)")
    if mix.start == "busiest":
        start = wl.busiest_start_minute(counts, days, total_min)
    else:
        start = int(mix.start)
    start -= start % win_min
    shares = wl.power_law_shares(len(mix.models), mix.alpha)
    try:
        shapes = wl.model_shapes(counts, days, start, total_min, shares, mix.rps / speed, hist_days)
    except wl.WorkloadError as exc:
        raise PlanError(str(exc)) from None
    stream = wl.RequestStream(mix.seed, shapes, lengths, None, total_min * 60.0)
    reqs = stream.materialize()
    warm_s = warm_min * 60 / speed
    arrival = reqs.arrival / speed - warm_s
    history, planned = {}, {}
    for i, (m, shape) in enumerate(zip(mix.models, shapes, strict=True)):
        span_trace = shape.history_rate_per_minute.size * 60.0
        h_t, h_in, h_out = stream.model_requests(i, -span_trace, 0.0)
        span = span_trace / speed
        history[m.name] = _windows(mix, i, h_t / speed, h_in, h_out, -span, 0.0, window)
        mine = reqs.model == i
        planned[m.name] = _windows(
            mix,
            i,
            reqs.arrival[mine] / speed,
            reqs.input_tokens[mine],
            reqs.output_tokens[mine],
            0.0,
            total_min * 60 / speed,
            window,
        )
    hhmm = f"{start // 60:02d}:{start % 60:02d}"
    desc = (
        f"{trace}: days {', '.join(map(str, days))} from {hhmm} "
        f"({'busiest period' if mix.start == 'busiest' else 'chosen start'}), "
        f"{hist_days} days of history"
    )
    return ReplayPlan(
        trace,
        desc,
        tuple(m.name for m in mix.models),
        arrival,
        reqs.model,
        reqs.input_tokens,
        reqs.output_tokens,
        speed,
        window,
        day,
        warm_s,
        dur_min * 60 / speed,
        history,
        planned,
    )


def _plan_requests(
    mix: ModelMix, t: RequestTrace, speed: float, minutes: float, window: float, day: float
) -> ReplayPlan:
    win_min = int(mix.window_s // 60)
    warm_min = mix.warmup_windows * win_min
    dur_min = math.ceil(minutes / win_min) * win_min
    span_min = t.span_s / 60
    if warm_min + dur_min > span_min:
        most = math.floor((span_min - warm_min) / win_min) * win_min
        raise PlanError(
            f"{t.name} spans {span_min:.0f} trace minutes; --minutes can be at most {most} "
            f"(after {warm_min} minutes of warm-up)"
        )
    arr = np.asarray(t.arrival_s, dtype=float) - float(t.arrival_s[0])
    keep = arr < (warm_min + dur_min) * 60
    arr, inp, out = arr[keep], t.input_tokens[keep], t.output_tokens[keep]
    ok = (inp > 0) & (out > 0)
    arr, inp, out = arr[ok], inp[ok], out[ok]
    rng = np.random.default_rng(mix.seed)
    rate_wall = arr.size / ((warm_min + dur_min) * 60) * speed
    p = min(1.0, mix.rps / rate_wall) if rate_wall > 0 else 1.0
    sel = rng.random(arr.size) < p
    arr, inp, out = arr[sel], inp[sel].astype(np.int64), out[sel].astype(np.int64)
    inp, out = _capped(mix, inp, out)
    shares = wl.power_law_shares(len(mix.models), mix.alpha)
    model = rng.choice(len(mix.models), size=arr.size, p=shares).astype(np.int32)
    warm_s = warm_min * 60 / speed
    planned = {}
    for i, m in enumerate(mix.models):
        mine = model == i
        planned[m.name] = _windows(
            mix,
            i,
            arr[mine] / speed,
            inp[mine],
            out[mine],
            0.0,
            (warm_min + dur_min) * 60 / speed,
            window,
        )
    desc = (
        f"{t.name}: its own arrivals (kept {p:.1%} of them for {mix.rps:g} req/s) from the "
        "start, no history (one hour of trace)"
    )
    return ReplayPlan(
        t.name,
        desc,
        tuple(m.name for m in mix.models),
        arr / speed - warm_s,
        model,
        inp,
        out,
        speed,
        window,
        day,
        warm_s,
        dur_min * 60 / speed,
        {m.name: ([], []) for m in mix.models},
        planned,
    )
