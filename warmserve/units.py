"""Sizes in bytes: the one parser and formatter every caller uses.

Scenario files, agent flags (``--simulate-gpus 8x80GiB``, ``--page-size``, ``--store-budget``)
and the CLI all read sizes with :func:`parse_size`, so "80GiB" means the same everywhere:

* an integer number of bytes (``1234``), or a string: a number and an optional unit;
* units are case-insensitive: ``B``; decimal ``KB MB GB TB`` (powers of 1000, as model cards
  quote weights: "12.55GB"); binary ``KiB MiB GiB TiB`` (powers of 1024, as GPUs are sold);
* fractions are exact (``Decimal``), rounded to the nearest byte; negative sizes are errors;
* ``require_unit=True`` refuses a bare number in a string — for values where a bare number is
  almost surely a mistake (``--simulate-gpus 8x80`` would be 80 *bytes* of GPU memory).

Pure: no I/O, importable from every layer.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["SIZE_UNITS", "SizeError", "format_size", "parse_size"]

SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_EXAMPLES = "e.g. 80GiB, 512MiB, 12.55GB or a number of bytes"


class SizeError(ValueError):
    """A size that cannot be read; the message names where it came from and what to write."""


def parse_size(value: Any, where: str = "size", *, require_unit: bool = False) -> int:
    """Bytes from an int or a size string (see the module docstring for the rules)."""
    if isinstance(value, bool):
        raise SizeError(f"{where}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{where}: negative size {value}")
        return value
    if not isinstance(value, str):
        raise SizeError(
            f"{where}: expected bytes (int) or a size string, got {type(value).__name__}"
        )
    if value.strip().startswith("-"):
        raise SizeError(f"{where}: negative size {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise SizeError(f"{where}: bad size {value!r} ({_EXAMPLES})")
    unit = m.group(2).upper()
    if not unit and require_unit:
        raise SizeError(
            f"{where}: {value!r} has no unit; write e.g. {m.group(1)}GiB (a bare number would "
            "mean bytes)"
        )
    unit = unit or "B"
    if unit not in SIZE_UNITS:
        raise SizeError(
            f"{where}: unknown unit {m.group(2)!r} in {value!r} (units: B, KB, MB, GB, TB, "
            "KiB, MiB, GiB, TiB)"
        )
    try:
        return int((Decimal(m.group(1)) * SIZE_UNITS[unit]).to_integral_value())
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only digits
        raise SizeError(f"{where}: bad size {value!r}") from exc


def format_size(n: float) -> str:
    """Bytes as a short binary-unit string (``1.5GiB``, ``512MiB``, ``0B``)."""
    n = float(n)
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def size_flag(n: int) -> str:
    """Bytes as a size flag reads them, exactly: the largest binary unit that divides ``n``
    (``2MiB``, ``16KiB``), else the number of bytes (``0``); :func:`parse_size` reads it back."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
