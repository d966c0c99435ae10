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

KV cache (``kv.py``): vLLM sizes its block pool for the whole KV range at start, but the agent
maps that range in the background and raises the capacity as pages land; ``set_kv_capacity``
keeps usable exactly the blocks the capacity allows (the others are taken out of the pool's
free queue between engine steps), maps their pages in this process first and zeroes them.  The
engine reports its layout (vLLM's is layer-major: a little of every layer's region per block) so
the agent maps pages in the order blocks need them and, when lending in grace (Eq. 1), takes
back exactly the pages no kept block touches.  Finished requests and requests waiting for blocks
are reported to the agent on its engine-event socket (hooked where the engine core finishes a
step, ``inproc.py``), so the agent re-checks Eq. 1 on each completion and grows lent KV back.
Stats: R, waiting, K, M from vLLM's scheduler and block pool; TTFT from vLLM's iteration stats.
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
from warmserve_agent.engine_events import EventSender
from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryKind
from warmserve_agent.engines.spec import EngineSpec, EngineStats
from warmserve_agent.engines.vllm.hooks import (
    HoldUntilResident,
    cleanup_vllm_process_state,
    extent,
    slot_dtype,
    ttft_logger_factory,
)
from warmserve_agent.engines.vllm.kv import SlotKvPool

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
        self._kv: SlotKvPool | None = None
        self._events = EventSender("", "")
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
        assert self._client is not None and self._kv is not None
        sched = self._client.engine_core.scheduler
        running, waiting = sched.get_request_counts()
        capacity, used = self._kv.usage()
        p95, n = self.ttft.p95()
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_used_bytes=used,
            kv_capacity_bytes=capacity,
            layers_resident=self._layers,
            max_batch=int(self._llm.vllm_config.scheduler_config.max_num_seqs),
            ttft_p95_s=p95,
            ttft_samples=n,
            ttft_window_s=self.ttft.window_s,
            kv_wanted_bytes=self._kv.wanted,
            kv_geometry=self._kv.geometry,
        )

    def set_kv_capacity(self, nbytes: int) -> int:
        assert self._client is not None and self._kv is not None
        kv = self._kv
        return int(self._client.call_sync(lambda: kv.resize(int(nbytes))))

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
        self._kv = None
        self._events.close()
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
        # the KV blocks the agent mapped already (none while it maps in the background)
        self._events = EventSender(spec.events_addr, spec.instance_id)
        kv = self._kv = SlotKvPool(self._slot, self._mem, self._client, self._events)
        await self._client.call_in_engine_thread(lambda: kv.start(spec.kv_capacity_bytes))
        self._client.on_step = kv.after_step
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
