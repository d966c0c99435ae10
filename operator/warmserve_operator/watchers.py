"""Agent Watch streams: one per agent while this replica leads; an event that may change a
decision wakes the loop before its next poll (docs/operator.md).  The poll still covers every
agent, so a broken stream only costs latency: it is retried each poll interval."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from .agents import AgentPool

log = logging.getLogger("warmserve.operator")

# Agent Watch events that may change a decision before the next poll.
WAKE_EVENTS = frozenset(
    {
        "KIND_INSTANCE_REMOVED",
        "KIND_INSTANCE",
        "KIND_SLOT_REMOVED",
        "KIND_SLOT",
        "KIND_GPU",
        "KIND_WORKER_REPLACED",
    }
)


class AgentWatchers:
    """The Watch tasks, kept in step with the nodes the loop knows (:meth:`sync`)."""

    def __init__(self, agents: AgentPool, wake: Callable[[], None], retry_s: float) -> None:
        self.agents = agents
        self.wake = wake
        self.retry_s = retry_s
        self.tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}

    def sync(self, want: Mapping[str, str]) -> None:
        """Watch exactly the agents in ``want`` (node -> address); restart a finished or moved
        stream."""
        for name in list(self.tasks):
            addr, task = self.tasks[name]
            if want.get(name) != addr or task.done():
                task.cancel()
                del self.tasks[name]
        for name, addr in want.items():
            if name not in self.tasks:
                task = asyncio.get_running_loop().create_task(self._watch(name, addr))
                self.tasks[name] = (addr, task)

    def stop(self) -> None:
        for _, task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    async def _watch(self, node: str, address: str) -> None:
        watch = getattr(self.agents.get(node, address), "watch", None)
        if watch is None:
            return
        while True:
            try:
                async for kind in watch():
                    if kind in WAKE_EVENTS:
                        self.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the poll still covers this agent; retry the stream
                log.debug("event=watch_failed node=%s error=%r", node, str(exc))
            await asyncio.sleep(self.retry_s)
