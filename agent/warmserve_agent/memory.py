"""Prewarm slots over a per-GPU page pool (WarmServe §4.2, Figure 6).

Each GPU's memory is a pool of fixed-size physical pages (2 MiB, the CUDA VMM granularity).
Every prewarm slot reserves a virtual range as large as the whole GPU on each GPU of its group;
a model's weights sit at the start of its slot, and activation maps every page no other slot
holds right after the weights as KV cache, so the engine sees weights + KV as one contiguous
virtual range (Figure 6a).  During a grace period, KV pages the instance gives back are returned
to the pool and mapped into another model's slot (Figure 6b).

This module keeps the page tables (which physical page backs which virtual page of which slot)
and enforces the invariants the agent relies on:

* a physical page is free or mapped in exactly one slot at one virtual page (never twice);
* no page leaks: free + mapped = total on every GPU;
* the backend's view of the mapping equals ours (checked by :meth:`MemoryManager.check`).

The physical operations go through a :class:`MemoryBackend`: ``simulated`` (shared-memory files,
runs in CI) or ``cuda`` (the CUDA driver VMM API through cuda-python).  Both see the same calls
in the same order, so the page-table logic is tested once.

Every mutating method validates everything first and then applies, so a refused call changes
nothing (no half-applied mappings).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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


@dataclass
class SlotPages:
    """One slot's virtual range on one GPU and its vpage -> ppage table."""

    gpu: int
    va_base: int
    num_vpages: int
    table: dict[int, int] = field(default_factory=dict)


@dataclass
class GpuPool:
    gpu: int
    memory_bytes: int
    num_pages: int
    free: list[int]
    owner: dict[int, tuple[str, int]] = field(default_factory=dict)  # ppage -> (slot, vpage)


class MemoryManager:
    """Page tables of every slot on every GPU of one node (thread-safe)."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self.page_bytes = backend.page_bytes
        self._lock = threading.RLock()
        self._gpus: dict[int, GpuPool] = {}
        self._slots: dict[str, dict[int, SlotPages]] = {}
        # Pages promised to a slot whose loader maps them lazily, page by page just ahead of the
        # copies (the §4.2 map/copy pipeline).  Other slots cannot take promised pages, so a
        # prewarm admitted with enough memory never runs out part-way.
        self._quota: dict[str, int] = {}

    # ---- GPUs ----------------------------------------------------------------------------
    def add_gpu(self, gpu: int, memory_bytes: int) -> None:
        with self._lock:
            if gpu in self._gpus:
                raise PageTableError(f"gpu {gpu} already added")
            n = self.backend.open_gpu(gpu, memory_bytes)
            # LIFO free list popping the lowest page first keeps layouts easy to read in tests.
            self._gpus[gpu] = GpuPool(gpu, memory_bytes, n, list(range(n - 1, -1, -1)))

    def add_gpus(self, sizes: Mapping[int, int]) -> None:
        """Open several GPUs **in parallel**: creating ~40k page handles per
        80 GB GPU takes seconds each, so an 8-GPU node opened one by one nears the liveness
        probe's limit.  All-or-nothing: if one GPU fails, the others are closed again."""
        with self._lock:
            dup = [g for g in sizes if g in self._gpus]
            if dup:
                raise PageTableError(f"gpu {dup[0]} already added")
        if not sizes:
            return
        with ThreadPoolExecutor(max_workers=len(sizes), thread_name_prefix="open-gpu") as ex:
            futs = {g: ex.submit(self.backend.open_gpu, g, mem) for g, mem in sizes.items()}
        errors = {g: exc for g, f in futs.items() if (exc := f.exception()) is not None}
        if errors:
            # The backend releases a GPU whose open failed; the ones that opened stay open in
            # the backend and are released with it (MemoryManager.close / backend.close).
            raise errors[min(errors)]
        with self._lock:
            for g, mem in sizes.items():
                n = futs[g].result()
                self._gpus[g] = GpuPool(g, mem, n, list(range(n - 1, -1, -1)))

    @property
    def gpus(self) -> list[int]:
        return sorted(self._gpus)

    def num_pages(self, gpu: int) -> int:
        return self._pool(gpu).num_pages

    def free_pages(self, gpu: int) -> int:
        """Physical pages not mapped anywhere (some may be promised to a loading slot)."""
        with self._lock:
            return len(self._pool(gpu).free)

    def available_pages(self, gpu: int) -> int:
        """Free pages not promised to any slot: what a new prewarm or activation may take."""
        with self._lock:
            promised = sum(q for s, q in self._quota.items() if gpu in self._slots[s])
            return len(self._pool(gpu).free) - promised

    def promise(self, slot_id: str, npages: int) -> None:
        """Set aside ``npages`` free pages on each GPU of the slot for its lazy mapping."""
        with self._lock:
            slot = self._slot(slot_id)
            extra = npages - self._quota.get(slot_id, 0)
            for g in slot:
                if self.available_pages(g) < extra:
                    raise OutOfPages(
                        f"gpu {g}: {extra} pages needed, {self.available_pages(g)} available"
                    )
            if npages > 0:
                self._quota[slot_id] = npages
            else:
                self._quota.pop(slot_id, None)

    def promised(self, slot_id: str) -> int:
        return self._quota.get(slot_id, 0)

    def release_promise(self, slot_id: str) -> None:
        with self._lock:
            self._quota.pop(slot_id, None)

    def _pool(self, gpu: int) -> GpuPool:
        try:
            return self._gpus[gpu]
        except KeyError:
            raise PageTableError(f"gpu {gpu} is not managed here") from None

    # ---- slots ---------------------------------------------------------------------------
    def create_slot(self, slot_id: str, gpus: Iterable[int]) -> None:
        """Reserve a virtual range the size of the whole GPU on each GPU of the group."""
        with self._lock:
            if slot_id in self._slots:
                raise PageTableError(f"slot {slot_id} exists")
            gpus = list(gpus)
            for g in gpus:
                self._pool(g)
            pages: dict[int, SlotPages] = {}
            try:
                for g in gpus:
                    pool = self._gpus[g]
                    va = self.backend.reserve(g, pool.num_pages * self.page_bytes)
                    pages[g] = SlotPages(g, va, pool.num_pages)
            except Exception:
                for sp in pages.values():
                    size = sp.num_vpages * self.page_bytes
                    self.backend.free_reservation(sp.gpu, sp.va_base, size)
                raise
            self._slots[slot_id] = pages

    def has_slot(self, slot_id: str) -> bool:
        return slot_id in self._slots

    def slot_gpus(self, slot_id: str) -> list[int]:
        return sorted(self._slot(slot_id))

    def _slot(self, slot_id: str) -> dict[int, SlotPages]:
        try:
            return self._slots[slot_id]
        except KeyError:
            raise PageTableError(f"unknown slot {slot_id}") from None

    def va_base(self, slot_id: str, gpu: int) -> int:
        return self._slot(slot_id)[gpu].va_base

    def mapped_count(self, slot_id: str, gpu: int) -> int:
        with self._lock:
            return len(self._slot(slot_id)[gpu].table)

    def mapped_prefix(self, slot_id: str, gpu: int) -> int:
        """Length of the contiguous run of mapped pages starting at virtual page 0."""
        with self._lock:
            table = self._slot(slot_id)[gpu].table
            n = 0
            while n in table:
                n += 1
            return n

    def map_range(self, slot_id: str, vstart: int, npages: int) -> None:
        """Map virtual pages [vstart, vstart+npages) of the slot on every GPU of its group to
        free physical pages.  All-or-nothing: checks every GPU before touching any."""
        if npages <= 0:
            return
        with self._lock:
            slot = self._slot(slot_id)
            for g, sp in slot.items():
                if vstart < 0 or vstart + npages > sp.num_vpages:
                    raise PageTableError(
                        f"slot {slot_id}: pages [{vstart}, {vstart + npages}) outside its range"
                    )
                clash = [v for v in range(vstart, vstart + npages) if v in sp.table]
                if clash:
                    raise PageTableError(f"slot {slot_id} gpu {g}: vpage {clash[0]} already mapped")
                own = min(npages, self._quota.get(slot_id, 0))
                if self.available_pages(g) < npages - own:
                    raise OutOfPages(
                        f"gpu {g}: {npages} pages needed, {self.available_pages(g) + own} available"
                    )
            if slot_id in self._quota:
                left = self._quota[slot_id] - npages
                if left > 0:
                    self._quota[slot_id] = left
                else:
                    del self._quota[slot_id]
            for g, sp in slot.items():
                pool = self._gpus[g]
                ppages = [pool.free.pop() for _ in range(npages)]
                try:
                    self.backend.map(g, sp.va_base + vstart * self.page_bytes, ppages)
                except Exception:
                    pool.free.extend(reversed(ppages))
                    raise
                for i, p in enumerate(ppages):
                    sp.table[vstart + i] = p
                    pool.owner[p] = (slot_id, vstart + i)

    def ensure_mapped(self, slot_id: str, upto_vpage: int) -> int:
        """Map whatever is missing of virtual pages [0, upto_vpage); returns pages mapped now."""
        with self._lock:
            slot = self._slot(slot_id)
            start = min(self.mapped_prefix(slot_id, g) for g in slot)
            need = upto_vpage - start
            if need <= 0:
                return 0
            self.map_range(slot_id, start, need)
            return need

    def unmap_range(self, slot_id: str, vstart: int, npages: int) -> int:
        """Unmap the mapped pages among [vstart, vstart+npages) and return them to the pool."""
        freed = 0
        with self._lock:
            slot = self._slot(slot_id)
            for g, sp in slot.items():
                pool = self._gpus[g]
                run: list[int] = sorted(v for v in range(vstart, vstart + npages) if v in sp.table)
                # Unmap maximal contiguous runs (one backend call each).
                i = 0
                while i < len(run):
                    j = i
                    while j + 1 < len(run) and run[j + 1] == run[j] + 1:
                        j += 1
                    self.backend.unmap(g, sp.va_base + run[i] * self.page_bytes, j - i + 1)
                    for v in run[i : j + 1]:
                        p = sp.table.pop(v)
                        del pool.owner[p]
                        pool.free.append(p)
                        freed += 1
                    i = j + 1
        return freed

    def map_all_free(self, slot_id: str, vstart: int) -> int:
        """Map every free page of each GPU after ``vstart`` (activation's KV cache, Fig. 6a).

        GPUs of a group may differ in free pages; the KV range is sized by the smallest so
        every shard has the same KV capacity.  Returns pages mapped per GPU.
        """
        with self._lock:
            slot = self._slot(slot_id)
            n = min(self.available_pages(g) for g in slot)
            n = min(n, min(sp.num_vpages for sp in slot.values()) - vstart)
            self.map_range(slot_id, vstart, n)
            return n

    def destroy_slot(self, slot_id: str) -> int:
        """Unmap every page of the slot, free them and release its virtual range."""
        with self._lock:
            slot = self._slot(slot_id)
            self._quota.pop(slot_id, None)
            freed = self.unmap_range(slot_id, 0, max(sp.num_vpages for sp in slot.values()))
            for sp in slot.values():
                self.backend.free_reservation(sp.gpu, sp.va_base, sp.num_vpages * self.page_bytes)
            del self._slots[slot_id]
            return freed

    def drop_gpu(self, gpu: int) -> list[str]:
        """The memory of ``gpu`` is gone (its owning worker died): forget every slot touching
        it.  Their pages on *other* GPUs are unmapped and freed normally; nothing is asked of
        ``gpu``'s backend.  Returns the dropped slot ids.  Call :meth:`reopen_gpu` once a new
        owner is in place."""
        with self._lock:
            pool = self._pool(gpu)
            dropped = [sid for sid, slot in self._slots.items() if gpu in slot]
            for sid in dropped:
                slot = self._slots[sid]
                slot.pop(gpu)
                self._quota.pop(sid, None)
                for g, sp in slot.items():
                    other = self._gpus[g]
                    run = sorted(sp.table)
                    for v in run:
                        self.backend.unmap(g, sp.va_base + v * self.page_bytes, 1)
                        p = sp.table.pop(v)
                        del other.owner[p]
                        other.free.append(p)
                    self.backend.free_reservation(g, sp.va_base, sp.num_vpages * self.page_bytes)
                del self._slots[sid]
            pool.owner.clear()
            pool.free = []
            pool.num_pages = 0  # unusable until reopened
            return dropped

    def reopen_gpu(self, gpu: int) -> None:
        """Give a dropped GPU a fresh, empty page pool through its (new) backend owner."""
        with self._lock:
            pool = self._pool(gpu)
            n = self.backend.open_gpu(gpu, pool.memory_bytes)
            self._gpus[gpu] = GpuPool(gpu, pool.memory_bytes, n, list(range(n - 1, -1, -1)))

    # ---- data ----------------------------------------------------------------------------
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
            if v not in sp.table:
                raise PageTableError(f"slot {slot_id} gpu {sp.gpu}: vpage {v} is not mapped")

    def physical_pages(self, slot_id: str, gpu: int, vstart: int, npages: int) -> list[int]:
        """The physical pages behind virtual pages [vstart, vstart+npages) (all must be mapped)."""
        with self._lock:
            table = self._slot(slot_id)[gpu].table
            try:
                return [table[v] for v in range(vstart, vstart + npages)]
            except KeyError as exc:
                raise PageTableError(f"slot {slot_id} gpu {gpu}: vpage {exc} not mapped") from None

    # ---- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise PageTableError if any invariant is broken (used by tests and after recovery)."""
        with self._lock:
            for g, pool in self._gpus.items():
                free = set(pool.free)
                if len(free) != len(pool.free):
                    raise PageTableError(f"gpu {g}: a page is on the free list twice")
                mapped: dict[int, tuple[str, int]] = {}
                for sid, slot in self._slots.items():
                    sp = slot.get(g)
                    if sp is None:
                        continue
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
                promised = sum(q for s, q in self._quota.items() if g in self._slots[s])
                if promised > len(free):
                    raise PageTableError(f"gpu {g}: {promised} pages promised, {len(free)} free")
                if len(free) + len(mapped) != pool.num_pages:
                    raise PageTableError(
                        f"gpu {g}: {pool.num_pages - len(free) - len(mapped)} pages leaked"
                    )
                translation = getattr(self.backend, "translation", None)
                if translation is not None:
                    expect = {
                        sp.va_base // self.page_bytes + v: p
                        for slot in self._slots.values()
                        if (sp := slot.get(g)) is not None
                        for v, p in sp.table.items()
                    }
                    if translation(g) != expect:
                        raise PageTableError(f"gpu {g}: backend mapping differs from page tables")

    def close(self) -> None:
        """Unmap every slot, then release the backend (handles must not be freed mapped)."""
        with self._lock:
            for slot_id in list(self._slots):
                self.destroy_slot(slot_id)
        self.backend.close()


def pages_for(nbytes: int, page_bytes: int = PAGE_BYTES) -> int:
    return -(-nbytes // page_bytes)
