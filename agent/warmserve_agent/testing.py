"""Run an agent on loopback in a background thread (tests, benchmarks, ``warmserve agent``-less
scripts).  Not used in production."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from warmserve_agent.config import AgentConfig
from warmserve_agent.server import AgentServer


class AgentThread:
    """``with AgentThread(cfg) as a: SyncAgentClient(a.address)``; stops the agent on exit."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.server = AgentServer(cfg)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> AgentThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(120)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def address(self) -> str:
        return self.server.address

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(0.2), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
