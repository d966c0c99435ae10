"""A real OpenTelemetry Collector for the tracing tests and benches, and the spans it received.

The collector is the minimal one ``hack/testbin/build.sh otelcol`` builds (OTLP receiver + file
exporter, ``hack/testbin/otelcol/main.go``).  :class:`Collector` starts it on free loopback ports
(OTLP/HTTP and gRPC) with the file exporter writing one JSON document (an OTLP
``ExportTraceServiceRequest``) per line, and reads them back as flat :class:`Span` records.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmserve.testing.testbin import built_server

SERVER, CLIENT = 2, 3  # OTLP span kinds


@dataclass(frozen=True)
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent: str  # "" for a root span
    kind: int
    attributes: dict[str, Any]
    events: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id)
    error: bool = False
    start_ns: int = 0
    end_ns: int = 0

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


def parse_lines(text: str) -> list[Span]:
    """The spans of the collector's file exporter output (one JSON document per line).  A last
    line without its newline is still being written by the collector: left for the next read."""
    spans = []
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    for line in complete.splitlines():
        if not line.strip():
            continue
        for rs in json.loads(line).get("resourceSpans", []):
            service = _attrs(rs.get("resource", {}).get("attributes")).get("service.name", "")
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    spans.append(
                        Span(
                            name=s["name"],
                            service=service,
                            trace_id=s["traceId"],
                            span_id=s["spanId"],
                            parent=s.get("parentSpanId", ""),
                            kind=int(s.get("kind", 0)),
                            attributes=_attrs(s.get("attributes")),
                            events=tuple(e["name"] for e in s.get("events", [])),
                            links=tuple((k["traceId"], k["spanId"]) for k in s.get("links", [])),
                            error=s.get("status", {}).get("code") in (2, "STATUS_CODE_ERROR"),
                            start_ns=int(s.get("startTimeUnixNano", 0)),
                            end_ns=int(s.get("endTimeUnixNano", 0)),
                        )
                    )
    return spans


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Collector:
    """A running collector; ``endpoint`` is its OTLP/HTTP base URL."""

    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    http_port: int = 0
    grpc_port: int = 0
    _log: Any = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def out(self) -> Path:
        return self.workdir / "traces.jsonl"

    def start(self, timeout_s: float = 30.0) -> Collector:
        binary = built_server("otelcol")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a free port can be taken between the probe and the bind: retry
            self.http_port, self.grpc_port = _free_port(), _free_port()
            cfg = self.workdir / "config.yaml"
            cfg.write_text(
                "receivers:\n"
                "  otlp:\n"
                "    protocols:\n"
                f"      http: {{endpoint: '127.0.0.1:{self.http_port}'}}\n"
                f"      grpc: {{endpoint: '127.0.0.1:{self.grpc_port}'}}\n"
                "exporters:\n"
                f"  file: {{path: '{self.out}', flush_interval: 100ms}}\n"
                "service:\n"
                "  pipelines:\n"
                "    traces: {receivers: [otlp], exporters: [file]}\n"
            )
            log_path = self.workdir / "collector.log"
            self._log = log_path.open("wb")
            self.proc = subprocess.Popen(
                [str(binary), "--config", f"file:{cfg}"], stdout=self._log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if b"Everything is ready" in log_path.read_bytes():
                    return self
                time.sleep(0.05)
            self.stop()
            if b"address already in use" not in log_path.read_bytes():
                break
        raise RuntimeError(f"the collector did not start:\n{log_path.read_text()[-3000:]}")

    def check(self) -> None:
        """Raise if the collector has exited since it started (for
        :meth:`~warmserve.testing.procs.Procs.also_check`)."""
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.workdir / "collector.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the collector exited with status {self.proc.returncode}:\n{log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def spans(self) -> list[Span]:
        return parse_lines(self.out.read_text()) if self.out.exists() else []

    def wait_for(
        self, pred: Callable[[list[Span]], bool], what: str, timeout_s: float = 20.0
    ) -> list[Span]:
        """Spans received once ``pred`` holds for them (exporters batch every second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.spans()
            if pred(got):
                return got
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in got})
                raise AssertionError(f"not within {timeout_s}s: {what}; received {names}")
            time.sleep(0.1)


def collector(workdir: Path) -> Iterator[Collector]:
    """For a fixture: a started collector, stopped afterwards."""
    c = Collector(workdir).start()
    try:
        yield c
    finally:
        c.stop()


def in_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id]


def one(spans: list[Span], **match: Any) -> Span:
    """The single span whose fields equal ``match`` (``service``, ``name``, ``kind`` ...)."""
    got = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(got) == 1, (match, [(s.service, s.name) for s in spans])
    return got[0]
