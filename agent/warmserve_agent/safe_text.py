"""Bounded, printable renderings of client input for error messages.

Refusals name what was wrong ("malformed slot id ...") so a person can act on them, but echoing the
input verbatim lets a caller make the agent build, log and send back megabytes, or put terminal
escape sequences into an operator's logs.  :func:`shown` renders one value (``repr``-escaped,
truncated with its length noted); :func:`bounded` is the last guard on a whole message before it
leaves the agent (control characters escaped, at most :data:`MAX_MESSAGE` characters).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MAX_MESSAGE = 1024
_LIST_ITEMS = 8


def shown(value: Any, limit: int = 64) -> str:
    """``value`` for a message: strings ``repr``-escaped, sequences abbreviated, at most about
    ``limit`` characters plus a note of the original size."""
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        head = ", ".join(shown(x, 16) for x in items[:_LIST_ITEMS])
        more = f", ... ({len(items)} in all)" if len(items) > _LIST_ITEMS else ""
        return f"[{head}{more}]"
    text = repr(value) if isinstance(value, str | bytes) else _printable(str(value))
    if len(text) <= limit:
        return text
    size = f"{len(value)} chars" if isinstance(value, str | bytes) else f"{len(text)} chars"
    return f"{text[: max(8, limit - 1)]}...({size})"


def shown_names(names: Iterable[str], limit: int = 10) -> str:
    """A comma-separated list of at most ``limit`` names (a store may hold thousands)."""
    items = list(names)
    head = ", ".join(shown(n, 48).strip("'") for n in items[:limit])
    return head + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def _printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def bounded(message: str, limit: int = MAX_MESSAGE) -> str:
    """The whole message made single-line and printable, cut to ``limit`` characters."""
    text = _printable(message)
    if len(text) <= limit:
        return text
    note = f" ...(truncated, {len(text)} chars)"
    return text[: limit - len(note)] + note
