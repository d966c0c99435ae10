"""Unmapping off the critical path (WarmServe §4.2: "unmapping operations are also executed
asynchronously, as they do not block any subsequent actions").

A page its user gave up is *withdrawn* (:meth:`DeferredUnmap.withdraw`, or a whole slot with
:meth:`DeferredUnmap.retire_slot`): still mapped in the backend, but nobody may touch it any more
(its engine's capacity was withdrawn first), and :meth:`DeferredUnmap.flush` unmaps it later —
on the KV pager's thread (:mod:`~warmserve_agent.kv_pager`), or at once by a map that finds too
few free pages on that GPU.  Withdrawn pages therefore count as available, and a withdrawn page
its own slot maps again is simply restored (:meth:`DeferredUnmap.restore`).

Mixed into :class:`~warmserve_agent.memory.MemoryManager`, which provides the fields below.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from warmserve_agent.memory_backend import MemoryBackend, runs
from warmserve_agent.memory_tables import GpuPool, SlotPages


class DeferredUnmap:
    """Withdrawn pages and retired slots of the page tables (see module docstring)."""

    backend: MemoryBackend
    page_bytes: int
    _lock: threading.RLock
    _gpus: dict[int, GpuPool]
    _slots: dict[str, dict[int, SlotPages]]
    _retired: dict[str, dict[int, SlotPages]]
    _retired_seq: int
    _quota: dict[str, int]
    _slot: Callable[[str], dict[int, SlotPages]]

    def pending_pages(self, gpu: int | None = None) -> int:
        """Withdrawn pages still mapped, waiting for :meth:`flush` (on ``gpu``, or all)."""
        with self._lock:
            return sum(
                len(sp.withdrawn)
                for tables in (self._slots, self._retired)
                for slot in tables.values()
                for g, sp in slot.items()
                if gpu is None or g == gpu
            )

    def withdraw(self, slot_id: str, vpages: Iterable[int]) -> int:
        """Give up mapped ``vpages`` of the slot: nobody may touch them any more, and
        :meth:`flush` unmaps them later.  Returns how many were withdrawn now."""
        want = set(vpages)
        with self._lock:
            slot = self._slot(slot_id)
            n = 0
            for sp in slot.values():
                got = {v for v in want if v in sp.table} - sp.withdrawn
                sp.withdrawn |= got
                n = max(n, len(got))
            return n

    def restore(self, slot_id: str, vpages: Iterable[int]) -> int:
        """Take back withdrawn pages not yet unmapped (they never left the slot); like a map,
        each one uses up a page of the slot's promise."""
        want = set(vpages)
        with self._lock:
            n = 0
            for sp in self._slot(slot_id).values():
                back = sp.withdrawn & want
                sp.withdrawn -= back
                n = max(n, len(back))
            left = self._quota.get(slot_id, 0) - n
            if left > 0:
                self._quota[slot_id] = left
            else:
                self._quota.pop(slot_id, None)
            return n

    def retire_slot(self, slot_id: str) -> int:
        """Give up the whole slot: its pages are withdrawn and unmapped by :meth:`flush`, which
        then frees its virtual range.  Returns the pages it held per GPU."""
        with self._lock:
            slot = self._slot(slot_id)
            self._quota.pop(slot_id, None)
            held = max((len(sp.table) for sp in slot.values()), default=0)
            del self._slots[slot_id]
            self._retired_seq += 1
            key = f"{slot_id}~retired{self._retired_seq}"
            for sp in slot.values():
                sp.withdrawn = set(sp.table)
                for v, p in sp.table.items():
                    self._gpus[sp.gpu].owner[p] = (key, v)
            self._retired[key] = slot
            self._free_empty_retired()
            return held

    def flush(self, gpu: int | None = None, limit: int | None = None) -> int:
        """Unmap withdrawn pages (on ``gpu``, or every GPU; at most ``limit`` per GPU) and
        return them to the pool; returns the pages unmapped."""
        done = 0
        with self._lock:
            budget: dict[int, int] = {}
            for tables in (self._retired, self._slots):
                for slot in tables.values():
                    for g, sp in slot.items():
                        if not sp.withdrawn or (gpu is not None and g != gpu):
                            continue
                        left = budget.get(g, limit if limit is not None else 1 << 62)
                        vs = sorted(sp.withdrawn)[:left]
                        done += self._unmap_vpages(sp, vs)
                        budget[g] = left - len(vs)
            self._free_empty_retired()
        return done

    def _unmap_vpages(self, sp: SlotPages, vpages: Sequence[int]) -> int:
        """Unmap mapped ``vpages`` (sorted) of one slot on one GPU, one call per run."""
        pool = self._gpus[sp.gpu]
        n = 0
        for first, count in runs([v for v in vpages if v in sp.table]):
            self.backend.unmap(sp.gpu, sp.va_base + first * self.page_bytes, count)
            for v in range(first, first + count):
                p = sp.table.pop(v)
                sp.withdrawn.discard(v)
                del pool.owner[p]
                pool.free.append(p)
                n += 1
        return n

    def _free_empty_retired(self) -> None:
        empty = [k for k, slot in self._retired.items() if not any(s.table for s in slot.values())]
        for key in empty:
            for sp in self._retired.pop(key).values():
                self.backend.free_reservation(sp.gpu, sp.va_base, sp.num_vpages * self.page_bytes)
