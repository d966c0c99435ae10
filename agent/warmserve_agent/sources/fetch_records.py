"""The model fetcher's records: fetch states and statuses, its failure, store usage, file names.

What the fetcher (:mod:`~warmserve_agent.sources.fetcher`) shares with its parts and with the
agent's wire conversions (:mod:`~warmserve_agent.sources.wire`) and metrics; no behaviour beyond
a directory's size on disk.  :class:`FetchTable` is the one mutable record its parts share: the
fetches in progress and finished, the store's generation and the counters, under one lock.  A
fetched model carries :data:`MANIFEST` (its source, revision and file list); files land in
:data:`STAGING` (one directory per model, kept after a failure so the next fetch resumes) and
replaced copies leave through :data:`TRASH`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

MANIFEST = ".warmserve-source.json"
STAGING = ".warmserve-staging"
TRASH = ".warmserve-trash"


class FetchState(StrEnum):
    LISTING = "listing"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"


class FetchFailed(Exception):
    """A fetch that did not produce the model; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class FetchStatus:
    model: str
    source: str
    state: FetchState
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0
    eta_s: float = 0.0
    attempt: int = 0
    message: str = ""
    started_unix: float = 0.0
    finished_unix: float = 0.0


@dataclass
class Fetch:
    """One fetch in progress (or finished); callers ``wait`` on it."""

    status: FetchStatus
    staging: Path | None = None
    download_started: float = 0.0
    resumed_bytes: int = 0  # bytes a previous attempt left in the staging directory
    error: FetchFailed | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


@dataclass(frozen=True, slots=True)
class StoreUsage:
    used_bytes: int
    budget_bytes: int
    evictions: int


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def finished_event() -> threading.Event:
    """The ``done`` event of a fetch that has nothing to do (the model is present)."""
    ev = threading.Event()
    ev.set()
    return ev


class FetchTable:
    """Fetches in progress and recently finished, the store's generation and the fetcher's
    counters; ``lock`` orders every change of them (and the budget's pins)."""

    KEEP_FINISHED = 20  # finished fetches remembered for statuses

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active: dict[str, Fetch] = {}
        self.recent: dict[str, Fetch] = {}  # finished, newest last; for status
        self.generation = 0  # changes when the store's content changes (fetch end, eviction)
        self.stats: Counter[str] = Counter()  # bytes, ok, failed, retries:<reason>, evictions

    def finished(self, fetch: Fetch) -> None:
        """Move ``fetch`` from the active ones to the finished ones; caller holds ``lock``."""
        model = fetch.status.model
        self.active.pop(model, None)
        self.recent.pop(model, None)
        self.generation += 1
        self.recent[model] = fetch
        while len(self.recent) > self.KEEP_FINISHED:
            self.recent.pop(next(iter(self.recent)))

    def statuses(self) -> list[FetchStatus]:
        """Fetches in progress, then the last finished ones (done in the last minute; failed)."""
        now = time.time()
        with self.lock:
            act = [f.status for f in self.active.values()]
            old = [
                f.status
                for f in self.recent.values()
                if f.status.state == FetchState.FAILED or now - f.status.finished_unix < 60
            ]
        return act + old

    def reserved_bytes(self, other_than: str = "") -> int:
        """Bytes the fetches in progress will take (all, or all but ``other_than``'s)."""
        return sum(f.status.bytes_total for m, f in self.active.items() if m != other_than)
