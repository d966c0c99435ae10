"""vLLM's KV block pool over the slot's KV pages, granted block by block as the agent maps them.

The agent maps the KV range in the background and raises the engine's capacity as pages land
(``set_kv_capacity``; WarmServe §4.2), lowers it before lending pages (§4.1, Eq. 1), and raises
it again when a request needs the KV back.  vLLM sizes its block pool once, at start, for the
whole range; :class:`SlotKvPool` keeps usable exactly the blocks ``[1, t)`` the capacity allows
(block 0 is vLLM's null block) by taking the others out of the pool's free queue (prefix-cache
hashes evicted first) so the scheduler can never allocate them, and puts them back on growth.

Where the blocks lie (:class:`~warmserve_agent.engines.kv_geometry.KvGeometry`): vLLM's layout
here is layer-major, so block ``b`` of layer ``l`` is at ``l * layer_stride + b * block_stride``
— one segment per KV tensor, measured from the tensors' real strides.  The engine reports it in
its stats; the agent maps pages in the order blocks need them and lends back exactly the pages
no kept block touches, in every layer's region.

Before blocks become usable, their pages are mapped in this process (``SlotMemory.grant_pages``:
on the simulated backend from the backend's shared page table, which also checks they are
mapped); vLLM zeroes each block as it hands it to a request (``zero_null_block``); pages given
up are made inaccessible here (``revoke_pages``) before the agent unmaps them, so a stray access
faults instead of corrupting a neighbour.  On CUDA the process's VMM range is the agent's
mapping: nothing to do there.

Every call runs on vLLM's engine thread, between steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

from warmserve_agent.engine_events import EngineEventKind, EventSender
from warmserve_agent.engines.kv_geometry import KvGeometry
from warmserve_agent.engines.slotmem import SlotMemory

log = logging.getLogger("warmserve.agent.engine.vllm")


def measure_geometry(slot: Any, mem: SlotMemory, nb: int) -> KvGeometry:
    """Block ``b`` of each of ``slot``'s KV tensors (``nb`` blocks), from their real strides
    (module docstring).  A layout it cannot read is one block covering the whole range: all or
    nothing.  The same on every tensor-parallel rank (each holds its heads of every block)."""
    start, end = slot.kv_range
    block_bytes = (end - start) // nb
    base = mem.tensor().data_ptr() + start
    kv_bytes = nb * block_bytes
    segs: set[tuple[int, int]] = set()
    for t in slot.kv.values():
        dims = [i for i, s in enumerate(t.shape) if s == nb]
        if len(dims) != 1:
            return KvGeometry(1, kv_bytes, ((0, kv_bytes),))
        d = dims[0]
        stride = t.stride(d) * t.element_size()
        width = sum(
            (s - 1) * st for i, (s, st) in enumerate(zip(t.shape, t.stride(), strict=True))
            if i != d
        ) * t.element_size() + t.element_size()
        if width > stride:
            return KvGeometry(1, kv_bytes, ((0, kv_bytes),))
        segs.add((t.data_ptr() - base, stride))
    geo = KvGeometry(nb, block_bytes, tuple(sorted(segs)))
    geo.validate(mem.region.kv_bytes)
    return geo


def zero_null_block(slot: Any, nb: int, lo: int, hi: int) -> None:
    """Zero vLLM's null block (block 0, in padding of block tables) when blocks ``[lo, hi)``
    newly usable include it.  Every other block is zeroed by vLLM itself when it hands the block
    to a request, on every rank (``hooks.zero_kv_blocks_on_allocation``), so the pages a
    previous tenant left never reach a request and a growth only maps; the null block is never
    handed out.  A layout without a block dimension is zeroed whole (all or nothing)."""
    if hi <= lo or lo > 0:
        return
    for t in slot.kv.values():
        d = [i for i, s in enumerate(t.shape) if s == nb]
        if len(d) == 1:
            t.narrow(d[0], 0, 1).zero_()
        else:
            t.zero_()


class SlotKvPool:
    """See module docstring.  ``client`` is the in-process engine-core client."""

    def __init__(self, slot: Any, mem: SlotMemory, client: Any, events: EventSender) -> None:
        self.slot = slot
        self.mem = mem
        self.client = client
        self.events = events
        bp = self._pool()
        self.nb = bp.num_gpu_blocks
        start, end = slot.kv_range
        self.kv_start = start
        self.block_bytes = (end - start) // self.nb
        self.page = mem.region.page_bytes
        self.first_page = start // self.page  # the KV range's first slot page
        self.geometry = self._measure()
        kv_pages = mem.region.kv_bytes // self.page
        self._order, self._need = self.geometry.page_order(self.page, kv_pages)
        self.granted = 0
        self._lent: list[Any] = []
        self.wanted = 0  # bytes waiting requests need beyond the free blocks
        self._wanted_sent = 0.0

    def start(self, nbytes: int) -> int:
        """vLLM built its pool with every block free: take them all out, then grant what the
        agent mapped already (``nbytes``: all of it when mapped synchronously, else none)."""
        bp = self._pool()
        self._lent = list(bp.free_block_queue.get_all_free_blocks())
        for b in self._lent:
            bp.free_block_queue.remove(b)
        self.granted = 0
        return self.resize(nbytes)

    def _pool(self) -> Any:
        return self.client.engine_core.scheduler.kv_cache_manager.block_pool

    def _measure(self) -> KvGeometry:
        return measure_geometry(self.slot, self.mem, self.nb)

    def _blocks(self, t: int) -> int:
        """vLLM blocks a capacity of ``t`` geometry blocks covers (the fallback geometry's one
        block is all of them)."""
        return t if self.geometry.num_blocks == self.nb else (self.nb if t >= 1 else 0)

    def _pages(self, blocks: int) -> list[int]:
        """Slot pages blocks [0, blocks) touch."""
        k = bisect.bisect_left(self._need, min(blocks, self.geometry.num_blocks))
        return [self.first_page + p for p in self._order[:k]]

    # ---- capacity ----------------------------------------------------------------------------
    def resize(self, nbytes: int) -> int:
        """Keep usable the blocks a capacity of ``nbytes`` allows (never fewer than are in
        use); returns the capacity kept, in bytes."""
        bp = self._pool()
        t = min(self.geometry.num_blocks, max(0, nbytes) // self.geometry.block_bytes)
        in_use = max((b.block_id for b in bp.blocks[1:] if b.ref_cnt > 0), default=0)
        if in_use:
            t = max(t, self._geometry_blocks(in_use + 1))
        old, new = self._blocks(self.granted), self._blocks(t)
        if t > self.granted:
            self.mem.grant_pages(self._pages(t))  # mapped here first (checked on simulated)
            self._zero(old, new)
            back = sorted((b for b in self._lent if b.block_id < new), key=lambda b: b.block_id)
            self._lent = [b for b in self._lent if b.block_id >= new]
            bp.free_block_queue.append_n(back)
        elif t < self.granted:
            lent = {b.block_id for b in self._lent}
            take = [
                b
                for b in bp.free_block_queue.get_all_free_blocks()
                if b.block_id >= max(new, 1) and b.block_id not in lent
            ]
            for b in take:
                bp._maybe_evict_cached_block(b)
                bp.free_block_queue.remove(b)
            self._lent.extend(take)
            keep = set(self._pages(t))
            self.mem.revoke_pages(p for p in self._pages(self.granted) if p not in keep)
        self.granted = t
        return t * self.geometry.block_bytes

    def _geometry_blocks(self, blocks: int) -> int:
        return blocks if self.geometry.num_blocks == self.nb else 1

    def _zero(self, lo: int, hi: int) -> None:
        zero_null_block(self.slot, self.nb, lo, hi)

    # ---- what the agent reads ----------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """(capacity, used) bytes: usable blocks and blocks in use, null block excluded."""
        usable = max(0, self._blocks(self.granted) - 1)
        free = self._pool().get_num_free_blocks()
        return usable * self.block_bytes, max(0, usable - free) * self.block_bytes

    def after_step(self, outputs: Any) -> None:
        """After a step (or an abort, ``outputs`` None): report finished requests, and requests
        that wait for blocks the capacity lacks, to the agent."""
        if outputs is None or any(o.finished for o in outputs.outputs):
            self.events.send(EngineEventKind.FINISHED)
        sched = self.client.engine_core.scheduler
        wanted = 0
        if len(sched.waiting):
            head = sched.waiting.peek_request()
            need = -(-(head.num_tokens + 1) // sched.block_size)
            wanted = max(0, need - self._pool().get_num_free_blocks()) * self.block_bytes
        self.wanted = wanted
        now = time.monotonic()
        if wanted and now - self._wanted_sent > 0.1:  # at most 10 a second while it waits
            self._wanted_sent = now
            self.events.send(EngineEventKind.KV_WANTED)
