"""Reading trace files: request-level traces and count series (``.csv`` or ``.csv.gz``).

This is the only place that touches trace files; :mod:`warmserve.policy.load` turns what is read
here into per-window load.  The format is detected from the header row:

==========================  ========================================================  =========
shape                       header                                                    measure
==========================  ========================================================  =========
request-level               ``arrival_s,input_tokens,output_tokens``                  requests
count series                ``start_s,model_or_function_id,count``                    count
BurstGPT tokens per second  ``start_s,model_or_function_id,tokens_per_s``             tokens/s
BurstGPT daily              ``start_s,model_or_function_id,count,total_tokens``       count
service-time requests       ``arrival_s,...,exec_time_s,...`` (e.g. Alibaba GenTD26)   requests
==========================  ========================================================  =========

A *service-time* trace is request-level but carries each request's measured execution time
instead of token counts (the Alibaba GenTD26 Stable-Diffusion trace: ``arrival_s`` first, an
``exec_time_s`` column among others).  Its requests are in flight for exactly that time, so no
speed profile is needed; only ``arrival_s`` and ``exec_time_s`` are read.

A name that is not an existing path is looked up among the traces bundled in
``warmserve/data/traces/`` (via :mod:`importlib.resources`, so it works from a wheel too).
Every problem raises :class:`TraceError`, whose message names the file, line and field.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from warmserve.policy.cluster import PolicyInputError

REQUEST_COLUMNS = ("arrival_s", "input_tokens", "output_tokens")
SERVICE_TIME_COLUMN = "exec_time_s"
SERIES_KEY_COLUMNS = ("start_s", "model_or_function_id")
BUNDLED_PACKAGE = "warmserve.data.traces"


class TraceError(PolicyInputError):
    """A trace file that cannot be read as one of the known formats; the message says why."""


@dataclass(frozen=True)
class RequestTrace:
    """One row per request: arrival (s, non-decreasing) and token counts."""

    name: str
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    # Measured time in flight per request (service-time traces); None: derive from tokens.
    duration_s: np.ndarray | None = None

    @property
    def span_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if self.arrival_s.size else 0.0


@dataclass(frozen=True)
class CountSeries:
    """Contiguous per-step values for one or more ids, all on the same time grid.

    ``measure`` is ``"count"`` (requests arriving per step) or ``"tokens_per_s"`` (already a rate).
    """

    name: str
    measure: str
    start_s: float
    step_s: float
    values: dict[str, np.ndarray]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self.values)

    @property
    def is_rate(self) -> bool:
        return self.measure == "tokens_per_s"

    @property
    def span_s(self) -> float:
        n = len(next(iter(self.values.values())))
        return n * self.step_s

    def select(self, series_id: str | None) -> tuple[str, np.ndarray]:
        """The values of one id, or (``series_id`` None) the sum over all ids.

        Returns the label to print and the values.
        """
        if series_id is None:
            if len(self.values) == 1:
                (only,) = self.values
                return only, self.values[only]
            ids = list(self.values)
            shown = ",".join(ids) if len(ids) <= 4 else ",".join(ids[:3]) + ",..."
            label = f"sum of {len(ids)} series ({shown})"
            return label, np.sum(list(self.values.values()), axis=0)
        if series_id not in self.values:
            raise TraceError(
                f"{self.name}: unknown series {series_id!r} (available: {', '.join(self.values)})"
            )
        return series_id, self.values[series_id]


def bundled_traces() -> list[str]:
    """File names of the traces shipped with warmserve."""
    root = resources.files(BUNDLED_PACKAGE)
    return sorted(
        p.name for p in root.iterdir() if p.name.endswith((".csv", ".csv.gz"))
    )


def _read_text(trace: str | Path) -> tuple[str, str]:
    """(display name, decoded text) of a path or a bundled trace name."""
    path = Path(trace)
    if path.is_file():
        data = path.read_bytes()
        name = str(path)
    else:
        bundled = resources.files(BUNDLED_PACKAGE)
        candidates = [str(trace)]
        if not str(trace).endswith((".csv", ".gz")):
            candidates += [f"{trace}.csv.gz", f"{trace}.csv"]
        for cand in candidates:
            if "/" in cand or cand.startswith("."):
                continue
            res = bundled.joinpath(cand)
            if res.is_file():
                data = res.read_bytes()
                name = cand
                break
        else:
            raise TraceError(
                f"trace not found: {trace} (not a file, nor a bundled trace: "
                f"{', '.join(bundled_traces())})"
            )
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceError(f"{name}: corrupt gzip data ({exc})") from None
    try:
        return name, data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{name}: not a UTF-8 CSV file") from None


def detect_format(header: list[str]) -> str:
    """``"request"``, ``"count"``, ``"tokens_per_s"`` or ``"daily"`` from a header row."""
    cols = tuple(h.strip() for h in header)
    if cols == REQUEST_COLUMNS:
        return "request"
    if cols[:1] == ("arrival_s",) and SERVICE_TIME_COLUMN in cols:
        return "service"
    if cols[:2] == SERIES_KEY_COLUMNS:
        rest = cols[2:]
        if rest == ("count",):
            return "count"
        if rest == ("tokens_per_s",):
            return "tokens_per_s"
        if rest == ("count", "total_tokens"):
            return "daily"
    raise TraceError(
        f"unrecognised columns {','.join(cols)!r}; expected {','.join(REQUEST_COLUMNS)} or "
        f"{','.join(SERIES_KEY_COLUMNS)},count (or ,tokens_per_s or ,count,total_tokens)"
    )


def _rows(name: str, text: str) -> tuple[list[str], Iterator[list[str]]]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise TraceError(f"{name}: empty file (no header row)")
    return header, reader


def _number(name: str, line: int, field: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{name}:{line}: {field} is not a number: {raw!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{name}:{line}: {field} must be finite (got {raw!r})")
    if value < 0:
        raise TraceError(f"{name}:{line}: {field} must be >= 0 (got {raw!r})")
    return value


def _read_requests(name: str, rows: Iterator[list[str]]) -> RequestTrace:
    arr: list[float] = []
    inp: list[float] = []
    out: list[float] = []
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != 3:
            raise TraceError(f"{name}:{line}: expected 3 fields, found {len(row)}")
        a = _number(name, line, "arrival_s", row[0])
        if arr and a < arr[-1]:
            raise TraceError(
                f"{name}:{line}: arrivals not sorted (arrival_s {row[0]} after {arr[-1]:g})"
            )
        arr.append(a)
        inp.append(_number(name, line, "input_tokens", row[1]))
        out.append(_number(name, line, "output_tokens", row[2]))
    if not arr:
        raise TraceError(f"{name}: no requests after the header")
    return RequestTrace(name, np.array(arr), np.array(inp), np.array(out))


def _read_series(name: str, fmt: str, rows: Iterator[list[str]], ncols: int) -> CountSeries:
    per_id: dict[str, list[tuple[float, float]]] = {}
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != ncols:
            raise TraceError(f"{name}:{line}: expected {ncols} fields, found {len(row)}")
        start = _number(name, line, "start_s", row[0])
        ident = row[1].strip()
        if not ident:
            raise TraceError(f"{name}:{line}: empty model_or_function_id")
        field = "tokens_per_s" if fmt == "tokens_per_s" else "count"
        per_id.setdefault(ident, []).append((start, _number(name, line, field, row[2])))
    if not per_id:
        raise TraceError(f"{name}: no rows after the header")
    grid: np.ndarray | None = None
    values: dict[str, np.ndarray] = {}
    for ident, pairs in per_id.items():
        starts = np.array([s for s, _ in pairs])
        if starts.size < 2:
            raise TraceError(f"{name}: series {ident!r} has fewer than 2 steps")
        steps = np.diff(starts)
        if np.any(steps <= 0):
            bad = int(np.argmax(steps <= 0)) + 1
            raise TraceError(
                f"{name}: series {ident!r} start_s not strictly increasing at {starts[bad]:g}"
            )
        if not np.allclose(steps, steps[0]):
            bad = int(np.argmax(~np.isclose(steps, steps[0]))) + 1
            raise TraceError(
                f"{name}: series {ident!r} is not contiguous: step {steps[0]:g} s, but a gap "
                f"ends at start_s {starts[bad]:g}"
            )
        if grid is None:
            grid = starts
        elif starts.shape != grid.shape or not np.allclose(starts, grid):
            raise TraceError(f"{name}: series {ident!r} is not on the same time grid as the others")
        values[ident] = np.array([v for _, v in pairs])
    assert grid is not None
    measure = "tokens_per_s" if fmt == "tokens_per_s" else "count"
    return CountSeries(name, measure, float(grid[0]), float(grid[1] - grid[0]), values)


def load_trace(trace: str | Path) -> RequestTrace | CountSeries:
    """Read a trace file (path or bundled name), detecting its format from the header."""
    name, text = _read_text(trace)
    header, rows = _rows(name, text)
    try:
        fmt = detect_format(header)
    except TraceError as exc:
        raise TraceError(f"{name}: {exc}") from None
    if fmt == "request":
        return _read_requests(name, rows)
    if fmt == "service":
        return _read_service_times(name, rows, [h.strip() for h in header])
    return _read_series(name, fmt, rows, len(header))


def _read_service_times(name: str, rows: Iterator[list[str]], header: list[str]) -> RequestTrace:
    """A request-level trace with measured execution times (see the module docstring)."""
    col = header.index(SERVICE_TIME_COLUMN)
    arr: list[float] = []
    dur: list[float] = []
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise TraceError(f"{name}:{line}: expected {len(header)} fields, found {len(row)}")
        a = _number(name, line, "arrival_s", row[0])
        if arr and a < arr[-1]:
            raise TraceError(
                f"{name}:{line}: arrivals not sorted (arrival_s {row[0]} after {arr[-1]:g})"
            )
        arr.append(a)
        dur.append(_number(name, line, SERVICE_TIME_COLUMN, row[col]))
    if not arr:
        raise TraceError(f"{name}: no requests after the header")
    zeros = np.zeros(len(arr))
    return RequestTrace(name, np.array(arr), zeros, zeros, duration_s=np.array(dur))
