"""One instance's KV range: which of its pages are mapped and what its engine may touch.

WarmServe §4.2 keeps page-table work off the critical path: "for the KV cache, mappings are
performed in the background", and unmapping is asynchronous.  A :class:`KvRange` is the state of
that for one serving instance:

* ``order``/``need``: the range's pages in the order the engine's blocks need them
  (:class:`~warmserve_agent.engines.kv_geometry.KvGeometry`);
* ``mapped``: the pages mapped (live) now; ``granted``: the blocks the engine was told it may
  use; ``target``: the blocks it should have (all of them while serving, Eq. 1's reservation in
  grace).

The one invariant: **the engine never touches an unmapped page.**  Growth maps first and then
raises the engine's capacity (:meth:`KvRange.step`); shrinking lowers the capacity first, the
engine answers what it keeps, and only pages no kept block touches are withdrawn — unmapped later
by the pager (:meth:`KvRange.shrink`).  Lock order: the node state's lock, then this range's,
then the page tables' (the pager never takes the node's).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from typing import Protocol

from warmserve_agent.engines.kv_geometry import KvGeometry
from warmserve_agent.memory import MemoryManager

log = logging.getLogger("warmserve.agent.kv")


class CapacitySink(Protocol):
    def set_kv_capacity(self, nbytes: int) -> int: ...


class KvRange:
    """See module docstring.  Every method is thread-safe (``lock``)."""

    def __init__(
        self,
        mm: MemoryManager,
        slot_id: str,
        first_vpage: int,
        num_pages: int,
        tp: int,
        engine: CapacitySink,
        on_pages: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.mm = mm
        self.slot_id = slot_id
        self.first_vpage = first_vpage
        self.num_pages = num_pages
        self.tp = tp
        self.engine = engine
        self.on_pages = on_pages  # told the number of live KV pages after every change
        # called once, when the engine is first granted the whole range (the activation's KV
        # stage, activation_stages.py); the pager's thread, with ``lock`` held
        self.on_full: Callable[[], None] | None = None
        self.lock = threading.RLock()
        self._stepping = threading.Lock()  # one mapper at a time (the pager, or inline)
        self.mapped: set[int] = set()
        self.granted = 0
        self.engine_ready = False  # the engine started: capacity changes may be sent
        self.cancelled = False
        self.failed = ""
        self._chunk = 8  # pages per step: small first, so the engine gets blocks quickly
        self.set_geometry(KvGeometry.pages(mm.page_bytes, num_pages))
        self.target = self.geometry.num_blocks

    # ---- geometry ------------------------------------------------------------------------
    def set_geometry(self, geometry: KvGeometry) -> None:
        """Plan by the engine's own layout (mapped pages stay mapped; an engine granted the
        whole range keeps it, otherwise the grant restarts from what the new plan covers)."""
        geometry.validate(self.num_pages * self.mm.page_bytes)
        with self.lock:
            old = getattr(self, "geometry", None)
            full = old is not None and self.granted >= old.num_blocks
            # A target of the whole range stays the whole range: the old target counts blocks
            # of the old plan (pages, before the engine reported its layout), and vLLM's blocks
            # can outnumber the range's pages, so min() would cap the engine below its range.
            whole = old is not None and self.target >= old.num_blocks
            self.geometry = geometry
            self.order, self.need = geometry.page_order(self.mm.page_bytes, self.num_pages)
            self._need_of = [0] * self.num_pages
            for p, b in zip(self.order, self.need, strict=True):
                self._need_of[p] = b
            self._frontier = 0
            if old is not None:
                self.target = (
                    geometry.num_blocks if full or whole else min(self.target, geometry.num_blocks)
                )
                self.granted = self.covered() if full else 0

    def pages_for(self, blocks: int) -> int:
        """How many pages blocks [0, blocks) touch."""
        return bisect.bisect_left(self.need, min(blocks, self.geometry.num_blocks))

    def _advance(self) -> int:
        """Index in ``order`` of the first page not mapped (all before it are)."""
        f, order, mapped = self._frontier, self.order, self.mapped
        while f < len(order) and order[f] in mapped:
            f += 1
        self._frontier = f
        return f

    def missing(self, blocks: int, limit: int | None = None) -> list[int]:
        """Pages blocks [0, blocks) need that are not mapped, in mapping order (the first
        ``limit`` of them)."""
        with self.lock:
            end = self.pages_for(blocks)
            out: list[int] = []
            for p in self.order[self._advance() : end]:
                if p not in self.mapped:
                    out.append(p)
                    if limit is not None and len(out) >= limit:
                        break
            return out

    def reachable(self, extra_pages: int) -> int:
        """Blocks covered once the next ``extra_pages`` missing pages are mapped."""
        with self.lock:
            nxt = self.missing(self.geometry.num_blocks, max(0, extra_pages) + 1)
            if len(nxt) <= extra_pages:
                return self.geometry.num_blocks
            return self._need_of[nxt[extra_pages]]

    def covered(self) -> int:
        """Blocks whose pages are all mapped."""
        with self.lock:
            f = self._advance()
            return self.need[f] if f < len(self.order) else self.geometry.num_blocks

    def capacity_bytes(self, blocks: int) -> int:
        return self.geometry.capacity(blocks, self.tp)

    def vpages(self, pages: list[int] | set[int]) -> list[int]:
        return sorted(self.first_vpage + p for p in pages)

    # ---- growth (the pager's thread, or inline when mapping synchronously) -----------------
    def step(self, max_pages: int | None = None) -> bool:
        """Map the next chunk of what ``target`` needs and grant what is covered; returns True
        while work remains.  The driver calls run without ``lock`` (one mapper at a time), so
        the engine's start, a lending shrink or an end never wait for a chunk's maps."""
        with self._stepping:
            with self.lock:
                if self.cancelled or self.failed:
                    return False
                size = max_pages or self._chunk
                todo = self.missing(self.target, size + 1)
                chunk = todo[:size]
            if chunk:
                try:
                    self.mm.map_pages(self.slot_id, self.vpages(chunk))
                except Exception as exc:  # the slot was dropped or its GPU died: stop, logged
                    with self.lock:
                        self.failed = f"mapping KV pages failed: {exc}"
                    log.warning("event=kv_map_failed slot=%s err=%s", self.slot_id, exc)
                    return False
            with self.lock:
                if chunk:
                    # the engine went away, or the target fell, while the chunk was mapped
                    stale = (
                        set(chunk)
                        if self.cancelled
                        else {p for p in chunk if self._need_of[p] >= self.target}
                    )
                    if stale and self.mm.has_slot(self.slot_id):
                        self.mm.withdraw(self.slot_id, self.vpages(stale))
                    if self.cancelled:
                        return False
                    self.mapped.update(set(chunk) - stale)
                    self._chunk = min(self._chunk * 2, 256)
                    self.on_pages(len(self.mapped))
                self.grant()
                more = len(todo) > len(chunk)
                return more or (self.engine_ready and self.granted < self.target)

    def run_to_completion(self) -> None:
        """Map everything ``target`` needs now (synchronous mapping, and tests)."""
        while self.step(max_pages=1 << 30):
            if not self.engine_ready:
                break

    def grant(self) -> None:
        """Raise the engine's capacity to the blocks now covered (never beyond ``target``)."""
        with self.lock:
            if not self.engine_ready or self.cancelled:
                return
            t = min(self.covered(), self.target)
            if t > self.granted:
                self.engine.set_kv_capacity(self.capacity_bytes(t))
                self.granted = t
            if self.on_full is not None and self.granted >= self.geometry.num_blocks:
                done, self.on_full = self.on_full, None
                done()

    def ready(self) -> None:
        """The engine started (with ``granted`` blocks, what its spec said): from now on
        capacity follows the mapping."""
        with self.lock:
            self.engine_ready = True
            self.grant()

    # ---- lending, ending -------------------------------------------------------------------
    def set_target(self, blocks: int) -> None:
        """Blocks the range should grow to (the pager maps them; pages are promised)."""
        with self.lock:
            self.target = max(0, min(blocks, self.geometry.num_blocks))
            self.mm.promise(self.slot_id, len(self.missing(self.target)))

    def shrink(self, blocks: int) -> int:
        """Lower the range's target to ``blocks``: the engine's capacity first (it may keep
        more: blocks in use; it is never raised here), then withdraw the mapped pages no block
        below the new target touches; returns the pages given up."""
        with self.lock:
            blocks = max(0, min(blocks, self.geometry.num_blocks))
            if self.engine_ready and blocks < self.granted:
                accepted = self.engine.set_kv_capacity(self.capacity_bytes(blocks))
                per_block = self.capacity_bytes(1)
                self.granted = max(blocks, min(-(-int(accepted) // per_block), self.granted))
            self.target = max(blocks, self.granted)
            drop = {p for p in self.mapped if self._need_of[p] >= self.target}
            if drop:
                self.mm.withdraw(self.slot_id, self.vpages(drop))
                self.mapped -= drop
                self._frontier = min(self._frontier, self.pages_for(self.target))
                self.on_pages(len(self.mapped))
            self.mm.promise(self.slot_id, len(self.missing(self.target)))
            return len(drop)

    def release_all(self) -> int:
        """The engine is gone (stopped or dead): withdraw every KV page; returns how many."""
        with self.lock:
            self.cancelled = True
            self.engine_ready = False
            self.granted = 0
            n = len(self.mapped)
            if self.mm.has_slot(self.slot_id):
                self.mm.withdraw(self.slot_id, self.vpages(self.mapped))
                self.mm.release_promise(self.slot_id)
            self.mapped.clear()
            self._frontier = 0
            self.on_pages(0)
            return n

    # ---- invariants ------------------------------------------------------------------------
    def check(self) -> None:
        """Mapped = what the page tables hold live in the KV range; granted blocks only touch
        mapped pages."""
        with self.lock:
            for g in self.mm.slot_gpus(self.slot_id):
                live = {
                    v - self.first_vpage
                    for v in self.mm.live_vpages(self.slot_id, g)
                    if v >= self.first_vpage
                }
                assert live == self.mapped, f"gpu {g}: KV pages {live} != {self.mapped}"
            needed = set(self.order[: self.pages_for(self.granted)])
            assert needed <= self.mapped, f"granted {self.granted} blocks touch unmapped pages"
