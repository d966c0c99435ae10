"""The ``simulated`` engine: an OpenAI-compatible server paced from the model's profile.

It serves ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming),
``/metrics`` (vLLM's metric names, vllm-integration note §6.1) and ``/health``.  It reads its
weights from the slot (never from files), verifies every tensor against the store's blake2b
digests (wrong bytes: a failed start, not silent output) and derives its output tokens from them.

Simplifications (docs/agent.md): one request's decode is paced independently of the batch;
admission reserves KV for prompt + max_tokens (so growth never overruns a shrunk cache); prefill
waits until all layers are resident.

Queue (issue 16): at most ``profile.max_waiting`` requests wait for admission (default 4 x the
batch limit); more are refused at once with 429, and a request whose client disconnects while it
waits or while it decodes is dropped (aiohttp cancels its handler), so abandoned requests never
count as load.  Engine args: vLLM's (``--max-num-seqs`` caps the batch, ``--max-model-len``
refuses longer requests, like vLLM); the others are accepted and have no effect here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from warmserve.engine_args import parse_engine_args
from warmserve_agent.engine import TtftWindow, WeightsMismatch, WeightVerificationError
from warmserve_agent.engines.slotmem import SlotMemory
from warmserve_agent.engines.spec import EngineSpec, EngineStats

log = logging.getLogger("warmserve.agent.engine")

_VOCAB = (
    "the",
    "a",
    "warm",
    "serve",
    "model",
    "token",
    "cache",
    "page",
    "slot",
    "layer",
    "prefill",
    "decode",
    "batch",
    "grace",
    "prewarm",
    "universal",
    "dedicated",
    "idle",
    "worker",
    "memory",
    "gpu",
    "weights",
    "kv",
    "request",
    "load",
    "window",
    "peak",
)


@dataclass
class _State:
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_reserved: int = 0
    kv_capacity: int = 0
    layers_resident: int = 0
    layers_total: int = 0
    served: int = 0
    dropped: int = 0
    cond: asyncio.Condition | None = None
    seed: bytes = b""
    bad: list[str] = field(default_factory=list)


class SimulatedEngine:
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
        self._st = _State()
        self.spec: EngineSpec | None = None
        self._mem: dict[int, SlotMemory] = {}
        self.endpoint = ""
        self.ttft = TtftWindow()
        self.max_batch = 1
        self.max_model_len = 0
        self.max_waiting = 1

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
    def start(self, spec: EngineSpec) -> str:
        self.spec = spec
        args = parse_engine_args(spec.engine_args)
        self.max_batch = min(spec.profile.max_batch, args.get("max_num_seqs") or 1 << 30)
        self.max_model_len = int(args.get("max_model_len") or 0)
        self.max_waiting = spec.profile.max_waiting or 4 * self.max_batch
        # Ranks this engine can read: every file-backed shard, or its own GPU's; the engine
        # host verifies the other ranks in their own workers.
        for rank, region in enumerate(spec.regions):
            if region.host_file or (region.local and self._backend is not None):
                self._mem[rank] = SlotMemory(region, self._backend)
        if not self._mem:
            raise WeightVerificationError("the engine cannot read any shard of its slot")
        st = self._st
        st.layers_total = spec.layers_total
        st.kv_capacity = spec.kv_capacity_bytes
        bad = self._verify(0, spec.layers_resident)
        if bad:
            raise WeightVerificationError(
                f"weights in the slot differ from the store for {len(bad)} tensors "
                f"(first: {bad[0]}); evict the slot and prewarm again"
            )
        st.layers_resident = spec.layers_resident
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("engine HTTP server did not start within 30 s")
        return self.endpoint

    def layers_ready(self, n: int) -> None:
        st = self._st
        if n <= st.layers_resident:
            return
        bad = self._verify(st.layers_resident, n)
        if bad:
            st.bad.extend(bad)
            raise WeightsMismatch(f"weights differ from the store: {bad[:3]}")
        self._on_loop(self._set(layers_resident=n))

    def set_kv_capacity(self, nbytes: int) -> int:
        async def apply() -> int:
            st = self._st
            st.kv_capacity = max(int(nbytes), st.kv_reserved)
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
        )

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None and not self._stopping:
            self._on_loop(self._runner.cleanup())
            with self._loop_lock:
                self._stopping = True
                self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        for m in self._mem.values():
            m.close()
        self._mem = {}
        self._loop = self._thread = self._runner = None

    # ---- HTTP server -----------------------------------------------------------------------
    async def _set(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self._st, k, v)
        await self._notify()

    async def _notify(self) -> None:
        assert self._st.cond is not None
        async with self._st.cond:
            self._st.cond.notify_all()

    def _serve(self, ready: threading.Event) -> None:
        from aiohttp import web

        assert self.spec is not None
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._st.cond = asyncio.Condition()
        self._metrics = _Metrics(self.spec.model)
        app = web.Application()

        async def health(request: Any) -> Any:
            return web.Response(text="ok")

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics_handler)
        # handler_cancellation: a client that disconnects cancels its handler, so a request
        # abandoned while queued or decoding releases its place and KV at once (issue 16).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.spec.host, self.spec.port)
        loop.run_until_complete(site.start())
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.endpoint = self.spec.url(sock.getsockname()[1])
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        assert self.spec is not None
        m = self.spec.model
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "warmserve"}]}
        )

    async def _metrics_handler(self, request: Any) -> Any:
        from aiohttp import web

        body = self._metrics.render(self._st)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> Any:
        from aiohttp import web

        return web.json_response(
            {"error": {"message": message, "type": kind, "code": status}}, status=status
        )

    async def _parse(self, request: Any) -> tuple[dict[str, Any] | None, Any]:
        assert self.spec is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, self._error(400, "request body must be JSON")
        if not isinstance(body, dict):
            return None, self._error(400, "request body must be a JSON object")
        if body.get("model") not in (None, self.spec.model):
            return None, self._error(
                404, f"model {body.get('model')!r} is not served here; this is {self.spec.model}"
            )
        mt = body.get("max_tokens", 16)
        if not isinstance(mt, int) or not 1 <= mt <= 4096:
            return None, self._error(400, "max_tokens must be an integer in [1, 4096]")
        return body, None

    async def _completions(self, request: Any) -> Any:
        body, err = await self._parse(request)
        if err is not None:
            return err
        assert body is not None
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            prompt = " ".join(str(p) for p in prompt)
        if not isinstance(prompt, str):
            return self._error(400, "prompt must be a string or a list of strings")
        return await self._generate(request, body, prompt, chat=False)

    async def _chat(self, request: Any) -> Any:
        body, err = await self._parse(request)
        if err is not None:
            return err
        assert body is not None
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return self._error(400, "messages must be a non-empty list")
        prompt = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        return await self._generate(request, body, prompt, chat=True)

    def _token(self, prompt: str, i: int) -> str:
        h = hashlib.blake2b(
            self._st.seed + prompt.encode() + i.to_bytes(4, "little"), digest_size=4
        )
        return _VOCAB[int.from_bytes(h.digest(), "little") % len(_VOCAB)]

    async def _admit(self, need: int) -> None:
        st = self._st
        assert st.cond is not None
        st.waiting += 1
        try:
            async with st.cond:
                await st.cond.wait_for(
                    lambda: (
                        st.running < self.max_batch
                        and st.kv_reserved + need <= st.kv_capacity
                        and st.layers_resident >= st.layers_total
                    )
                )
                st.running += 1
                st.kv_reserved += need
        except asyncio.CancelledError:
            st.dropped += 1  # the client went away while queued
            raise
        finally:
            st.waiting -= 1

    async def _release(self, need: int, used: int) -> None:
        st = self._st
        st.running -= 1
        st.kv_reserved -= need
        st.kv_used -= used
        st.served += 1
        await self._notify()

    async def _generate(self, request: Any, body: dict[str, Any], prompt: str, chat: bool) -> Any:
        from aiohttp import web

        assert self.spec is not None
        prof = self.spec.profile
        n_prompt = max(1, len(prompt.split()))
        max_tokens = body.get("max_tokens", 16)
        stream = bool(body.get("stream", False))
        kvt = prof.kv_bytes_per_token
        need = (n_prompt + max_tokens) * kvt
        if self.max_model_len and n_prompt + max_tokens > self.max_model_len:
            return self._error(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {n_prompt + max_tokens} ({n_prompt} in the prompt, "
                f"{max_tokens} to generate)",
            )
        if need > self._st.kv_capacity:
            return self._error(
                400, f"prompt + max_tokens need {need} KV bytes, more than the cache"
            )
        if self._st.waiting >= self.max_waiting:
            self._st.dropped += 1
            return self._error(
                429,
                f"{self._st.waiting} requests are already waiting (limit {self.max_waiting}); "
                "retry later",
                kind="rate_limit_error",
            )
        t_arrive = time.perf_counter()
        await self._admit(need)
        used = n_prompt * kvt
        self._st.kv_used += used
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        resp: web.StreamResponse | None = None
        words: list[str] = []
        try:
            await asyncio.sleep(n_prompt / prof.prefill_tok_s)
            ttft = time.perf_counter() - t_arrive
            self._metrics.ttft.observe(ttft)
            self.ttft.observe(ttft)
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(1.0 / prof.decode_tok_s)
                w = self._token(prompt, i)
                words.append(w)
                self._st.kv_used += kvt
                used += kvt
                if resp is not None:
                    piece = ("" if i == 0 else " ") + w
                    chunk = self._chunk(rid, created, piece, chat, None)
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        except asyncio.CancelledError:
            self._st.dropped += 1  # the client went away mid-generation
            raise
        finally:
            await self._release(need, used)
            self._metrics.prompt_tokens.inc(n_prompt)
            self._metrics.gen_tokens.inc(len(words))
            self._metrics.e2e.observe(time.perf_counter() - t_arrive)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(words),
            "total_tokens": n_prompt + len(words),
        }
        if resp is not None:
            final = self._chunk(rid, created, "", chat, "length")
            final["usage"] = usage
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        text = " ".join(words)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
            obj = "text_completion"
        return web.json_response(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.spec.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def _chunk(
        self, rid: str, created: int, piece: str, chat: bool, finish: str | None
    ) -> dict[str, Any]:
        assert self.spec is not None
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece, "logprobs": None}
            obj = "text_completion"
        choice["finish_reason"] = finish
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.spec.model,
            "choices": [choice],
        }


class _Metrics:
    """vLLM-named Prometheus metrics (vllm-integration note §6.1) for one engine."""

    def __init__(self, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.reg = CollectorRegistry()
        lab = ["model_name"]
        self.model = model
        self.running = Gauge(
            "vllm:num_requests_running", "Requests running", lab, registry=self.reg
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting", lab, registry=self.reg
        )
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", lab, registry=self.reg)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens", lab, registry=self.reg
        ).labels(model)
        self.gen_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", lab, registry=self.reg
        ).labels(model)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "TTFT", lab, registry=self.reg
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency", lab, registry=self.reg
        ).labels(model)

    def render(self, st: _State) -> bytes:
        from prometheus_client import generate_latest

        m = self.model
        self.running.labels(m).set(st.running)
        self.waiting.labels(m).set(st.waiting)
        self.kv.labels(m).set(st.kv_used / st.kv_capacity if st.kv_capacity else 0.0)
        return generate_latest(self.reg)
