"""Plain-text tables for the command line: the one column formatter every view uses.

``warmserve plan``, ``warmserve status``, ``warmserve agent inspect``, ``warmserve predict`` and
``warmserve up``'s summary print columns separated by two spaces, like kubectl.  Pure: no I/O,
importable from every layer.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

__all__ = ["columns"]


def columns(rows: Sequence[Sequence[str]], right: Container[int] = ()) -> str:
    """``rows`` (the first is the header) as columns two spaces apart, with no trailing spaces;
    ``""`` for no rows.  Left-aligned, except the column indices in ``right`` (numbers).
    Every row must have the header's length."""
    if not rows:
        return ""
    n = len(rows[0])
    for r in rows:
        if len(r) != n:
            raise ValueError(f"table row has {len(r)} cells, the header has {n}: {list(r)!r}")
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    )
