"""The node's background page-table worker: KV ranges mapped ahead of their engines, withdrawn
pages unmapped (WarmServe §4.2, "achieving zero-overhead switching").

One thread per node works through

1. the KV ranges that still grow (:class:`~warmserve_agent.kv_range.KvRange`), one chunk each in
   turn — an activation returns once its engine is up, and the engine's capacity grows as chunks
   land ("the inference framework consumes cache space at a slower rate than the mapping process
   produces it");
2. then a chunk of the pages withdrawn from ended, evicted or lending instances and from retired
   slots (:meth:`~warmserve_agent.memory.MemoryManager.flush`).

Nothing waits for it: a map that needs the free pages first flushes them itself, and synchronous
mode (``NodeCore(kv_background=False)``, the benchmark's baseline) runs a range's growth inline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from warmserve_agent.engines.spec import EngineStats
from warmserve_agent.kv_range import KvRange
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node_records import InstanceRec, Refusal

log = logging.getLogger("warmserve.agent.kv")


class KvPager:
    """See module docstring."""

    def __init__(self, mm: MemoryManager, *, unmap_chunk: int = 256, thread: bool = True) -> None:
        self.mm = mm
        self._mm = mm
        self._unmap_chunk = unmap_chunk
        self._threaded = thread  # False: the caller drives it with run_once (property tests)
        self.yield_s = 0.001  # pause between chunks (see _round)
        self._cv = threading.Condition()
        self._ranges: list[KvRange] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._working = False

    def track(self, kv: KvRange) -> None:
        """Grow ``kv`` in the background (again, after its target rose)."""
        with self._cv:
            if kv not in self._ranges:
                self._ranges.append(kv)
            self._wake()

    def kick(self) -> None:
        """Pages were withdrawn: unmap them in the background."""
        with self._cv:
            self._wake()

    def _wake(self) -> None:
        if self._closed or not self._threaded:
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kv-pager", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._ranges and not self._mm.pending_pages():
                    self._working = False
                    self._cv.notify_all()
                    self._cv.wait()
                if self._closed:
                    self._working = False
                    self._cv.notify_all()
                    return
                self._working = True
                work = list(self._ranges)
            self._round(work)

    def run_once(self) -> bool:
        """One round by hand (a pager without a thread): a chunk of every growing range, then
        a chunk of the pending unmaps.  Returns whether work remains."""
        with self._cv:
            work = list(self._ranges)
        self._round(work)
        with self._cv:
            return bool(self._ranges) or self._mm.pending_pages() > 0

    def _round(self, work: list[KvRange]) -> None:
        for kv in work:
            try:
                more = kv.step()
            except Exception as exc:  # the engine died meanwhile: its range is dropped
                log.warning("event=kv_grow_failed slot=%s err=%s", kv.slot_id, exc)
                more = False
            if not more:
                with self._cv:
                    if kv in self._ranges:
                        self._ranges.remove(kv)
            elif self._threaded:
                # Python's locks are not fair: without a pause the next chunk would take the
                # page tables' lock again before an activation waiting for it wakes up.
                time.sleep(self.yield_s)
        try:
            self._mm.flush(limit=self._unmap_chunk)
        except Exception as exc:  # a GPU's memory owner died: gpu_lost drops its tables
            log.warning("event=kv_unmap_failed err=%s", exc)
            time.sleep(0.05)

    def idle(self, timeout: float = 30.0) -> bool:
        """Wait until no range grows and nothing waits to be unmapped (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        if not self._threaded:
            while self.run_once():
                if time.monotonic() > deadline:
                    return False
            return True
        with self._cv:
            while self._ranges or self._working or self._mm.pending_pages():
                if self._closed:
                    return False
                if self._thread is None or not self._thread.is_alive():
                    self._wake()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(30)


# Engines whose start touches KV memory on a GPU: vLLM's CUDA-graph warm-up runs attention over
# block 0 of every layer before it serves.  Their KV is mapped before they start on CUDA (on the
# simulated backend vLLM's CPU warm-up writes no KV: background there).
KV_AT_START_ON_DEVICE = frozenset({"vllm"})


@dataclass
class KvMapping:
    """How this node maps KV ranges: the pager, whether in the background (default) or before
    the engine starts (``background=False``: the synchronous baseline), and the engine-event
    socket engines report completions to (``engine_events.py``; "" none)."""

    pager: KvPager
    background: bool = True
    events_addr: str = ""

    # ---- activation's KV API ---------------------------------------------------------------
    def reserve(self, inst: InstanceRec) -> KvRange:
        """Promise every page left on the group to the instance's KV range (after its weights)
        and start mapping it: in the background — the engine starts meanwhile and its capacity
        grows as chunks land — or, without background mapping, all of it now.  Call with the
        node's lock held, after the weights are mapped, before the engine starts."""
        mm = self.pager.mm
        n = mm.kv_pages_available(inst.slot_id, inst.weight_pages)

        def on_pages(mapped: int) -> None:
            inst.kv_pages = mapped

        kv = KvRange(mm, inst.slot_id, inst.weight_pages, n, len(inst.gpus), inst.engine, on_pages)
        mm.promise(inst.slot_id, n)
        inst.kv, inst.kv_pages_initial = kv, n
        if self._background(inst):
            self.pager.track(kv)
        else:
            kv.run_to_completion()
        # The engine starts with the whole range if it is mapped already, else with none: the
        # blocks a partial mapping covers depend on the engine's layout, known once it runs.
        kv.granted = kv.geometry.num_blocks if kv.covered() >= kv.geometry.num_blocks else 0
        return kv

    def engine_started(self, inst: InstanceRec, stats: EngineStats) -> None:
        """The engine is up: plan by its KV layout (if it reported one) and let its capacity
        follow the mapping from now on."""
        kv = inst.kv
        assert kv is not None
        if stats.kv_geometry is not None:
            try:
                kv.set_geometry(stats.kv_geometry)
            except ValueError as exc:
                raise Refusal(
                    "UNAVAILABLE", f"the engine reported an unusable KV layout: {exc}"
                ) from None
        kv.ready()
        if self._background(inst):
            self.pager.track(kv)
        else:
            kv.run_to_completion()

    def _background(self, inst: InstanceRec) -> bool:
        on_device = self.pager.mm.backend.name == "cuda"
        return self.background and not (on_device and inst.engine_name in KV_AT_START_ON_DEVICE)
