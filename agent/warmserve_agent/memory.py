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

Pages given up are unmapped off the critical path (:mod:`~warmserve_agent.memory_deferred`).

The physical operations go through a :class:`~warmserve_agent.memory_backend.MemoryBackend`.
Every mutating method validates everything first and then applies, so a refused call changes
nothing (no half-applied mappings).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from warmserve_agent.memory_backend import (
    MemoryBackend,
    OutOfPages,
    PageError,
    PageTableError,
    pages_for,
    runs,
)
from warmserve_agent.memory_deferred import DeferredUnmap
from warmserve_agent.memory_tables import GpuPool, SlotData, SlotPages, check_tables

__all__ = [
    "GpuPool",
    "MemoryBackend",
    "MemoryManager",
    "OutOfPages",
    "PageError",
    "PageTableError",
    "SlotPages",
    "pages_for",
]


class MemoryManager(DeferredUnmap, SlotData):
    """Page tables of every slot on every GPU of one node (thread-safe)."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self.page_bytes = backend.page_bytes
        self._lock = threading.RLock()
        self._gpus: dict[int, GpuPool] = {}
        self._slots: dict[str, dict[int, SlotPages]] = {}
        # Slots given up whose pages are still being unmapped; their virtual ranges are freed
        # once empty.  Keyed apart from live slots (a slot id may be reused meanwhile).
        self._retired: dict[str, dict[int, SlotPages]] = {}
        self._retired_seq = 0
        # Pages promised to a slot whose loader maps them lazily, page by page just ahead of the
        # copies (the §4.2 map/copy pipeline).  Other slots cannot take promised pages, so a
        # prewarm admitted with enough memory never runs out part-way.
        self._quota: dict[str, int] = {}

    # ---- GPUs ----------------------------------------------------------------------------
    def add_gpu(self, gpu: int, memory_bytes: int) -> None:
        self.add_gpus({gpu: memory_bytes})

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
        """Free or withdrawn pages not promised to any slot: what a new prewarm or activation
        may take (withdrawn pages are unmapped first, when needed)."""
        with self._lock:
            promised = sum(q for s, q in self._quota.items() if gpu in self._slots[s])
            return len(self._pool(gpu).free) + self.pending_pages(gpu) - promised

    def promise(self, slot_id: str, npages: int) -> None:
        """Set aside ``npages`` available pages on each GPU of the slot for its lazy mapping."""
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
        """Pages mapped in the slot on ``gpu``, withdrawn ones included."""
        with self._lock:
            return len(self._slot(slot_id)[gpu].table)

    def live_vpages(self, slot_id: str, gpu: int) -> set[int]:
        """Virtual pages mapped and not withdrawn: what the slot's users may touch."""
        with self._lock:
            sp = self._slot(slot_id)[gpu]
            return set(sp.table) - sp.withdrawn

    def mapped_prefix(self, slot_id: str, gpu: int) -> int:
        """Length of the contiguous run of live pages starting at virtual page 0."""
        with self._lock:
            sp = self._slot(slot_id)[gpu]
            n = 0
            while n in sp.table and n not in sp.withdrawn:
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
            for g in slot:  # withdrawn pages become free pages first where needed
                short = npages - len(self._gpus[g].free)
                if short > 0:
                    self.flush(g, short)
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

    def map_pages(self, slot_id: str, vpages: Iterable[int]) -> int:
        """Make ``vpages`` of the slot live on every GPU of its group: withdrawn ones are
        restored as they are, the others mapped (one backend call per run).  Returns the pages
        mapped now (restored ones not counted)."""
        with self._lock:
            want = sorted(set(vpages))
            self.restore(slot_id, want)
            sp = next(iter(self._slot(slot_id).values()))
            missing = [v for v in want if v not in sp.table]
            for first, n in runs(missing):
                self.map_range(slot_id, first, n)
            return len(missing)

    def ensure_mapped(self, slot_id: str, upto_vpage: int) -> int:
        """Map whatever is missing of virtual pages [0, upto_vpage); returns pages mapped now."""
        with self._lock:
            slot = self._slot(slot_id)
            start = min(self.mapped_prefix(slot_id, g) for g in slot)
            if upto_vpage <= start:
                return 0
            return self.map_pages(slot_id, range(start, upto_vpage))

    def unmap_range(self, slot_id: str, vstart: int, npages: int) -> int:
        """Unmap the mapped pages among [vstart, vstart+npages) now and return them to the
        pool; returns the pages freed on one GPU."""
        freed = 0
        with self._lock:
            for sp in self._slot(slot_id).values():
                vs = sorted(v for v in sp.table if vstart <= v < vstart + npages)
                freed = self._unmap_vpages(sp, vs)
        return freed

    def map_all_free(self, slot_id: str, vstart: int) -> int:
        """Map every available page of each GPU after ``vstart`` (a KV cache mapped at once,
        Fig. 6a).  GPUs of a group may differ in free pages; the KV range is sized by the
        smallest so every shard has the same KV capacity.  Returns pages mapped per GPU."""
        with self._lock:
            n = self.kv_pages_available(slot_id, vstart)
            self.map_range(slot_id, vstart, n)
            return n

    def kv_pages_available(self, slot_id: str, vstart: int) -> int:
        """Pages a KV range starting at ``vstart`` can take on every GPU of the slot."""
        with self._lock:
            slot = self._slot(slot_id)
            n = min(self.available_pages(g) + self._quota.get(slot_id, 0) for g in slot)
            return max(0, min(n, min(sp.num_vpages for sp in slot.values()) - vstart))

    def destroy_slot(self, slot_id: str) -> int:
        """Unmap every page of the slot now, free them and release its virtual range."""
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
            for tables, ids in (
                (self._slots, dropped),
                (self._retired, [k for k, s in self._retired.items() if gpu in s]),
            ):
                for sid in ids:
                    slot = tables.pop(sid)
                    slot.pop(gpu)
                    self._quota.pop(sid, None)
                    for g, sp in slot.items():
                        self._unmap_vpages(sp, sorted(sp.table))
                        self.backend.free_reservation(
                            g, sp.va_base, sp.num_vpages * self.page_bytes
                        )
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

    # ---- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise PageTableError if any invariant is broken (used by tests and after recovery)."""
        with self._lock:
            check_tables(self._gpus, {**self._slots, **self._retired}, self._quota, self)

    def close(self) -> None:
        """Unmap every slot, then release the backend (handles must not be freed mapped)."""
        with self._lock:
            for slot_id in list(self._slots):
                self.destroy_slot(slot_id)
            self.flush()
        self.backend.close()
