"""Plain-text tables for the command line: the one column formatter every view uses.

``warmserve plan``, ``warmserve status``, ``warmserve agent inspect`` and ``warmserve up``'s
summary print left-aligned columns separated by two spaces, like kubectl.  Pure: no I/O,
importable from every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["columns"]


def columns(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first is the header) as left-aligned columns, two spaces apart, with no
    trailing spaces; ``""`` for no rows.  Every row must have the header's length."""
    if not rows:
        return ""
    n = len(rows[0])
    for r in rows:
        if len(r) != n:
            raise ValueError(f"table row has {len(r)} cells, the header has {n}: {list(r)!r}")
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
