"""What the page tables (:mod:`~warmserve_agent.memory`) ask of a GPU memory backend, and their
refusals.

The physical operations go through a :class:`MemoryBackend`: ``simulated`` (shared-memory files,
runs in CI), ``cuda`` (the CUDA driver VMM API through cuda-python), or either executed by the
GPU's worker process (``backends/workers.py``).  All see the same calls in the same order, so the
page-table logic is tested once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from warmserve.policy.cluster import PAGE_BYTES


class PageError(Exception):
    """Base class for page-table refusals (the caller maps them to gRPC codes)."""


class OutOfPages(PageError):
    """Not enough free physical pages on some GPU."""


class PageTableError(PageError):
    """An operation that would break the page-table invariants (a bug in the caller)."""


class MemoryBackend(Protocol):
    """Physical memory operations on one node's GPUs (one implementation per backend)."""

    name: str
    page_bytes: int

    def open_gpu(self, gpu: int, memory_bytes: int) -> int:
        """Prepare ``gpu`` (create its page pool) and return its number of physical pages."""

    def reserve(self, gpu: int, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space on ``gpu``; return the base."""

    def free_reservation(self, gpu: int, va: int, size: int) -> None: ...

    def map(self, gpu: int, va: int, ppages: Sequence[int]) -> None:
        """Map consecutive virtual pages starting at ``va`` onto physical pages ``ppages``
        and make them readable/writable."""

    def unmap(self, gpu: int, va: int, npages: int) -> None:
        """Unmap ``npages`` consecutive virtual pages starting at ``va``."""

    def write(self, gpu: int, va: int, data: memoryview | bytes) -> None:
        """Copy host bytes to mapped virtual addresses (small writes; weights use
        ``load_ranges``)."""

    def load_ranges(self, gpu: int, ranges: Sequence[tuple[int, str, int, int]]) -> int:
        """Copy file ranges ``(va, path, offset, nbytes)`` to mapped virtual addresses, read by
        the process that owns the memory through its staging ring; returns a ticket.  Copies
        may still be in flight on return."""

    def wait_loaded(self, gpu: int, ticket: int) -> None:
        """Block until the copies of ``ticket`` landed (raises if they failed)."""

    def read(self, gpu: int, va: int, nbytes: int) -> bytes: ...

    def close(self) -> None: ...


def pages_for(nbytes: int, page_bytes: int = PAGE_BYTES) -> int:
    return -(-nbytes // page_bytes)


def runs(vpages: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``(first, count)`` of consecutive virtual pages in sorted ``vpages``."""
    out: list[tuple[int, int]] = []
    for v in vpages:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out
