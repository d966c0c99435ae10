"""Page-table records, their byte access and their invariants (:mod:`~warmserve_agent.memory`).

:class:`SlotPages` is one slot's virtual range on one GPU, :class:`GpuPool` one GPU's physical
pages; :class:`SlotData` gives :class:`~warmserve_agent.memory.MemoryManager` its byte access
(reads, writes and weight loads, refused on pages that are not live); :func:`check_tables` is the
invariant check tests run after every step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmserve_agent.memory_backend import MemoryBackend, PageTableError


@dataclass
class SlotPages:
    """One slot's virtual range on one GPU and its vpage -> ppage table."""

    gpu: int
    va_base: int
    num_vpages: int
    table: dict[int, int] = field(default_factory=dict)
    withdrawn: set[int] = field(default_factory=set)  # mapped, given up, not yet unmapped


@dataclass
class GpuPool:
    gpu: int
    memory_bytes: int
    num_pages: int
    free: list[int]
    owner: dict[int, tuple[str, int]] = field(default_factory=dict)  # ppage -> (slot, vpage)


class SlotData:
    """Byte access to mapped slot pages (mixed into the page tables, which provide the
    fields below)."""

    backend: MemoryBackend
    page_bytes: int
    _lock: threading.RLock
    _slot: Callable[[str], dict[int, SlotPages]]

    def write(self, slot_id: str, gpu: int, offset: int, data: memoryview | bytes) -> None:
        with self._lock:
            sp = self._slot(slot_id)[gpu]
            self._check_mapped(slot_id, sp, offset, len(data))
            va = sp.va_base + offset
        self.backend.write(gpu, va, data)

    def load(self, slot_id: str, gpu: int, items: Sequence[tuple[int, str, int, int]]) -> int:
        """Copy file ranges ``(slot offset, path, file offset, nbytes)`` into the slot on
        ``gpu`` (all must be mapped); returns the backend's ticket for :meth:`wait_loaded`."""
        with self._lock:
            sp = self._slot(slot_id)[gpu]
            ranges = []
            for off, path, foff, n in items:
                self._check_mapped(slot_id, sp, off, n)
                ranges.append((sp.va_base + off, path, foff, n))
        return self.backend.load_ranges(gpu, ranges)

    def wait_loaded(self, gpu: int, ticket: int) -> None:
        self.backend.wait_loaded(gpu, ticket)

    def read(self, slot_id: str, gpu: int, offset: int, nbytes: int) -> bytes:
        with self._lock:
            sp = self._slot(slot_id)[gpu]
            self._check_mapped(slot_id, sp, offset, nbytes)
            va = sp.va_base + offset
        return self.backend.read(gpu, va, nbytes)

    def _check_mapped(self, slot_id: str, sp: SlotPages, offset: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        first, last = offset // self.page_bytes, (offset + nbytes - 1) // self.page_bytes
        for v in range(first, last + 1):
            if v not in sp.table or v in sp.withdrawn:
                raise PageTableError(f"slot {slot_id} gpu {sp.gpu}: vpage {v} is not mapped")

    def physical_pages(self, slot_id: str, gpu: int, vstart: int, npages: int) -> list[int]:
        """The physical pages behind virtual pages [vstart, vstart+npages) (all must be mapped)."""
        with self._lock:
            table = self._slot(slot_id)[gpu].table
            try:
                return [table[v] for v in range(vstart, vstart + npages)]
            except KeyError as exc:
                raise PageTableError(f"slot {slot_id} gpu {gpu}: vpage {exc} not mapped") from None


def check_tables(
    gpus: Mapping[int, GpuPool],
    slots: Mapping[str, Mapping[int, SlotPages]],
    quota: Mapping[str, int],
    mm: Any,
) -> None:
    """Raise PageTableError if an invariant is broken: no page mapped twice or leaked, owner
    map = slot tables, withdrawn pages mapped, promises covered, backend MMU = page tables."""
    page = mm.page_bytes
    for g, pool in gpus.items():
        free = set(pool.free)
        if len(free) != len(pool.free):
            raise PageTableError(f"gpu {g}: a page is on the free list twice")
        mapped: dict[int, tuple[str, int]] = {}
        for sid, slot in slots.items():
            sp = slot.get(g)
            if sp is None:
                continue
            if not sp.withdrawn <= set(sp.table):
                raise PageTableError(f"gpu {g}: slot {sid} withdrew unmapped pages")
            for v, p in sp.table.items():
                if p in mapped:
                    raise PageTableError(
                        f"gpu {g}: page {p} mapped twice ({mapped[p]} and {(sid, v)})"
                    )
                mapped[p] = (sid, v)
        if mapped != pool.owner:
            raise PageTableError(f"gpu {g}: owner map disagrees with slot tables")
        if free & set(mapped):
            raise PageTableError(f"gpu {g}: a page is both free and mapped")
        promised = sum(q for s, q in quota.items() if g in slots[s])
        if promised > len(free) + mm.pending_pages(g):
            raise PageTableError(f"gpu {g}: {promised} pages promised, {len(free)} free")
        if len(free) + len(mapped) != pool.num_pages:
            raise PageTableError(
                f"gpu {g}: {pool.num_pages - len(free) - len(mapped)} pages leaked"
            )
        translation = getattr(mm.backend, "translation", None)
        if translation is not None:
            expect = {
                sp.va_base // page + v: p
                for slot in slots.values()
                if (sp := slot.get(g)) is not None
                for v, p in sp.table.items()
            }
            if translation(g) != expect:
                raise PageTableError(f"gpu {g}: backend mapping differs from page tables")
