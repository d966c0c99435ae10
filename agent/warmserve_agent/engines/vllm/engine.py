"""The ``vllm`` engine: real vLLM in the pooled worker process, built over the prewarm slot.

``start(spec)`` (the process imported torch + vLLM long before, ``preload.py``):

1. opens the slot (``SlotMemory``: host memory on the simulated backend, the VMM range on CUDA);
2. parses ``spec.engine_args`` with **vLLM's own** ``vllm serve`` argument parser and adds what
   warmserve decides: ``--load-format warmserve_slot`` (``loader.py``: parameters are views of
   the slot), ``--kv-cache-memory-bytes`` = the slot's pages after the weights,
   ``--served-model-name`` = the model, TP 1;
3. builds vLLM's ``AsyncLLM`` with its engine core in this process (``inproc.py``) and the KV
   cache placed in the slot (``loader.slot_kv_cache``);
4. serves vLLM's own OpenAI server app (``build_app`` + ``init_app_state``: ``/v1/completions``,
   ``/v1/chat/completions`` with streaming, ``/v1/models``, ``/metrics`` with vLLM's metric
   names, ``/health``) with uvicorn on an ephemeral port.

Partial prewarm: the agent maps the whole weight range at activation and keeps streaming the
missing layers into it (its loader thread) **while** vLLM builds the engine over the slot, so the
load overlaps engine construction (vllm-integration note §2.5, "recommended overlap"); requests
are held (not refused) until ``layers_ready(n)`` reports every layer resident.  vLLM cannot run a
model with layers missing, so that is the earliest a token can be served.

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
import json
import logging
import math
import os
import socket
import threading
import time
from typing import Any

from warmserve.engine_args import parse_engine_args
from warmserve.tracing import traces_url, vllm_tracing_env
from warmserve_agent.engine import EngineError, TtftWindow
from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryKind
from warmserve_agent.engines.spec import EngineSpec, EngineStats
from warmserve_agent.engines.vllm.hooks import (
    HoldUntilResident,
    cleanup_vllm_process_state,
    extent,
    slot_dtype,
    ttft_logger_factory,
)

log = logging.getLogger("warmserve.agent.engine.vllm")


class VllmEngine:
    """Engine protocol over vLLM (see module docstring)."""

    build_timeout_s = 900.0

    def __init__(self, backend: Any = None) -> None:
        self._backend = backend
        self.spec: EngineSpec | None = None
        self._mem: SlotMemory | None = None
        self._slot: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._llm: Any = None
        self._client: Any = None
        self._server: Any = None
        self._ready: asyncio.Event | None = None
        self._layers = 0
        self._lent: list[Any] = []
        self._phys_limit = 0  # KV bytes (from the KV start) this process may still touch
        self.endpoint = ""
        self.ttft = TtftWindow()
        self.timings: dict[str, float] = {}

    # ---- Engine protocol -------------------------------------------------------------------
    def start(self, spec: EngineSpec) -> str:
        import torch

        from warmserve_agent.engines.vllm.loader import ActiveSlot, activate_slot

        if spec.tp_size != 1:
            raise EngineError(
                "the vllm engine serves tensor-parallel size 1 only for now: the slot layout "
                "splits tensors by bytes, not by vLLM's row/column sharding (docs/agent.md)"
            )
        self.spec = spec
        region = spec.regions[0]
        self._mem = SlotMemory(region, self._backend)
        device = torch.device(
            f"cuda:{region.gpu}" if self._mem.kind == SlotMemoryKind.DEVICE else "cpu"
        )
        self._slot = ActiveSlot(spec, self._mem, device)
        activate_slot(spec.instance_id, self._slot)
        self._layers = spec.layers_resident
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._serve, args=(started, failure), name="vllm-server", daemon=True
        )
        self._thread.start()
        if not started.wait(self.build_timeout_s):
            raise EngineError(f"vLLM did not start within {self.build_timeout_s:.0f} s")
        if failure:
            self._thread.join(60)
            with contextlib.suppress(Exception):
                self.stop()
            exc = failure[0]
            raise EngineError(f"vLLM failed to start: {type(exc).__name__}: {exc}") from None
        return self.endpoint

    def layers_ready(self, n: int) -> None:
        assert self.spec is not None and self._loop is not None and self._ready is not None
        self._layers = max(self._layers, n)
        if self._layers >= self.spec.layers_total:
            self._loop.call_soon_threadsafe(self._ready.set)

    def stats(self) -> EngineStats:
        assert self._client is not None
        sched = self._client.engine_core.scheduler
        running, waiting = sched.get_request_counts()
        bp = sched.kv_cache_manager.block_pool
        usable = bp.num_gpu_blocks - 1 - len(self._lent)  # block 0 is vLLM's null block
        used = max(0, usable - (bp.get_num_free_blocks()))
        p95, n = self.ttft.p95()
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_used_bytes=used * self._block_bytes,
            kv_capacity_bytes=usable * self._block_bytes,
            layers_resident=self._layers,
            max_batch=int(self._llm.vllm_config.scheduler_config.max_num_seqs),
            ttft_p95_s=p95,
            ttft_samples=n,
            ttft_window_s=self.ttft.window_s,
        )

    def set_kv_capacity(self, nbytes: int) -> int:
        assert self._client is not None
        return int(self._client.call_sync(lambda: self._resize(int(nbytes))))

    def stop(self) -> None:
        from warmserve_agent.engines.vllm.loader import release_slot

        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive() and loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(60)
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(loop.stop)
            thread.join(60)
        if self.spec is not None:
            release_slot(self.spec.instance_id)
        self._slot = None
        self._llm = self._client = self._server = None
        if self._mem is not None:
            self._mem.close()
            self._mem = None
        cleanup_vllm_process_state()
        self._loop = self._thread = None

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

    # ---- the server thread ---------------------------------------------------------------------
    def _serve(self, started: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._build())
        except BaseException as exc:  # reported to start()
            log.exception("event=vllm_start_failed")
            failure.append(exc)
            started.set()
            with contextlib.suppress(Exception):
                loop.run_until_complete(self._shutdown())
            loop.close()
            return
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _build(self) -> None:
        import uvicorn
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        from warmserve_agent.engines.vllm.inproc import inproc_engine_core
        from warmserve_agent.engines.vllm.loader import LOAD_FORMAT, slot_kv_cache

        spec = self.spec
        assert spec is not None
        t0 = time.perf_counter()
        region = spec.regions[0]
        page = region.page_bytes
        kv_bytes = region.mapped_bytes - math.ceil(region.weight_bytes / page) * page
        self._ready = asyncio.Event()
        if self._layers >= spec.layers_total:
            self._ready.set()
        # the agent applied its allowlist before starting us (Activator.check_engine)
        user = parse_engine_args(spec.engine_args, policy=None)
        argv = [
            "--model",
            spec.model_dir,
            # parameters are views of the slot: compute in the checkpoint's dtype unless told
            *([] if "dtype" in user else ["--dtype", slot_dtype(spec)]),
            *spec.engine_args,
            "--served-model-name",
            spec.model,
            "--load-format",
            LOAD_FORMAT,
            "--model-loader-extra-config",
            json.dumps({"warmserve_instance": spec.instance_id}),
            "--kv-cache-memory-bytes",
            str(kv_bytes),
            "--tensor-parallel-size",
            "1",
            "--distributed-executor-backend",
            "uni",  # the model runs in this process (UniProcExecutor), over the slot
            "--host",
            spec.host,
            "--disable-uvicorn-access-log",
        ]
        # The KV budget is the slot's pages; vLLM's CPU platform would let this env var override
        # --kv-cache-memory-bytes.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if spec.traces_endpoint:  # the agent's --otlp-traces-endpoint (never a tenant's arg)
            argv += ["--otlp-traces-endpoint", traces_url(spec.traces_endpoint)]
            os.environ.update(vllm_tracing_env(spec.trace_sample_ratio))
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        if self._slot.device.type == "cuda":  # the worker's GPU (the slot's VMM mappings)
            vllm_config.device_config.device = self._slot.device
        window = self.ttft
        with inproc_engine_core() as made, slot_kv_cache(self._slot):
            self._llm = AsyncLLM.from_vllm_config(
                vllm_config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=[ttft_logger_factory(window)],
                enable_log_requests=False,
                disable_log_stats=False,
            )
        self._client = made[0]
        self.timings["engine_s"] = time.perf_counter() - t0
        self._phys_limit = self._slot.kv_range[1] - self._slot.kv_range[0]
        supported = await self._llm.get_supported_tasks()
        app = build_app(args, supported, vllm_config.model_config)
        await init_app_state(self._llm, app.state, args, supported)
        sock = socket.socket(socket.AF_INET6 if ":" in spec.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((spec.host, spec.port))
        sock.listen(128)
        config = uvicorn.Config(
            HoldUntilResident(app, self), log_level="warning", access_log=False, lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise EngineError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.endpoint = spec.url(sock.getsockname()[1])
        self.timings["start_s"] = time.perf_counter() - t0
        log.info(
            "event=vllm_started model=%s endpoint=%s engine_s=%.2f kv_bytes=%d",
            spec.model,
            self.endpoint,
            self.timings["engine_s"],
            kv_bytes,
        )

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serve_task, 30)
        if self._llm is not None:
            self._llm.shutdown()
