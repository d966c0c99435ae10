"""Engines a GPU worker process hosts, and the simulated engine.

:class:`Engine` is the interface the worker process drives (the agent talks to the worker, the
worker to its engine):

* ``start(spec)`` — take over an activated slot (weights at its start, KV cache after them) and
  serve; returns the endpoint.  The engine does **not** load weights: it reads them from the slot.
* ``layers_ready(n)`` — the first ``n`` layers are now resident (the rest of a partially
  prewarmed model keeps loading while the instance serves, §4.1 last paragraph).
* ``set_kv_capacity(bytes)`` — grow or shrink the KV cache (grace-period lending, Eq. 1); the
  engine answers the capacity it actually accepted (never below what admitted requests need),
  and the agent unmaps only pages beyond that.
* ``stats()`` — R (running), waiting, K (KV bytes in use), M (KV capacity): Eq. 1's inputs.
* ``stop()``.

A vLLM engine would implement the same interface in the same process (vllm-integration note §0):
``start`` builds the model with the ``warmserve_slot`` loader over the slot's weights and a
pluggable allocator serving the KV cache from the slot; ``set_kv_capacity`` trims the block pool
from the engine loop (note §3.5); ``stats`` reads the scheduler's block pool (note §6.2).

:class:`SimulatedEngine` serves a real OpenAI-compatible HTTP API (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` with SSE streaming, ``/metrics`` with vLLM's metric
names, ``/health``) and paces prefill and decode from the model's profile.  It verifies the
weights it reads from the slot against the store's digests (byte for byte via blake2b) and
derives its output tokens from them, so wrong weights give a failed start, not silent output.
Simplifications (documented in docs/agent.md): one request's decode is paced independently of
the batch; admission reserves KV for prompt + max_tokens (so growth never overruns a shrunk
cache); prefill waits until all layers are resident.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("warmserve.agent.engine")

_VOCAB = [
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
]


class Engine(Protocol):
    def start(self, spec: dict[str, Any]) -> dict[str, Any]: ...
    def layers_ready(self, n: int) -> list[str]: ...
    def set_kv_capacity(self, nbytes: int) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def stop(self) -> None: ...


class WeightVerificationError(RuntimeError):
    pass


class WeightsMismatch(RuntimeError):
    """Layers announced as resident do not match the store (raised by engine hosts)."""


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
    cond: asyncio.Condition | None = None
    seed: bytes = b""
    bad: list[str] = field(default_factory=list)


class SimulatedEngine:
    """OpenAI-compatible HTTP engine over weights read from a (simulated) slot."""

    def __init__(self, read_va: Callable[[int, int], bytes] | None = None) -> None:
        # read_va(va, nbytes): read this process's own GPU memory by virtual address (the
        # worker's backend); used when the spec gives virtual addresses instead of files.
        self._read_va = read_va
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self._st = _State()
        self.spec: dict[str, Any] = {}
        self._readers: list[Any] = []
        self.endpoint = ""

    # ---- weights ---------------------------------------------------------------------------
    def _read(self, rank: int, offset: int, nbytes: int) -> bytes:
        w = self.spec["weights"][rank]
        if "va" in w:
            assert self._read_va is not None
            return self._read_va(w["va"] + offset, nbytes)
        return self._readers[rank].read(w["ppages"], offset, nbytes)

    def _ranks(self) -> list[int]:
        """Ranks this engine can read: every file-backed shard, or its own GPU's (by VA); the
        engine host verifies the other ranks in their own workers."""
        return [
            r
            for r, w in enumerate(self.spec["weights"])
            if "path" in w or (w.get("local") and self._read_va is not None)
        ]

    def _verify(self, start: int, end: int) -> list[str]:
        """Tensors of layers [start, end) whose slot bytes differ from the store's digests."""
        bad = []
        h = hashlib.blake2b(self._st.seed, digest_size=16)
        for i, t in enumerate(self.spec["tensors"]):
            if not (start <= t["layer"] < end):
                continue
            for rank in self._ranks():
                off, n = t["offset"], t["shard_len"][rank]
                digest = hashlib.blake2b(self._read(rank, off, n), digest_size=16).digest()
                if digest.hex() != self.spec["digests"][rank][i]:
                    bad.append(f"{t['name']}[rank {rank}]")
                h.update(digest)
        self._st.seed = h.digest()
        return bad

    # ---- Engine interface ------------------------------------------------------------------
    def start(self, spec: dict[str, Any]) -> dict[str, Any]:
        from warmserve_agent.backends.simulated import PhysicalReader

        self.spec = spec
        self._readers = [
            PhysicalReader(w["path"], spec["page_bytes"]) if "path" in w else None
            for w in spec["weights"]
        ]
        if not self._ranks():
            raise WeightVerificationError("the engine cannot read any shard of its slot")
        st = self._st
        st.layers_total = spec["layers_total"]
        st.kv_capacity = spec["kv_capacity_bytes"]
        t0 = time.perf_counter()
        bad = self._verify(0, spec["layers_resident"])
        if bad:
            raise WeightVerificationError(
                f"weights in the slot differ from the store for {len(bad)} tensors "
                f"(first: {bad[0]}); evict the slot and prewarm again"
            )
        st.layers_resident = spec["layers_resident"]
        verify_s = time.perf_counter() - t0
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(spec.get("port", 0), ready), daemon=True
        )
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("engine HTTP server did not start within 30 s")
        return {"endpoint": self.endpoint, "verify_s": verify_s}

    def layers_ready(self, n: int) -> list[str]:
        st = self._st
        if n <= st.layers_resident:
            return []
        bad = self._verify(st.layers_resident, n)
        if bad:
            st.bad.extend(bad)
            return bad
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._set(layers_resident=n), self._loop).result(10)
        return []

    def set_kv_capacity(self, nbytes: int) -> int:
        assert self._loop is not None

        async def apply() -> int:
            st = self._st
            st.kv_capacity = max(int(nbytes), st.kv_reserved)
            await self._notify()
            return st.kv_capacity

        return asyncio.run_coroutine_threadsafe(apply(), self._loop).result(10)

    def stats(self) -> dict[str, Any]:
        st = self._st
        return {
            "running": st.running,
            "waiting": st.waiting,
            "kv_used_bytes": st.kv_used,
            "kv_reserved_bytes": st.kv_reserved,
            "kv_capacity_bytes": st.kv_capacity,
            "layers_resident": st.layers_resident,
            "served": st.served,
            "bad_tensors": list(st.bad),
        }

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        for r in self._readers:
            if r is not None:
                r.close()
        self._readers = []
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

    def _serve(self, port: int, ready: threading.Event) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._st.cond = asyncio.Condition()
        self._metrics = _Metrics(self.spec["model"])
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics_handler)
        self._runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(self._runner.setup())
        host = self.spec.get("host", "127.0.0.1")
        site = web.TCPSite(self._runner, host, port)
        loop.run_until_complete(site.start())
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        advertise = self.spec.get("advertise_host") or host
        if ":" in advertise and not advertise.startswith("["):
            advertise = f"[{advertise}]"  # an IPv6 literal needs brackets in a URL (RFC 3986)
        self.endpoint = f"http://{advertise}:{sock.getsockname()[1]}"
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        m = self.spec["model"]
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "warmserve"}]}
        )

    async def _metrics_handler(self, request: Any) -> Any:
        from aiohttp import web

        st = self._st
        body = self._metrics.render(st)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    def _error(self, status: int, message: str) -> Any:
        from aiohttp import web

        return web.json_response(
            {"error": {"message": message, "type": "invalid_request_error", "code": status}},
            status=status,
        )

    async def _parse(self, request: Any) -> tuple[dict[str, Any] | None, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, self._error(400, "request body must be JSON")
        if not isinstance(body, dict):
            return None, self._error(400, "request body must be a JSON object")
        if body.get("model") not in (None, self.spec["model"]):
            return None, self._error(
                404, f"model {body.get('model')!r} is not served here; this is {self.spec['model']}"
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
        prof = self.spec["profile"]
        assert st.cond is not None
        st.waiting += 1
        try:
            async with st.cond:
                await st.cond.wait_for(
                    lambda: (
                        st.running < prof["max_batch"]
                        and st.kv_reserved + need <= st.kv_capacity
                        and st.layers_resident >= st.layers_total
                    )
                )
                st.running += 1
                st.kv_reserved += need
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

        prof = self.spec["profile"]
        n_prompt = max(1, len(prompt.split()))
        max_tokens = body.get("max_tokens", 16)
        stream = bool(body.get("stream", False))
        kvt = prof["kv_bytes_per_token"]
        need = (n_prompt + max_tokens) * kvt
        if need > self._st.kv_capacity:
            return self._error(
                400, f"prompt + max_tokens need {need} KV bytes, more than the cache"
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
            await asyncio.sleep(n_prompt / prof["prefill_tok_s"])
            self._metrics.ttft.observe(time.perf_counter() - t_arrive)
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(1.0 / prof["decode_tok_s"])
                w = self._token(prompt, i)
                words.append(w)
                self._st.kv_used += kvt
                used += kvt
                if resp is not None:
                    piece = ("" if i == 0 else " ") + w
                    chunk = self._chunk(rid, created, piece, chat, None)
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
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
                "model": self.spec["model"],
                "choices": [choice],
                "usage": usage,
            }
        )

    def _chunk(
        self, rid: str, created: int, piece: str, chat: bool, finish: str | None
    ) -> dict[str, Any]:
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
            "model": self.spec["model"],
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


def verify_shard(
    read_va: Callable[[int, int], bytes], va: int, tensors: list[tuple[str, int, int, str]]
) -> list[str]:
    """Names of tensors whose bytes at ``va + offset`` differ from their blake2b-128 digest.

    Run by a worker on its own GPU's shard of a slot (tensor-parallel ranks other than the one
    hosting the engine)."""
    bad = []
    for name, off, n, digest in tensors:
        if hashlib.blake2b(read_va(va + off, n), digest_size=16).hexdigest() != digest:
            bad.append(name)
    return bad
