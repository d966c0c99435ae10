"""The ``simulated`` engine: an OpenAI-compatible server paced from the model's profile.

It serves ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming),
``/metrics`` (vLLM's metric names, vllm-integration note §6.1) and ``/health``.  It reads its
weights from the slot (never from files), verifies every tensor against the store's blake2b
digests (wrong bytes: a failed start, not silent output) and derives its output tokens from them.

Simplifications (docs/agent.md): one request's decode is paced independently of the batch;
admission reserves KV pages for prompt + max_tokens (so growth never overruns a shrunk cache).
Prefill runs layer by layer, each layer waiting only until it is resident (as the ``vllm`` engine
does).

KV cache (``simulated_kv.py``): real pages of the slot's KV range, granted as the agent maps them
(``set_kv_capacity``), written and read back by requests with a page-table check on every
access.  A finished request and a request waiting for KV pages are reported to the agent
(``engine_events.py``): the agent re-checks Eq. 1 for a grace instance on completion and grows
its lent KV back when a request needs it.

Lifecycle: ``prepare(spec)`` (prewarm time) parses the arguments, opens the slot and sets up the
HTTP app without listening; ``start(spec)`` maps the weights loaded since, verifies the resident
layers, takes the KV the agent mapped already and opens the endpoint (it prepares first when
nothing was prepared).

Queue: at most ``profile.max_waiting`` requests wait for admission (default 4 x the
batch limit); more are refused at once with 429, and a request whose client disconnects while it
waits or while it decodes is dropped (aiohttp cancels its handler), so abandoned requests never
count as load.  Stopping the engine aborts the requests in flight or queued, each answered with
an error, instead of waiting for them (as the ``vllm`` engine aborts them in vLLM).  Engine
args: vLLM's (``--max-num-seqs`` caps the batch, ``--max-model-len`` refuses longer requests,
like vLLM); the others are accepted and have no effect here.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Any

from warmserve.engine_args import parse_engine_args
from warmserve_agent.engine import (
    EngineError,
    TtftWindow,
    WeightsMismatch,
    WeightVerificationError,
)
from warmserve_agent.engine_events import EventSender
from warmserve_agent.engines.simulated_kv import SimKvCache
from warmserve_agent.engines.simulated_openai import EngineState, OpenAIServing
from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryKind
from warmserve_agent.engines.spec import EngineSpec, EngineStages, EngineStats


class SimulatedEngine(OpenAIServing):
    """OpenAI-compatible HTTP engine over weights read from a (simulated) slot."""

    def __init__(self, backend: Any = None) -> None:
        # backend: the worker's own memory backend when it owns the slot's memory (memory in
        # workers); None when the slot is a shared simulated file readable by physical page.
        self._backend = backend
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        # nothing is scheduled on the loop once stop() began: a coroutine handed to a stopped
        # or closed loop never runs (its caller would wait out the timeout, and Python warns
        # that it was never awaited)
        self._loop_lock = threading.Lock()
        self._stopping = False
        self._st = EngineState()
        self.spec: EngineSpec | None = None
        self._mem: dict[int, SlotMemory] = {}
        self.endpoint = ""
        self.ttft = TtftWindow()
        self.max_batch = 1
        self.max_model_len = 0
        self.max_waiting = 1
        self._prepared = False
        self._t_start = 0.0
        self._t_first_token: float | None = None
        self._stages = EngineStages()
        self._kv: SimKvCache | None = None  # type: ignore[assignment]
        self._events = EventSender("", "")

    # ---- weights ---------------------------------------------------------------------------
    def _verify(self, start: int, end: int) -> list[str]:
        """Tensors of layers [start, end) whose slot bytes differ from the store's digests."""
        assert self.spec is not None
        bad = []
        h = hashlib.blake2b(self._st.seed, digest_size=16)
        for i, t in enumerate(self.spec.tensors):
            if not (start <= t.layer < end):
                continue
            for rank, mem in self._mem.items():
                data = mem.read(t.offset, t.shard_len[rank])
                digest = hashlib.blake2b(data, digest_size=16).digest()
                if digest.hex() != self.spec.digests[rank][i]:
                    bad.append(f"{t.name}[rank {rank}]")
                h.update(digest)
        self._st.seed = h.digest()
        return bad

    # ---- Engine protocol -------------------------------------------------------------------
    def prepare(self, spec: EngineSpec) -> None:
        """Everything that needs no resident weight: arguments, the slot's memory (pages not
        mapped yet stay inaccessible), the HTTP app on its loop thread (not listening)."""
        self.spec = spec
        # the agent applied its allowlist before (Activator.check_engine)
        args = parse_engine_args(spec.engine_args, policy=None)
        self.max_batch = min(spec.profile.max_batch, args.get("max_num_seqs") or 1 << 30)
        self.max_model_len = int(args.get("max_model_len") or 0)
        self.max_waiting = spec.profile.max_waiting or 4 * self.max_batch
        # Ranks this engine can read: every file-backed shard, or its own GPU's; the engine
        # host verifies the other ranks in their own workers.
        for rank, region in enumerate(spec.regions):
            if region.host_file or (region.local and self._backend is not None):
                mem = self._mem[rank] = SlotMemory(region, self._backend, partial=True)
                if mem.kind != SlotMemoryKind.DEVICE:
                    # mapped now, as vLLM's build maps its parameters over the slot: through
                    # the slot's page table, which goes with the slot
                    mem.host_mapping()
        if not self._mem:
            raise EngineError("the engine cannot read any shard of its slot")
        self._st.layers_total = spec.layers_total
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("engine HTTP server did not start within 30 s")
        self._prepared = True

    def start(self, spec: EngineSpec) -> str:
        t0 = self._t_start = time.perf_counter()
        prepared = self._prepared
        if prepared:
            assert self.spec is not None
            if spec.prepared_key() != self.spec.prepared_key():
                raise EngineError("the prepared engine was built for another slot or arguments")
            self.spec = spec
            for rank, mem in self._mem.items():
                mem.update(spec.regions[rank])
        else:
            self.prepare(spec)
        self._prepared = False
        t_ready = time.perf_counter() - t0
        st = self._st
        self._kv = SimKvCache(spec, self._mem)
        self._events = EventSender(spec.events_addr, spec.instance_id)
        bad = self._verify(0, spec.layers_resident)
        if bad:
            raise WeightVerificationError(
                f"weights in the slot differ from the store for {len(bad)} tensors "
                f"(first: {bad[0]}); evict the slot and prewarm again",
                tensors=bad,
            )
        st.layers_resident = spec.layers_resident
        st.kv_capacity = self._kv.grant(spec.kv_capacity_bytes)  # what is mapped already
        t_kv = time.perf_counter() - t0
        self._on_loop(self._listen(), timeout=30)
        self._stages = EngineStages(prepared, t_ready, t_kv, time.perf_counter() - t0)
        return self.endpoint

    def _first_token(self) -> None:
        if self._t_first_token is None:
            self._t_first_token = time.perf_counter()

    def layers_ready(self, n: int) -> None:
        st = self._st
        if n <= st.layers_resident:
            return
        bad = self._verify(st.layers_resident, n)
        if bad:
            st.bad.extend(bad)
            raise WeightsMismatch(f"weights differ from the store: {bad[:3]}", tensors=bad)
        self._on_loop(self._set(layers_resident=n))

    def set_kv_capacity(self, nbytes: int) -> int:
        async def apply() -> int:
            st = self._st
            # never below the pages in use; before start there is no range to map
            st.kv_capacity = int(nbytes) if self._kv is None else self._kv.grant(int(nbytes))
            await self._notify()
            return st.kv_capacity

        return self._on_loop(apply())

    def _on_loop(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run ``coro`` on the engine's loop and wait for it; refused once the engine stops."""
        with self._loop_lock:
            if self._loop is None or self._stopping or self._loop.is_closed():
                coro.close()
                raise RuntimeError("the simulated engine is stopped")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def stats(self) -> EngineStats:
        st = self._st
        p95, n = self.ttft.p95()
        return EngineStats(
            running=st.running,
            waiting=st.waiting,
            kv_used_bytes=st.kv_used,
            kv_capacity_bytes=st.kv_capacity,
            kv_reserved_bytes=st.kv_reserved,
            layers_resident=st.layers_resident,
            served=st.served,
            dropped=st.dropped,
            ttft_p95_s=p95,
            ttft_samples=n,
            ttft_window_s=self.ttft.window_s,
            bad_tensors=tuple(st.bad),
            stages=EngineStages(
                self._stages.prepared,
                self._stages.engine_ready_s,
                self._stages.kv_mapped_s,
                self._stages.endpoint_up_s,
                None if self._t_first_token is None else self._t_first_token - self._t_start,
            ),
            kv_wanted_bytes=self._kv.wanted_bytes() if self._kv is not None else 0,
            kv_geometry=self._kv.geometry if self._kv is not None else None,
        )

    def kv_violations(self) -> int:
        """KV accesses refused because their page was not mapped to this engine (tests)."""
        return 0 if self._kv is None else self._kv.violations

    async def _close(self) -> None:
        # requests in flight are answered with an error first: the server's shutdown would
        # wait for them (a long answer, a request waiting for KV pages lent in grace)
        await self._abort_all()
        await self._runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None and not self._stopping:
            with self._loop_lock:  # nothing new is scheduled from here on (a loader thread's
                self._stopping = True  # layers_ready racing stop must not be left pending)
                done = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
            done.result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._events.close()
        for m in self._mem.values():
            m.close()
        self._mem = {}
        self._loop = self._thread = self._runner = None
