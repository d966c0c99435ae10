"""The ``vllm`` engine's asyncio loop, on a thread of its own.

vLLM's async client (``AsyncLLM`` over ``inproc.py``) binds to the loop it is built on, and the
engine's HTTP server runs there too: :class:`LoopThread` builds on it (``start``), keeps it running
while the engine is prepared and while it serves, runs coroutines on it from other threads
(``run``), and shuts it down (``stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from warmserve_agent.engine import EngineError

log = logging.getLogger("warmserve.agent.engine.vllm")


class LoopThread:
    """An asyncio loop running on its own daemon thread (see module docstring)."""

    def __init__(self, name: str = "vllm-server") -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def start(
        self,
        make: Callable[[], Awaitable[None]],
        on_failure: Callable[[], Awaitable[None]],
        timeout_s: float,
    ) -> None:
        """Run ``make()`` on a new loop thread and keep the loop running; if it fails,
        ``on_failure()`` runs on the loop, the loop closes and the failure is raised here (an
        :class:`EngineError` as it is, anything else wrapped in one)."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(make())
            except BaseException as exc:  # reported to start()
                if not isinstance(exc, EngineError):
                    log.exception("event=vllm_build_failed")
                failure.append(exc)
                started.set()
                with contextlib.suppress(Exception):
                    loop.run_until_complete(on_failure())
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self.thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self.thread.start()
        if not started.wait(timeout_s):
            raise EngineError(f"vLLM was not built within {timeout_s:.0f} s")
        if failure:
            self.thread.join(60)
            exc = failure[0]
            if isinstance(exc, EngineError):
                raise exc
            raise EngineError(f"vLLM failed to start: {type(exc).__name__}: {exc}") from None

    def running(self) -> bool:
        loop, thread = self.loop, self.thread
        return loop is not None and thread is not None and thread.is_alive() and loop.is_running()

    def run(self, coro: Awaitable[Any], timeout_s: float) -> Any:
        """Run ``coro`` on the loop (from another thread) and wait for its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def stop(self, shutdown: Callable[[], Awaitable[None]], timeout_s: float = 60.0) -> None:
        """Run ``shutdown()`` on the loop, then stop it and join its thread."""
        if self.running():
            assert self.loop is not None and self.thread is not None
            with contextlib.suppress(Exception):
                self.run(shutdown(), timeout_s)
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
        self.loop = self.thread = None
