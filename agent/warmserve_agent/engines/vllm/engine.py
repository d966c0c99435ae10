"""The ``vllm`` engine: real vLLM in the pooled worker process, built over the prewarm slot.

Two halves (``build.py``), so a prewarm hit builds nothing on its critical path:

* ``prepare(spec)`` — at prewarm time, in the worker of the slot's first GPU: opens the slot
  (``SlotMemory``, partially: pages not mapped yet stay inaccessible), builds vLLM's ``AsyncLLM``
  with its engine core in this process (``inproc.py``), parameters as views of the slot
  (``loader.py``) and the KV cache sized for the pages the slot will get at activation — but with
  every KV block held out of the scheduler's reach (its pages are not mapped) — and vLLM's OpenAI
  app.  Nothing is read from the slot and nothing listens.
* ``start(spec)`` — at activation: maps the rest of the weights into this process and gives
  vLLM the KV blocks the agent mapped already (:meth:`VllmEngine.grow_kv_cache`), then serves
  the app with uvicorn on an ephemeral port (``/v1/completions``, ``/v1/chat/completions`` with
  streaming, ``/v1/models``, ``/metrics`` with vLLM's metric names, ``/health``).  Without a
  prepared engine (a cold start, other engine arguments) ``start`` builds first, as before.

Per-layer readiness: a partially prewarmed slot serves at once; the agent keeps streaming the
missing layers into it and ``layers_ready(n)`` advances a
:class:`~warmserve_agent.engines.layer_gate.LayerGate` the model's modules wait on, each for its
own layer (``hooks.install_layer_gates``): layer ``i``'s forward runs as soon as layer ``i`` is
resident, and the first token comes once the last layer lands.

KV cache (``kv.py``): vLLM sizes its block pool for the whole KV range when it is built, but the
agent maps that range in the background and raises the capacity as pages land — a prepared
engine's as any other's.  Every growth goes through :meth:`VllmEngine.grow_kv_cache` (at start,
what was mapped already; then each ``set_kv_capacity`` that raises it), which keeps usable
exactly the blocks the capacity allows, maps their pages in this process first and zeroes them.
The engine reports its layout (vLLM's is layer-major: a little of every layer's region per
block) so the agent maps pages in the order blocks need them and, when lending in grace (Eq. 1),
takes back exactly the pages no kept block touches.  Finished requests and requests waiting for
blocks are reported to the agent on its engine-event socket (hooked where the engine core
finishes a step, ``inproc.py``), so the agent re-checks Eq. 1 on each completion and grows lent
KV back.  Stats: R, waiting, K, M from vLLM's scheduler and block pool; TTFT from vLLM's
iteration stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from warmserve_agent.engine import EngineError, TtftWindow
from warmserve_agent.engine_events import EventSender
from warmserve_agent.engines.layer_gate import LayerGate
from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryKind
from warmserve_agent.engines.spec import EngineSpec, EngineStages, EngineStats
from warmserve_agent.engines.vllm.hooks import (
    cleanup_vllm_process_state,
    extent,
    zero_kv_blocks_on_allocation,
)
from warmserve_agent.engines.vllm.kv import SlotKvPool
from warmserve_agent.engines.vllm.loop import LoopThread

log = logging.getLogger("warmserve.agent.engine.vllm")


def _log_failed_growth(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("event=kv_grow_failed error=%r", str(fut.exception()))

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
        self._kv: SlotKvPool | None = None
        # The last capacity the agent asked for (raises are queued, so vLLM's own count lags):
        # a request below it is a lowering, answered only once vLLM has kept what it must.
        self._kv_asked = 0
        self._kv_lock = threading.Lock()
        self._events = EventSender("", "")
        self._prepared = False  # built by prepare() and not started yet
        self._tp = 1  # tensor-parallel ranks (the others in their GPUs' workers: tp_executor)
        self._t_start = 0.0
        self._t_first_token: float | None = None
        self._stages = EngineStages()
        self.endpoint = ""
        self.ttft = TtftWindow()
        self.timings: dict[str, float] = {}

    # ---- Engine protocol -------------------------------------------------------------------
    def prepare(self, spec: EngineSpec) -> None:
        """Build vLLM's engine and app over the slot now (prewarm time), serving nothing; every
        KV block stays held until the agent maps its pages after :meth:`start`."""
        with _PROCESS_LOCK:
            self._build_over(spec, partial=True)
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
        assert self._mem is not None and self._kv is not None and self._client is not None
        self._mem.update(spec.regions[0])  # the weights mapped since the engine was prepared
        # completions and KV waits go to the agent (the instance exists only now)
        self._events = self._kv.events = EventSender(spec.events_addr, spec.instance_id)
        self.grow_kv_cache(spec.kv_capacity_bytes)  # the KV the agent mapped already
        t_kv = time.perf_counter() - t0
        self._client.on_step = self._kv.after_step
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
        assert self._client is not None and self._gate is not None and self._kv is not None
        sched = self._client.engine_core.scheduler
        running, waiting = sched.get_request_counts()
        capacity, used = self._kv.usage()
        tp = self._tp  # every rank holds the same blocks (its heads of them): bytes x ranks
        p95, n = self.ttft.p95()
        first = self._t_first_token
        st = self._stages
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_used_bytes=used * tp,
            kv_capacity_bytes=capacity * tp,
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
            kv_wanted_bytes=self._kv.wanted * tp,
            kv_geometry=self._kv.geometry,
        )

    def set_kv_capacity(self, nbytes: int) -> int:
        """The agent's capacity for this engine: raised as its background mapping lands (and
        when lent KV grows back) through :meth:`grow_kv_cache`, lowered before it lends pages
        (Eq. 1).  Answers the capacity kept, in bytes (summed over the ranks, as asked)."""
        assert self._client is not None and self._kv is not None
        kv = self._kv
        per_rank = int(nbytes) // self._tp
        with self._kv_lock:
            if per_rank >= self._kv_asked:
                return self._grow(per_rank, wait=False) * self._tp
            # A lowering waits for the raises queued before it and for vLLM's answer: it keeps
            # the blocks in use, and the agent gives away only the pages above what it kept.
            kept = int(self._client.call_sync(lambda: kv.resize(per_rank)))
            self._kv_asked = kept
            return kept * self._tp

    def grow_kv_cache(self, nbytes: int, *, wait: bool = True) -> int:
        """Raise the KV capacity to ``nbytes``: the newly usable blocks' pages are mapped in
        this process (checked against the agent's page table on the simulated backend), then
        handed to vLLM's scheduler, which zeroes each block as it gives it to a request (engine
        thread, between steps; ``kv.py``).  The one place the KV cache grows: at :meth:`start`
        (what the agent mapped already: a prepared engine's blocks are all held until then) and
        whenever the agent's background mapping raises the capacity.  Returns the capacity
        kept, in bytes.

        ``wait=False`` (a raise from the agent's pager) queues the growth for the engine thread
        and returns the capacity it will keep: the engine may be inside a forward that waits for
        a layer, which the agent delivers through this worker's command pipe, so waiting here
        would hold that pipe until the forward gives up (a partial prewarm's first token).

        ``nbytes`` is summed over the tensor-parallel ranks (the agent's unit); each rank's
        pages are mapped by that rank's worker before (``tp_executor.VllmRank.resize_kv``)."""
        return self._grow(int(nbytes) // self._tp, wait=wait) * self._tp

    def _grow(self, nbytes: int, *, wait: bool = True) -> int:
        """:meth:`grow_kv_cache` on this rank's bytes."""
        assert self._client is not None and self._kv is not None
        kv = self._kv
        if wait:
            kept = int(self._client.call_sync(lambda: kv.resize(int(nbytes))))
            self._kv_asked = kept
            return kept
        fut = self._client.call_later(lambda: kv.resize(int(nbytes)))
        fut.add_done_callback(_log_failed_growth)
        g = kv.geometry
        self._kv_asked = min(g.num_blocks, max(0, int(nbytes)) // g.block_bytes) * g.block_bytes
        return self._kv_asked

    def stop(self) -> None:
        from warmserve_agent.engines.vllm.loader import release_slot

        if self._gate is not None:
            self._gate.close()  # a forward waiting for a layer gives up
        self._loop.stop(self._shutdown)
        if self._key:
            release_slot(self._key)
        self._slot = None
        self._llm = self._client = self._server = self._app = None
        self._kv = None
        self._kv_asked = 0
        self._events.close()
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
        from warmserve_agent.engines.vllm.cpu_threads import adopt, use_rank_threads
        from warmserve_agent.engines.vllm.loader import ActiveSlot, activate_slot

        t0 = time.perf_counter()
        self._tp = spec.tp_size
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
        use_rank_threads(spec.tp_size)  # before the engine's threads and its group exist
        if partial:
            why = runs_forward_while_building(config)
            if why:
                raise EngineError(f"cannot prepare this engine ahead of activation: {why}")
        activate_slot(self._key, self._slot)
        _LIVE.add(id(self))  # vLLM's process state is ours from here (stop releases it)
        built: list[Any] = []

        async def make() -> None:
            adopt()  # the loop thread builds the model and its attention metadata
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
        # vLLM built its pool with every block free: hold them all; the agent maps the KV range
        # after start and each growth hands blocks back (grow_kv_cache).
        kv = self._kv = SlotKvPool(self._slot, self._mem, self._client, self._events)
        self._client.call_sync(lambda: kv.start(0))
        self.timings["engine_s"] = time.perf_counter() - t0
        log.info(
            "event=vllm_built model=%s slot=%s prepared=%s engine_s=%.2f kv_bytes=%d",
            spec.model,
            spec.slot_id,
            partial,
            self.timings["engine_s"],
            kv_bytes,
        )

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

    def slot_params(self) -> dict[str, tuple[int, int, bytes]]:
        """Every parameter's offset in the slot and the slot's bytes there (``tp_executor``)."""
        from warmserve_agent.engines.vllm.tp_executor import slot_params

        assert self._mem is not None
        return slot_params(self.model(), self._mem)

    # ---- on the engine's loop ------------------------------------------------------------------
    async def _open_endpoint(self, spec: EngineSpec) -> str:
        from warmserve_agent.engines.vllm.build import open_endpoint

        self._server, self._serve_task, endpoint = await open_endpoint(spec, self._app)
        return endpoint

    async def _shutdown(self) -> None:
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            # uvicorn waits for the requests in flight: abort them in vLLM (each answers at
            # once), again for any that reached the engine meanwhile, so stop never waits for a
            # request (a long answer, one waiting for KV blocks lent in grace)
            end = time.monotonic() + 30
            while not self._serve_task.done() and time.monotonic() < end:
                await self._abort_requests()
                await asyncio.wait({self._serve_task}, timeout=0.1)
            if not self._serve_task.done():
                self._serve_task.cancel()
                await asyncio.wait({self._serve_task}, timeout=5)
        if self._llm is not None:
            self._llm.shutdown()

    async def _abort_requests(self) -> None:
        if self._llm is None:
            return
        ids = list(self._llm.output_processor.request_states)
        if ids:
            with contextlib.suppress(Exception):  # the engine may have died: nothing to wait on
                await self._llm.abort(ids, internal=True)
