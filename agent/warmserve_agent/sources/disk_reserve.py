"""The store's disk reserve: free space on the store's filesystem that a fetch never takes.

A fetch is refused (``RESOURCE_EXHAUSTED``, naming the numbers) when it would leave less than
the reserve free, checked before the download (after evicting what may be evicted,
:mod:`~warmserve_agent.sources.store_budget`) and again every :data:`CHECK_EVERY` bytes while it
writes (:class:`DiskGuard`), since other writers share the disk.  ``--store-reserve`` (Helm
``agent.modelCache.reserve``) sets it: a size (``50GiB``), a share (``20%``) or ``0`` (none).

**Default: the larger of 15 % of the filesystem and 10 GiB.**  The store usually shares the
node's root filesystem with the kubelet and the container runtime.  The kubelet's default hard
eviction thresholds are ``nodefs.available<10%`` and ``imagefs.available<15%``, and its image
garbage collection starts at 85 % use: a model cache taking the disk below 15 % free would set
off image garbage collection or evict every pod on the node (serving engines included) under
DiskPressure.  The floor keeps room on small disks for what else arrives (an engine image is
several GiB; logs), where 15 % would be a few GiB.  A store on a disk of its own can set a
smaller reserve.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from warmserve.units import SizeError, format_size, parse_size
from warmserve_agent.sources.base import SourceError
from warmserve_agent.sources.fetch_records import FetchFailed

GiB = 1024**3
CHECK_EVERY = 64 * 1024**2  # bytes written between two looks at the disk during a download
_PERCENT_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*%$")


@dataclass(frozen=True, slots=True)
class DiskReserve:
    """Free space kept: the larger of ``fraction`` of the filesystem and ``floor_bytes``."""

    fraction: float = 0.15
    floor_bytes: int = 10 * GiB

    def bytes_for(self, total: int) -> int:
        return max(int(total * self.fraction), self.floor_bytes)

    def describe(self, total: int) -> str:
        keep = format_size(self.bytes_for(total))
        share = f"{self.fraction * 100:g}% of {format_size(total)}"
        if self.fraction and self.floor_bytes:
            return f"{keep} reserve (the larger of {share} and {format_size(self.floor_bytes)})"
        if self.fraction:
            return f"{keep} reserve ({share})"
        return f"{keep} reserve" if self.floor_bytes else "no reserve"


DEFAULT_RESERVE = DiskReserve()
NO_RESERVE = DiskReserve(0.0, 0)


def parse_reserve(text: str) -> DiskReserve:
    """``""``: the default; ``"N%"``: a share of the filesystem; a size (``"50GiB"``); ``"0"``:
    none.  SizeError (a ValueError) with the accepted forms otherwise."""
    text = text.strip()
    if not text:
        return DEFAULT_RESERVE
    m = _PERCENT_RE.match(text)
    if m:
        pct = float(m.group(1))
        if not 0 <= pct < 100:
            raise SizeError(f"--store-reserve {text!r}: a share is 0-99%")
        return DiskReserve(pct / 100, 0)
    try:
        return DiskReserve(0.0, parse_size(text, "--store-reserve"))
    except SizeError as exc:
        raise SizeError(f"{exc}; or a share such as 15%, or 0 for none") from None


@dataclass(frozen=True, slots=True)
class DiskSpace:
    total: int
    free: int  # available to the agent (not root's reserved blocks)


def disk_space(path: Path) -> DiskSpace:
    st = os.statvfs(path)
    return DiskSpace(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


StatFn = Callable[[Path], DiskSpace]


def reserve_refusal(
    model: str, need: int, space: DiskSpace, reserve: DiskReserve, when: str
) -> FetchFailed:
    keep = reserve.bytes_for(space.total)
    return FetchFailed(
        "RESOURCE_EXHAUSTED",
        f"{model} needs {format_size(need)} more {when}, but the store's filesystem has "
        f"{format_size(space.free)} free of {format_size(space.total)} and keeps a "
        f"{reserve.describe(space.total)} (--store-reserve), so only "
        f"{format_size(max(space.free - keep, 0))} is usable; free disk, or lower "
        "agent.modelCache.reserve",
    )


class DiskGuard:
    """Watches one download: every :data:`CHECK_EVERY` bytes written, what is left to write
    must still fit above the reserve, or the download stops (``RESOURCE_EXHAUSTED``)."""

    def __init__(
        self,
        root: Path,
        reserve: DiskReserve,
        model: str,
        need: int,
        *,
        stat: StatFn = disk_space,
        every: int = CHECK_EVERY,
    ) -> None:
        self.root = root
        self.reserve = reserve
        self.model = model
        self.need = need
        self.stat = stat
        self.every = every
        self.written = 0
        self._checked = 0
        self._lock = threading.Lock()
        self.failed: FetchFailed | None = None

    def wrote(self, n: int) -> None:
        with self._lock:
            self.written += n
            due = self.failed is not None or self.written - self._checked >= self.every
            if due:
                self._checked = self.written
        if due:
            self.check()

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed
        left = max(self.need - self.written, 0)
        space = self.stat(self.root)
        if space.free - left < self.reserve.bytes_for(space.total):
            self.failed = reserve_refusal(
                self.model, left, space, self.reserve, "while downloading"
            )
            raise self.failed


class GuardedFile:
    """The file a source writes one listed file into: at most ``limit`` bytes in all (a source
    sending more than it listed is cut off), each write reported to the guard."""

    def __init__(
        self, raw: BinaryIO, start: int, limit: int, guard: DiskGuard | None, what: str
    ) -> None:
        self.raw = raw
        self.pos = start
        self.limit = limit
        self.guard = guard
        self.what = what

    def write(self, data: bytes) -> int:
        n = len(data)
        if self.pos + n > self.limit:
            raise SourceError(
                f"{self.what}: the source sent more than the {self.limit} bytes it listed",
                retryable=True,
                checksum=True,
            )
        if self.guard is not None:
            self.guard.wrote(n)
        self.raw.write(data)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = self.raw.seek(offset, whence)
        return self.pos

    def truncate(self, size: int | None = None) -> int:
        return self.raw.truncate(size)

    def flush(self) -> None:
        self.raw.flush()
