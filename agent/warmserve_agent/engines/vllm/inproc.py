"""vLLM's AsyncLLM (and so its OpenAI server) over an EngineCore running in *this* process.

vLLM's ``AsyncLLM`` always talks to its ``EngineCore`` over ZMQ in another process
(``EngineCoreClient.make_client`` refuses asyncio without multiprocessing).  warmserve needs the
engine core, the model and its KV cache in the pooled worker process: that process owns the
prewarm slot's memory (the CUDA VMM mappings belong to its context; vllm-integration note §0).
So this module provides the missing client: :class:`AsyncInprocClient` extends vLLM's own
``InprocClient`` (the in-process client ``LLMEngine`` uses) with the ``*_async`` methods
``AsyncLLM`` calls, and runs vLLM's busy loop (``step_fn``/``post_step``, as ``EngineCoreProc``
does) in one engine thread.  Every call that touches the engine core runs on that thread between
steps, like vLLM's utility calls; outputs go to the asyncio loop of the HTTP server.

Everything above the client — ``AsyncLLM``, the input/output processors, the OpenAI serving code,
the stat loggers and their Prometheus metrics — is vLLM's, unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core_client import EngineCoreClient, InprocClient

log = logging.getLogger("warmserve.agent.engine.vllm")


class AsyncInprocClient(InprocClient):
    """``InprocClient`` + an engine thread + the async API ``AsyncLLM`` uses."""

    engine_ranks_managed = (0,)

    def __init__(self, vllm_config: Any, executor_class: Any, log_stats: bool) -> None:
        super().__init__(vllm_config, executor_class, log_stats)
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] = asyncio.Queue()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None]
        self._calls = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        # Called on the engine thread after every step with its outputs, and after aborts with
        # None: the vllm engine reports finished requests and KV waits to the agent from here.
        self.on_step: Callable[[EngineCoreOutputs | None], None] | None = None
        # AsyncLLM reads ``engine_core.resources.engine_dead`` (MPClient's BackgroundResources)
        self.resources = types.SimpleNamespace(engine_dead=False)
        self._thread = threading.Thread(target=self._busy_loop, name="vllm-engine", daemon=True)
        self._thread.start()

    # ---- the engine thread ---------------------------------------------------------------
    def _busy_loop(self) -> None:
        from warmserve_agent.engines.vllm.cpu_threads import adopt

        adopt()  # this thread runs the forwards: its OpenMP pool is the rank's size from the start
        core = self.engine_core
        try:
            while not self._stop:
                self._run_calls()
                if core.scheduler.has_requests():
                    outputs = self.get_output()  # one vLLM step
                    if outputs.outputs or outputs.scheduler_stats is not None:
                        self._loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)
                    self._after(outputs)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # the engine died: fail every waiter, as vLLM does
            log.exception("event=vllm_engine_loop_failed")
            self.resources.engine_dead = True
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, exc)
        finally:
            self._run_calls(fail=True)

    def _after(self, outputs: EngineCoreOutputs | None) -> None:
        if self.on_step is not None:
            try:
                self.on_step(outputs)
            except Exception:  # a report must never stop the engine
                log.exception("event=vllm_step_hook_failed")

    def _run_calls(self, fail: bool = False) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            fn, fut = item
            if fail:
                self._resolve(fut, None, RuntimeError("the vLLM engine loop has stopped"))
                continue
            try:
                self._resolve(fut, fn(), None)
            except BaseException as exc:
                self._resolve(fut, None, exc)

    def _resolve(self, fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
        def done() -> None:
            if fut.cancelled():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        self._loop.call_soon_threadsafe(done)

    def call_in_engine_thread(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the engine thread between steps (from the asyncio loop)."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self.resources.engine_dead or self._stop:
            fut.set_exception(RuntimeError("the vLLM engine loop has stopped"))
            return fut
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    def call_sync(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread from any other thread and wait for it."""
        result = asyncio.run_coroutine_threadsafe(self._await(fn), self._loop)
        return result.result(timeout_s)

    def call_later(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Queue ``fn`` for the engine thread from any other thread, without waiting: calls run
        in the order queued, between steps."""
        return asyncio.run_coroutine_threadsafe(self._await(fn), self._loop)

    async def _await(self, fn: Callable[[], Any]) -> Any:
        return await self.call_in_engine_thread(fn)

    # ---- the async API AsyncLLM uses ---------------------------------------------------------
    async def get_output_async(self) -> EngineCoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError() from item
        return item

    async def add_request_async(self, request: Any) -> None:
        await self.call_in_engine_thread(lambda: self.add_request(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        def abort() -> None:
            self.abort_requests(request_ids)
            self._after(None)  # aborted requests free their blocks too

        await self.call_in_engine_thread(abort)

    async def get_supported_tasks_async(self) -> Any:
        return await self.call_in_engine_thread(self.get_supported_tasks)

    def __getattr__(self, name: str) -> Any:
        # Any other ``foo_async`` (reset_prefix_cache_async, is_sleeping_async, ...) runs the
        # in-process client's ``foo`` on the engine thread.
        if name.endswith("_async"):
            sync = getattr(InprocClient, name[: -len("_async")], None)
            if sync is not None:

                async def call(*args: Any, **kwargs: Any) -> Any:
                    return await self.call_in_engine_thread(lambda: sync(self, *args, **kwargs))

                return call
        raise AttributeError(name)

    def get_status(self) -> dict[str, Any]:
        return {"engine_dead": self.resources.engine_dead}

    def shutdown(self, timeout: float | None = None) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout or 30)
        super().shutdown(timeout)


@contextlib.contextmanager
def inproc_engine_core() -> Iterator[list[AsyncInprocClient]]:
    """While active, ``AsyncLLM(...)`` builds its engine core in this process.

    ``AsyncLLM.__init__`` asks ``EngineCoreClient.make_async_mp_client`` for its client; we
    answer with :class:`AsyncInprocClient` for the duration of the construction only."""
    made: list[AsyncInprocClient] = []
    original = EngineCoreClient.__dict__["make_async_mp_client"]

    def make(vllm_config: Any, executor_class: Any, log_stats: bool, *a: Any, **kw: Any) -> Any:
        client = AsyncInprocClient(vllm_config, executor_class, log_stats)
        made.append(client)
        return client

    EngineCoreClient.make_async_mp_client = staticmethod(make)  # type: ignore[method-assign]
    try:
        yield made
    finally:
        EngineCoreClient.make_async_mp_client = original  # type: ignore[method-assign]
