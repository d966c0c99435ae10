"""The test collector's file output is read while the collector writes it: a line without its
newline yet is left for the next read, never parsed half-written."""

from __future__ import annotations

import json

from warmserve.testing.otel import parse_lines


def _line(name: str) -> str:
    span = {"name": name, "traceId": "t" * 32, "spanId": "s" * 16}
    doc = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "warmserve-gateway"}}]},
        "scopeSpans": [{"spans": [span]}]}]}  # fmt: skip
    return json.dumps(doc)


def test_a_half_written_last_line_is_left_for_the_next_read() -> None:
    whole = _line("a") + "\n" + _line("b") + "\n"
    assert [s.name for s in parse_lines(whole)] == ["a", "b"]
    partial = whole + _line("c")[:40]
    assert [s.name for s in parse_lines(partial)] == ["a", "b"]
    assert [s.name for s in parse_lines(_line("c")[:40])] == []
    assert parse_lines(whole)[0].service == "warmserve-gateway"
