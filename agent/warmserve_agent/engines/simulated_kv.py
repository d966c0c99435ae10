"""The simulated engine's KV cache: real pages of its slot, touched only where it was granted.

The KV range starts at the first page after the weights.  The agent grants it page by page as
the pages map (:meth:`SimKvCache.grant`, from ``set_kv_capacity``); requests get whole pages,
lowest first (as vLLM's free block queue hands out blocks), and write their KV into them: a
marker per page at prefill, 8 bytes per generated token, the markers read back when they finish.
Every write and read goes through :meth:`~warmserve_agent.engines.slotmem.SlotMemory.kv_write`
/ ``kv_read``, which check the backend's page table first — so the test of "the engine never
touches an unmapped page" is a check of real accesses, and a page another slot's prewarm took
while this engine still wrote into it would be caught (``violations``), not silently corrupted.

Shrinking never takes pages in use: the engine keeps at least up to its highest allocated page
and answers what it kept.
"""

from __future__ import annotations

import hashlib
import logging

from warmserve_agent.engines.kv_geometry import KvGeometry
from warmserve_agent.engines.slotmem import KvAccessError, SlotMemory
from warmserve_agent.engines.spec import EngineSpec

log = logging.getLogger("warmserve.agent.engine")

MARKER = 16  # bytes at the start of every page a request holds


class SimKvCache:
    """See module docstring (one per engine; called on the engine's event loop only)."""

    def __init__(self, spec: EngineSpec, mems: dict[int, SlotMemory]) -> None:
        region = spec.regions[0]
        self.page = region.page_bytes
        self.tp = spec.tp_size
        self.first = -(-region.weight_bytes // self.page)  # KV start, in slot pages
        self.total = region.kv_bytes // self.page  # pages per rank in the KV range
        self.capacity = 0  # pages per rank the engine may use: [0, capacity)
        self.used: dict[int, str] = {}  # page -> request holding it
        self.waiting: dict[str, int] = {}  # requests waiting for KV pages -> pages they need
        self.mems = mems
        self.violations = 0
        self.corrupt = 0

    @property
    def geometry(self) -> KvGeometry:
        return KvGeometry.pages(self.page, self.total)

    def capacity_bytes(self) -> int:
        return self.capacity * self.page * self.tp

    def pages_for(self, nbytes: int) -> int:
        """Pages per rank a request reserving ``nbytes`` (summed over the group) needs."""
        return -(-nbytes // (self.tp * self.page))

    def free_pages(self) -> int:
        return self.capacity - len(self.used)

    def grant(self, nbytes: int) -> int:
        """Set the capacity to ``nbytes`` (summed over the group), never below the pages in
        use; map granted pages / revoke withdrawn ones first.  Returns the capacity kept."""
        want = min(self.total, max(0, nbytes) // (self.page * self.tp))
        keep = max(want, max(self.used, default=-1) + 1)
        if keep > self.capacity:
            for m in self.mems.values():
                m.grant_pages(range(self.first + self.capacity, self.first + keep))
        elif keep < self.capacity:
            for m in self.mems.values():
                m.revoke_pages(range(self.first + keep, self.first + self.capacity))
        self.capacity = keep
        return self.capacity_bytes()

    def wait_for_pages(self, rid: str, npages: int) -> bool:
        """``rid`` cannot be admitted for lack of KV pages; True the first time (the engine
        tells the agent, which may grow a lending grace instance back)."""
        first = rid not in self.waiting
        self.waiting[rid] = npages
        return first

    def wanted_bytes(self) -> int:
        """KV (summed over the group) the requests waiting for pages need beyond the free
        capacity."""
        short = sum(self.waiting.values()) - self.free_pages()
        return max(0, short) * self.page * self.tp

    def alloc(self, rid: str, npages: int) -> list[int] | None:
        """The lowest ``npages`` free pages for request ``rid``, or None if too few."""
        got = [p for p in range(self.capacity) if p not in self.used][:npages]
        if len(got) < npages:
            return None
        self.waiting.pop(rid, None)
        for p in got:
            self.used[p] = rid
        return got

    def _marker(self, rid: str, p: int) -> bytes:
        return hashlib.blake2b(f"{rid}/{p}".encode(), digest_size=MARKER).digest()

    def _offset(self, pages: list[int], byte: int) -> int:
        """Slot offset of byte ``byte`` of a request's KV (its pages, in order)."""
        i, off = divmod(byte, self.page - MARKER)
        return (self.first + pages[min(i, len(pages) - 1)]) * self.page + MARKER + off

    def _each(self, fn: str, *args: object) -> None:
        for m in self.mems.values():
            try:
                getattr(m, fn)(*args)
            except KvAccessError as exc:
                self.violations += 1
                log.error("event=kv_access_violation err=%s", exc)
                raise

    def prefill(self, rid: str, pages: list[int]) -> None:
        for p in pages:
            self._each("kv_write", (self.first + p) * self.page, self._marker(rid, p))

    def token(self, pages: list[int], index: int, per_token: int) -> None:
        """The KV of generated token ``index`` (8 bytes of it) lands in its page."""
        room = len(pages) * (self.page - MARKER) - 8
        at = min(index * max(1, per_token // self.tp), max(0, room))
        self._each("kv_write", self._offset(pages, at), index.to_bytes(8, "little"))

    def release(self, rid: str, pages: list[int]) -> None:
        """Read the request's markers back (another slot writing into a page this engine still
        held shows here), then free its pages."""
        try:
            for p in pages:
                for m in self.mems.values():
                    got = m.kv_read((self.first + p) * self.page, MARKER)
                    if got != self._marker(rid, p):
                        self.corrupt += 1
                        log.error("event=kv_corrupt page=%d", p)
        except KvAccessError as exc:
            self.violations += 1
            log.error("event=kv_access_violation err=%s", exc)
        finally:
            for p in pages:
                self.used.pop(p, None)
