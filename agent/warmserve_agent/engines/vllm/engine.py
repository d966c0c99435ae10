"""The ``vllm`` engine: real vLLM in the pooled worker process, built over the prewarm slot.

Two halves (``build.py``), so a prewarm hit builds nothing on its critical path:

* ``prepare(spec)`` — at prewarm time, in the worker of the slot's first GPU: opens the slot
  (``SlotMemory``, partially: pages not mapped yet stay inaccessible), builds vLLM's ``AsyncLLM``
  with its engine core in this process (``inproc.py``), parameters as views of the slot
  (``loader.py``) and the KV cache sized for the pages the slot will get at activation — but with
  every KV block held out of the scheduler's reach (its pages are not mapped) — and vLLM's OpenAI
  app.  Nothing is read from the slot and nothing listens.
* ``start(spec)`` — at activation: maps the rest of the slot into this process and gives vLLM
  its KV blocks (:meth:`VllmEngine.grow_kv_cache`), then serves the app with uvicorn on an
  ephemeral port (``/v1/completions``, ``/v1/chat/completions`` with streaming, ``/v1/models``,
  ``/metrics`` with vLLM's metric names, ``/health``).  Without a prepared engine (a cold start,
  other engine arguments) ``start`` builds first, as before.

Per-layer readiness: a partially prewarmed slot serves at once; the agent keeps streaming the
missing layers into it and ``layers_ready(n)`` advances a
:class:`~warmserve_agent.engines.layer_gate.LayerGate` the model's modules wait on, each for its
own layer (``hooks.install_layer_gates``): layer ``i``'s forward runs as soon as layer ``i`` is
resident, and the first token comes once the last layer lands.

Grace lending (Eq. 1): vLLM fixes its KV block count at start.  ``set_kv_capacity`` takes free
blocks with the highest ids out of the block pool's free queue between engine steps (the
scheduler can never allocate them; prefix-cache hashes are evicted first) and gives them back on
growth.  Physically, the agent can only unmap the slot's *tail*: the engine answers the bytes up
to the last byte any still-usable block touches (computed from the KV tensors' real strides), so
the agent never unmaps memory vLLM may use.  Stats: R, waiting, K, M from vLLM's scheduler and
block pool; TTFT from vLLM's iteration stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from typing import Any

from warmserve_agent.engine import EngineError, TtftWindow
from warmserve_agent.engines.layer_gate import LayerGate
from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryKind
from warmserve_agent.engines.spec import EngineSpec, EngineStages, EngineStats, SlotRegion
from warmserve_agent.engines.vllm.hooks import (
    cleanup_vllm_process_state,
    extent,
    zero_kv_blocks_on_allocation,
)
from warmserve_agent.engines.vllm.loop import LoopThread

log = logging.getLogger("warmserve.agent.engine.vllm")

# vLLM keeps process-wide state (its distributed environment, the current config): engines of one
# process are built and torn down one at a time (a worker hosts one; tests run several), and that
# state is torn down when the last engine built in the process stops.
_PROCESS_LOCK = threading.RLock()
_LIVE: set[int] = set()  # id() of the engines built in this process and not stopped


class VllmEngine:
    """Engine protocol over vLLM (see module docstring)."""

    build_timeout_s = 900.0
    builds = 0  # vLLM engines built in this process (a prepared engine's activation adds none)

    def __init__(self, backend: Any = None) -> None:
        self._backend = backend
        self.spec: EngineSpec | None = None
        self._mem: SlotMemory | None = None
        self._slot: Any = None
        self._key = ""  # the ActiveSlot's registry key (the slot id, or the instance id)
        self._loop = LoopThread()  # vLLM's async client and the HTTP server run on it
        self._llm: Any = None
        self._client: Any = None
        self._app: Any = None  # uvicorn's config of vLLM's OpenAI app (build.Built)
        self._server: Any = None
        self._serve_task: asyncio.Task[Any] | None = None
        self._gate: LayerGate | None = None
        self._lent: list[Any] = []
        self._phys_limit = 0  # KV bytes (from the KV start) this process may still touch
        self._prepared = False  # built by prepare() and not started yet
        self._t_start = 0.0
        self._t_first_token: float | None = None
        self._stages = EngineStages()
        self.endpoint = ""
        self.ttft = TtftWindow()
        self.timings: dict[str, float] = {}

    # ---- Engine protocol -------------------------------------------------------------------
    def prepare(self, spec: EngineSpec) -> None:
        """Build vLLM's engine and app over the slot now (prewarm time), serving nothing; every
        KV block stays held until :meth:`start` maps the KV pages (see module docstring)."""
        with _PROCESS_LOCK:
            self._build_over(spec, partial=True)
        # Nothing of the KV range is mapped here yet: no block may be handed out.
        self._phys_limit = 0
        self._client.call_sync(self._hold_all_blocks)
        self._prepared = True

    def start(self, spec: EngineSpec) -> str:
        t0 = self._t_start = time.perf_counter()
        prepared = self._prepared
        if prepared:
            assert self.spec is not None
            if spec.prepared_key() != self.spec.prepared_key():
                raise EngineError("the prepared engine was built for another slot or arguments")
        else:
            with _PROCESS_LOCK:
                self._build_over(spec, partial=False)
        self.spec = spec
        t_ready = time.perf_counter() - t0
        self.grow_kv_cache(spec.regions[0])
        t_kv = time.perf_counter() - t0
        assert self._gate is not None
        self._gate.advance(spec.layers_resident)
        self.endpoint = self._loop.run(self._open_endpoint(spec), 60)
        self._prepared = False
        self._stages = EngineStages(prepared, t_ready, t_kv, time.perf_counter() - t0)
        log.info(
            "event=vllm_started model=%s endpoint=%s prepared=%s engine_s=%.3f start_s=%.3f",
            spec.model,
            self.endpoint,
            prepared,
            t_ready,
            self._stages.endpoint_up_s,
        )
        return self.endpoint

    def layers_ready(self, n: int) -> None:
        assert self._gate is not None
        self._gate.advance(n)

    def stats(self) -> EngineStats:
        assert self._client is not None and self._gate is not None
        sched = self._client.engine_core.scheduler
        running, waiting = sched.get_request_counts()
        bp = sched.kv_cache_manager.block_pool
        usable = bp.num_gpu_blocks - 1 - len(self._lent)  # block 0 is vLLM's null block
        used = max(0, usable - (bp.get_num_free_blocks()))
        p95, n = self.ttft.p95()
        first = self._t_first_token
        st = self._stages
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_used_bytes=used * self._block_bytes,
            kv_capacity_bytes=usable * self._block_bytes,
            layers_resident=self._gate.resident,
            max_batch=int(self._llm.vllm_config.scheduler_config.max_num_seqs),
            ttft_p95_s=p95,
            ttft_samples=n,
            ttft_window_s=self.ttft.window_s,
            stages=EngineStages(
                st.prepared,
                st.engine_ready_s,
                st.kv_mapped_s,
                st.endpoint_up_s,
                None if first is None else first - self._t_start,
            ),
        )

    def set_kv_capacity(self, nbytes: int) -> int:
        assert self._client is not None
        return int(self._client.call_sync(lambda: self._resize(int(nbytes))))

    def grow_kv_cache(self, region: SlotRegion) -> int:
        """Activation: follow the agent's mapping of the slot (the rest of the weights, the KV
        pages) in this process and hand vLLM's KV blocks within the mapped pages back to its
        scheduler.  Returns the KV bytes vLLM may use.  The one place the KV cache grows at
        activation; lending shrinks and regrows it with :meth:`set_kv_capacity`."""
        assert self._mem is not None and self._client is not None
        self._mem.update(region)
        start, end = self._slot.kv_range
        self._phys_limit = max(0, min(region.mapped_bytes, end) - start)
        return self.set_kv_capacity(self._phys_limit)

    def stop(self) -> None:
        from warmserve_agent.engines.vllm.loader import release_slot

        if self._gate is not None:
            self._gate.close()  # a forward waiting for a layer gives up
        self._loop.stop(self._shutdown)
        if self._key:
            release_slot(self._key)
        self._slot = None
        self._llm = self._client = self._server = self._app = None
        if self._mem is not None:
            self._mem.close()
            self._mem = None
        with _PROCESS_LOCK:
            if id(self) in _LIVE:
                _LIVE.discard(id(self))
                if not _LIVE:
                    cleanup_vllm_process_state()
        self._prepared = False

    # ---- building ------------------------------------------------------------------------------
    def _build_over(self, spec: EngineSpec, *, partial: bool) -> None:
        """Open the slot and build vLLM's engine and app over it on the engine's own loop thread
        (``build.py``); ``partial``: pages not mapped yet stay inaccessible (prepare)."""
        import torch

        from warmserve_agent.engines.vllm.build import (
            build,
            engine_config,
            runs_forward_while_building,
        )
        from warmserve_agent.engines.vllm.loader import ActiveSlot, activate_slot

        if spec.tp_size != 1:
            raise EngineError(
                "the vllm engine serves tensor-parallel size 1 only for now: the slot layout "
                "splits tensors by bytes, not by vLLM's row/column sharding (docs/agent.md)"
            )
        t0 = time.perf_counter()
        self.spec = spec
        region = spec.regions[0]
        self._mem = SlotMemory(region, self._backend, partial=partial)
        device = torch.device(
            f"cuda:{region.gpu}" if self._mem.kind == SlotMemoryKind.DEVICE else "cpu"
        )
        self._gate = LayerGate(spec.layers_total, spec.layers_resident)
        self._slot = ActiveSlot(spec, self._mem, device, gate=self._gate)
        self._key = spec.slot_id or spec.instance_id
        args, config, kv_bytes = engine_config(spec, self._key, device)
        if partial:
            why = runs_forward_while_building(config)
            if why:
                raise EngineError(f"cannot prepare this engine ahead of activation: {why}")
        activate_slot(self._key, self._slot)
        _LIVE.add(id(self))  # vLLM's process state is ours from here (stop releases it)
        built: list[Any] = []

        async def make() -> None:
            built.append(
                await build(spec, self._key, args, config, kv_bytes, self.ttft, self._first_token)
            )

        try:
            self._loop.start(make, self._shutdown, self.build_timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        b = built[0]
        self._llm, self._client, self._app = b.llm, b.client, b.server_config
        VllmEngine.builds += 1
        self._client.call_sync(lambda: zero_kv_blocks_on_allocation(self._client))
        start, end = self._slot.kv_range
        self._phys_limit = end - start
        self.timings["engine_s"] = time.perf_counter() - t0
        log.info(
            "event=vllm_built model=%s slot=%s prepared=%s engine_s=%.2f kv_bytes=%d",
            spec.model,
            spec.slot_id,
            partial,
            self.timings["engine_s"],
            kv_bytes,
        )

    def _hold_all_blocks(self) -> None:
        """Take every free KV block out of the free queue (engine thread; see prepare)."""
        bp = self._client.engine_core.scheduler.kv_cache_manager.block_pool
        take = list(bp.free_block_queue.get_all_free_blocks())
        for b in take:
            bp._maybe_evict_cached_block(b)
            bp.free_block_queue.remove(b)
        self._lent.extend(take)

    def _first_token(self) -> None:
        if self._t_first_token is None:
            self._t_first_token = time.perf_counter()

    # ---- introspection (tests, benchmarks) ------------------------------------------------------
    def model(self) -> Any:
        """vLLM's ``nn.Module`` (the in-process executor's worker)."""
        assert self._client is not None
        return self._client.engine_core.model_executor.driver_worker.worker.model_runner.model

    def slot_layout(self) -> dict[str, Any]:
        """Where the slot is in this process and where vLLM's tensors are: for the zero-copy
        checks (every parameter and KV tensor must lie inside the slot)."""
        assert self._mem is not None and self._slot is not None
        return {
            "base": self._mem.base,
            "weight_bytes": self._mem.region.weight_bytes,
            "mapped_bytes": self._mem.region.mapped_bytes,
            "kv_range": self._slot.kv_range,
            "kv": {n: (t.data_ptr(), extent(t)) for n, t in self._slot.kv.items()},
        }

    # ---- KV capacity (engine thread) -----------------------------------------------------------
    @property
    def _block_bytes(self) -> int:
        start, end = self._slot.kv_range
        bp = self._client.engine_core.scheduler.kv_cache_manager.block_pool
        return (end - start) // bp.num_gpu_blocks

    def _touched_bytes(self, blocks: int) -> int:
        """Bytes from the KV start up to the last byte blocks [0, blocks) touch."""
        start, end = self._slot.kv_range
        if blocks <= 0:
            return 0
        nb = self._client.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        base = self._mem.tensor().data_ptr() + start
        hi = 0
        for t in self._slot.kv.values():
            dims = [i for i, s in enumerate(t.shape) if s == nb]
            if len(dims) != 1:  # cannot tell the block dimension: the whole buffer is in use
                return end - start
            d = dims[0]
            last = sum(
                (s - 1) * st
                for i, (s, st) in enumerate(zip(t.shape, t.stride(), strict=True))
                if i != d
            )
            last += (blocks - 1) * t.stride(d)
            off = t.data_ptr() - base + (last + 1) * t.element_size()
            hi = max(hi, off)
        return min(hi, end - start)

    def _resize(self, nbytes: int) -> int:
        """Keep usable exactly the blocks whose bytes lie within ``nbytes`` of the KV start (and
        every block in use); lend the others.  Answers the KV bytes the engine may still touch.
        Runs between engine steps (on the engine thread)."""
        bp = self._client.engine_core.scheduler.kv_cache_manager.block_pool
        nb = bp.num_gpu_blocks
        top = nb - len(self._lent)  # usable blocks are [1, top); block 0 is vLLM's null block
        in_use = max((b.block_id for b in bp.blocks[1:] if b.ref_cnt > 0), default=0)
        # Growth reaches only pages this process can see: with a shared file opened by its
        # physical page list, pages the agent maps back later are other physical pages.
        limit = nbytes if self._can_regrow() else min(nbytes, self._phys_limit)
        target = max(self._blocks_within(limit), in_use + 1, 2)
        if target < top:  # lend free blocks at and above target (all free: target > in_use)
            lent_ids = {b.block_id for b in self._lent}
            take = [
                b
                for b in bp.free_block_queue.get_all_free_blocks()
                if b.block_id >= target and b.block_id not in lent_ids
            ]
            for b in take:
                bp._maybe_evict_cached_block(b)
                bp.free_block_queue.remove(b)
            self._lent.extend(take)
        elif target > top:  # map first, then hand the blocks back to the scheduler
            self._follow_mapping(self._touched_bytes(target))
            back = sorted((b for b in self._lent if b.block_id < target), key=lambda b: b.block_id)
            self._lent = [b for b in self._lent if b.block_id >= target]
            bp.free_block_queue.append_n(back)
        touched = self._touched_bytes(nb - len(self._lent))
        self._follow_mapping(touched)
        return touched

    def _blocks_within(self, limit: int) -> int:
        """The largest ``t`` such that blocks [0, t) touch no byte at or beyond ``limit``."""
        nb = self._client.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        lo, hi = 0, nb  # touched(lo) <= limit; binary search (touched grows with blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._touched_bytes(mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _can_regrow(self) -> bool:
        """Pages the agent maps back after lending are visible here only when this process owns
        the memory (a CUDA VA, or the simulated backend in this worker); a shared-file slot
        opened by physical page list cannot follow a remap."""
        follows = (SlotMemoryKind.DEVICE, SlotMemoryKind.HOST_BACKEND)
        return self._mem is not None and self._mem.kind in follows

    def _follow_mapping(self, touched: int) -> None:
        """Make this process's view of the KV pages match what the engine may touch: pages
        beyond it may be unmapped and lent by the agent (made inaccessible here, so a bug
        faults instead of corrupting a neighbour); pages regained are mapped again from the
        backend's MMU.  CUDA VAs need nothing: the worker's own mappings are the memory."""
        mem = self._mem
        assert mem is not None
        if mem.kind == SlotMemoryKind.DEVICE or touched == self._phys_limit:
            self._phys_limit = touched
            return
        start, _ = self._slot.kv_range
        page = mem.region.page_bytes
        new_hi = math.ceil((start + touched) / page)
        old_hi = math.ceil((start + self._phys_limit) / page)
        if new_hi < old_hi:
            mem.host_mapping().revoke(new_hi, old_hi - new_hi)
        elif new_hi > old_hi:
            _, ppages = mem._ppages(new_hi)  # host-backend only (_can_regrow)
            mem.host_mapping().remap(old_hi, ppages[old_hi:new_hi])
        self._phys_limit = touched

    # ---- on the engine's loop ------------------------------------------------------------------
    async def _open_endpoint(self, spec: EngineSpec) -> str:
        from warmserve_agent.engines.vllm.build import open_endpoint

        self._server, self._serve_task, endpoint = await open_endpoint(spec, self._app)
        return endpoint

    async def _shutdown(self) -> None:
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serve_task, 30)
        if self._llm is not None:
            self._llm.shutdown()
