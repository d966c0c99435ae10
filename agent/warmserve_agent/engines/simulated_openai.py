"""The simulated engine's OpenAI-compatible HTTP side (:class:`OpenAIServing`, mixed into
:class:`~warmserve_agent.engines.simulated.SimulatedEngine`): the aiohttp server on its own
thread's loop, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming,
``n`` choices), ``/v1/responses``, ``/v1/embeddings`` refused as vLLM refuses it for a generative
model (:mod:`.simulated_answers`), ``/metrics`` (vLLM's metric names) and ``/health``;
admission against the batch limit, the bounded queue and the KV capacity; tokens paced from
the model's profile; ``usage`` as vLLM 0.32 reports it (always in a whole answer; in a stream
only with ``stream_options.include_usage``, as a last chunk without choices that takes the
``system_fingerprint`` from the finish chunk).  The engine's state
(:class:`EngineState`) is shared with the engine side, which owns weights and the Engine
protocol.  Behaviour and simplifications: :mod:`warmserve_agent.engines.simulated`.

Over 400 lines: one engine's whole OpenAI HTTP surface (routes, streaming, usage, errors), beside
the engine state it serves.
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

from warmserve_agent.engine import TtftWindow
from warmserve_agent.engine_events import EngineEventKind, EventSender
from warmserve_agent.engines import simulated_answers as answers
from warmserve_agent.engines.simulated_kv import SimKvCache
from warmserve_agent.engines.spec import EngineSpec

log = logging.getLogger("warmserve.agent.engine")

ABORTED = "the engine stopped before the request finished: request aborted"
_WORDS = (
    "the a warm serve model token cache page slot layer prefill decode batch grace "
    "prewarm universal dedicated idle worker memory gpu weights kv request load window peak"
)
_VOCAB = tuple(_WORDS.split())


@dataclass
class EngineState:
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
    # the handlers of the requests being served or queued, and whether the engine aborts them
    # (it stops): stop never waits for a request, as vLLM's abort
    inflight: set[asyncio.Task[Any]] = field(default_factory=set)
    aborting: bool = False


class OpenAIServing:
    """HTTP serving of the simulated engine; :class:`SimulatedEngine` sets the fields."""

    spec: EngineSpec | None
    _st: EngineState
    _kv: SimKvCache
    _events: EventSender
    _loop: asyncio.AbstractEventLoop | None
    _runner: Any
    _metrics: Any
    endpoint: str
    ttft: TtftWindow
    max_batch: int
    max_model_len: int
    max_waiting: int

    def _first_token(self) -> None: ...

    async def _set(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self._st, k, v)
        await self._notify()

    async def _notify(self) -> None:
        assert self._st.cond is not None
        async with self._st.cond:
            self._st.cond.notify_all()

    def _serve(self, ready: threading.Event) -> None:
        """The engine's loop thread: the app is set up here (prepare), the socket opened by
        :meth:`_listen` (start)."""
        from aiohttp import web

        assert self.spec is not None
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._st.cond = asyncio.Condition()
        self._metrics = _Metrics(self.spec.model)
        app = web.Application()
        if self.spec.traces_endpoint:  # continue the gateway's trace (engines/tracing.py)
            from warmserve_agent.engines import tracing

            app.middlewares.append(
                tracing.middleware(
                    self.spec.traces_endpoint,
                    self.spec.trace_sample_ratio,
                    self.spec.model,
                    self.spec.instance_id,
                )
            )

        async def health(request: Any) -> Any:
            return web.Response(text="ok")

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/embeddings", self._no_embeddings)
        app.router.add_get("/metrics", self._metrics_handler)
        # handler_cancellation: a client that disconnects cancels its handler, so a request
        # abandoned while queued or decoding releases its place and KV at once.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        loop.run_until_complete(self._runner.setup())
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _listen(self) -> str:
        from aiohttp import web

        assert self.spec is not None
        site = web.TCPSite(self._runner, self.spec.host, self.spec.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.endpoint = self.spec.url(sock.getsockname()[1])
        return self.endpoint

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
        bad = _stream_options_error(body)
        if bad:
            return None, self._error(400, bad)
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
        return await self._generate(request, body, prompt, "completion")

    async def _chat(self, request: Any) -> Any:
        body, err = await self._parse(request)
        if err is not None:
            return err
        assert body is not None
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return self._error(400, "messages must be a non-empty list")
        prompt = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        return await self._generate(request, body, prompt, "chat")

    async def _responses(self, request: Any) -> Any:
        assert self.spec is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "request body must be JSON")
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object")
        if body.get("model") not in (None, self.spec.model):
            return self._error(
                404, f"model {body.get('model')!r} is not served here; this is {self.spec.model}"
            )
        try:
            prompt, max_tokens = answers.responses_prompt(body)
        except answers.BadRequest as exc:
            return self._error(400, str(exc))
        return await self._generate(
            request, {**body, "max_tokens": max_tokens}, prompt, "responses"
        )

    async def _no_embeddings(self, request: Any) -> Any:
        from aiohttp import web

        # vLLM registers /v1/embeddings only for a pooling model; this engine simulates
        # generative ones, so it answers what vLLM's server answers for them.
        return web.json_response(answers.NOT_FOUND_BODY, status=404)

    def _token(self, prompt: str, i: int, choice: int = 0) -> str:
        extra = choice.to_bytes(4, "little") if choice else b""  # choice 0: the one-choice words
        h = hashlib.blake2b(
            self._st.seed + prompt.encode() + i.to_bytes(4, "little") + extra, digest_size=4
        )
        return _VOCAB[int.from_bytes(h.digest(), "little") % len(_VOCAB)]

    async def _admit(self, need: int, rid: str) -> list[int]:
        st, kv = self._st, self._kv
        assert st.cond is not None
        npages = kv.pages_for(need)

        def ready() -> bool:
            # not the layers: prefill waits per layer (_prefill), so a partial prewarm serves
            if st.running >= self.max_batch:
                return False
            if kv.free_pages() >= npages:
                return True
            if kv.wait_for_pages(rid, npages):  # only KV is missing: tell the agent
                self._events.send(EngineEventKind.KV_WANTED)
            return False

        st.waiting += 1
        try:
            async with st.cond:
                await st.cond.wait_for(ready)
                pages = kv.alloc(rid, npages)
                assert pages is not None
                st.running += 1
                st.kv_reserved += need
                return pages
        except asyncio.CancelledError:
            st.dropped += 1  # the client went away while queued
            raise
        finally:
            kv.waiting.pop(rid, None)
            st.waiting -= 1

    async def _prefill(self, n_prompt: int) -> None:
        """The prompt's prefill, layer by layer: layer ``i`` waits only for layer ``i`` to be
        resident (a partially prewarmed model serves while its last layers land)."""
        assert self.spec is not None
        st = self._st
        layers = max(1, st.layers_total)
        per_layer = n_prompt / self.spec.profile.prefill_tok_s / layers
        owed = 0.0  # compute time of the layers passed since the last sleep
        for i in range(layers):
            if st.layers_resident <= i:
                if owed:
                    await asyncio.sleep(owed)
                    owed = 0.0
                assert st.cond is not None
                async with st.cond:
                    await st.cond.wait_for(lambda i=i: st.layers_resident > i)
            owed += per_layer
        await asyncio.sleep(owed)

    async def _release(self, need: int, used: int, rid: str, pages: list[int]) -> None:
        st = self._st
        self._kv.release(rid, pages)
        st.running -= 1
        st.kv_reserved -= need
        st.kv_used -= used
        st.served += 1
        await self._notify()
        self._events.send(EngineEventKind.FINISHED)  # Eq. 1 is re-checked on completion

    async def _abort_all(self) -> None:
        """Abort every request in flight or queued (the engine stops) and wait for their
        answers to be written: as vLLM's abort, each answers at once (``finish_reason``
        ``abort`` with the tokens so far), so the server's shutdown never waits for one."""
        st = self._st
        st.aborting = True
        for task in list(st.inflight):
            task.cancel()
        if st.inflight:
            await asyncio.wait(set(st.inflight), timeout=5)

    def _aborted(self) -> bool:
        """Whether the cancellation being handled is the engine's abort (then taken back, so the
        request answers) rather than its client going away."""
        task = asyncio.current_task()
        if not self._st.aborting or task is None:
            return False
        task.uncancel()
        return True

    async def _generate(self, request: Any, body: dict[str, Any], prompt: str, kind: str) -> Any:
        """One request (``kind``: completion, chat or responses), held in ``inflight`` so that
        stopping the engine aborts it (:meth:`_abort_all`)."""
        st = self._st
        task = asyncio.current_task()
        if st.aborting or task is None:
            return self._error(503, ABORTED, kind="ServiceUnavailableError")
        st.inflight.add(task)
        try:
            return await self._run(request, body, prompt, kind)
        finally:
            st.inflight.discard(task)

    async def _run(self, request: Any, body: dict[str, Any], prompt: str, kind: str) -> Any:
        """Admit, prefill and decode one request; aborted (the engine stops), it answers what
        it has with ``finish_reason`` ``abort``, as vLLM does."""
        from aiohttp import web

        assert self.spec is not None
        prof = self.spec.profile
        chat = kind == "chat"
        try:
            n = 1 if kind == "responses" else answers.choices_n(body)
        except answers.BadRequest as exc:
            return self._error(400, str(exc))
        n_prompt = max(1, len(prompt.split()))
        max_tokens = body.get("max_tokens", 16)
        stream = bool(body.get("stream", False))
        include_usage, continuous = _include_usage(body)
        kvt = prof.kv_bytes_per_token
        need = (n_prompt + n * max_tokens) * kvt
        if self.max_model_len and n_prompt + max_tokens > self.max_model_len:
            return self._error(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {n_prompt + max_tokens} ({n_prompt} in the prompt, "
                f"{max_tokens} to generate)",
            )
        if self._kv.pages_for(need) > self._kv.total:
            return self._error(
                400, f"prompt + n x max_tokens need {need} KV bytes, more than the cache"
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
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        resp: web.StreamResponse | None = None
        words: list[list[str]] = [[] for _ in range(n)]
        answer = answers.ResponseAnswer(self.spec.model, body, created)
        finish = "length"
        try:
            pages: list[int] | None = await self._admit(need, rid)
        except asyncio.CancelledError:
            if not self._aborted():
                raise
            pages, finish = None, "abort"
        if pages is not None:
            used = n_prompt * kvt
            self._st.kv_used += used
            try:
                self._kv.prefill(rid, pages)
                await self._prefill(n_prompt)
                ttft = time.perf_counter() - t_arrive
                self._first_token()
                if self.spec.traces_endpoint:
                    from warmserve_agent.engines import tracing

                    tracing.note(**{"gen_ai.latency.time_to_first_token": ttft})
                self._metrics.ttft.observe(ttft)
                self.ttft.observe(ttft)
                if stream:
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await resp.prepare(request)
                    if kind == "responses":
                        for event in answer.opening(n_prompt):
                            await resp.write(event)
                for i in range(max_tokens):
                    if i:
                        await asyncio.sleep(1.0 / prof.decode_tok_s)
                    for c in range(n):  # vLLM streams the choices interleaved, by index
                        w = self._token(prompt, i, c)
                        words[c].append(w)
                        self._kv.token(pages, n_prompt + i * n + c, kvt)
                        self._st.kv_used += kvt
                        used += kvt
                        if resp is None:
                            continue
                        piece = ("" if i == 0 else " ") + w
                        if kind == "responses":
                            await resp.write(answer.delta(piece))
                            continue
                        chunk = self._chunk(rid, created, piece, chat, None, c)
                        if continuous:
                            chunk["usage"] = _usage(n_prompt, i * n + c + 1)
                        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            except asyncio.CancelledError:
                if not self._aborted():
                    self._st.dropped += 1  # the client went away mid-generation
                    raise
                finish = "abort"
            finally:
                await self._release(need, used, rid, pages)
                self._metrics.prompt_tokens.inc(n_prompt)
                self._metrics.gen_tokens.inc(sum(len(w) for w in words))
                self._metrics.e2e.observe(time.perf_counter() - t_arrive)
        generated = sum(len(w) for w in words)
        usage = _usage(n_prompt, generated)
        texts = [" ".join(w) for w in words]
        if kind == "responses":
            if finish == "abort":  # not a completed response: an error, in the stream if any
                if resp is None:
                    return self._error(503, ABORTED, kind="ServiceUnavailableError")
                await resp.write(answer.event("error", code="aborted", message=ABORTED))
                await resp.write_eof()
                return resp
            if resp is not None:
                for event in answer.closing(texts[0], n_prompt, generated):
                    await resp.write(event)
                await resp.write_eof()
                return resp
            return web.json_response(answer.response(texts[0], n_prompt, generated, True))
        if stream and resp is None:  # aborted before its first token: vLLM's bare end
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if resp is not None:
            # As vLLM: usage only when stream_options.include_usage asked for it, in a chunk of
            # its own without choices after the last one, which then carries the fingerprint.
            fingerprint = f"warmserve-sim-{self._st.seed[:4].hex()}"
            for c in range(n):
                final = self._chunk(rid, created, "", chat, finish, c)
                if continuous:
                    final["usage"] = usage
                if not include_usage and c == n - 1:
                    final["system_fingerprint"] = fingerprint
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            if include_usage:
                last = {**self._chunk(rid, created, "", chat, None), "choices": []}
                last.update(usage=usage, system_fingerprint=fingerprint)
                await resp.write(f"data: {json.dumps(last)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        choices: list[dict[str, Any]] = []
        for c, text in enumerate(texts):
            if chat:
                msg = {"role": "assistant", "content": text}
                choices.append({"index": c, "message": msg, "finish_reason": finish})
            else:
                choices.append(
                    {"index": c, "text": text, "finish_reason": finish, "logprobs": None}
                )
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.spec.model,
                "choices": choices,
                "usage": usage,
            }
        )

    def _chunk(
        self, rid: str, created: int, piece: str, chat: bool, finish: str | None, index: int = 0
    ) -> dict[str, Any]:
        assert self.spec is not None
        if chat:
            choice: dict[str, Any] = {"index": index, "delta": {"content": piece}}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": piece, "logprobs": None}
            obj = "text_completion"
        choice["finish_reason"] = finish
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.spec.model,
            "choices": [choice],
        }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _lax_bool(value: Any) -> bool | None:
    """A boolean field as vLLM's request model (pydantic, lax) reads it; ValueError if none."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ValueError(value)


def _stream_options_error(body: dict[str, Any]) -> str:
    """vLLM's checks of ``stream_options`` (its request model), or "" when they pass."""
    opts = body.get("stream_options")
    if opts and not body.get("stream"):
        return "Stream options can only be defined when `stream=True`."
    if opts is None:
        return ""
    if not isinstance(opts, dict):
        return "stream_options must be an object"
    for name in ("include_usage", "continuous_usage_stats"):
        try:
            _lax_bool(opts.get(name))
        except ValueError:
            return f"stream_options.{name} must be a boolean"
    return ""


def _include_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    """vLLM's ``should_include_usage``: (a final usage chunk, usage on every chunk too)."""
    opts = body.get("stream_options") or {}
    include = bool(_lax_bool(opts.get("include_usage")))
    return include, include and bool(_lax_bool(opts.get("continuous_usage_stats")))


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

    def render(self, st: EngineState) -> bytes:
        from prometheus_client import generate_latest

        m = self.model
        self.running.labels(m).set(st.running)
        self.waiting.labels(m).set(st.waiting)
        self.kv.labels(m).set(st.kv_used / st.kv_capacity if st.kv_capacity else 0.0)
        return generate_latest(self.reg)
