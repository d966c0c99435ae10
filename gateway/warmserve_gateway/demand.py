"""What this gateway replica reports to the operator: requests held per model (``/demand``).

The wire format and the operator's side are in :mod:`warmserve_operator.gateway_demand` (its
docstring has the whole design).  This replica

* answers ``GET /demand`` with a :class:`~warmserve_operator.gateway_demand.DemandReport` of its
  own counts (held per model; forwarded and unfinished ones as ``inflight``);
* streams reports on ``GET /demand?watch=1`` (newline-delimited JSON): the current report at
  once, then one whenever a model's held count rises from 0 or reaches twice the level last
  streamed (1, 2, 4, 8, ...: a burst costs a handful of wake-ups, not one per request), and an
  empty line every :data:`HEARTBEAT_S` seconds.

The gateway does not decide anything here: the operator's autoscaler turns demand into
instances.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping

from warmserve_operator.gateway_demand import HEARTBEAT_S, DemandReport, ModelDemand


class DemandTracker:
    """Edge detection on held counts and the subscribers of the watch stream."""

    def __init__(self, replica: str, counts: Callable[[], Mapping[str, ModelDemand]]) -> None:
        self.replica = replica
        self.started = time.time()
        self._counts = counts
        self._level: dict[str, int] = {}  # held level last streamed, per model (0: none held)
        self.seq = 0
        self._subscribers: set[asyncio.Event] = set()

    def held_changed(self, model: str, held: int) -> None:
        """Called by the dispatcher on every change of a model's held count."""
        level = self._level.get(model, 0)
        if held <= 0:
            if level:
                self._level[model] = 0
            return
        if held >= 2 * level or level == 0:
            self._level[model] = held
            self.seq += 1
            for ev in self._subscribers:
                ev.set()

    def report(self) -> DemandReport:
        return DemandReport(self.replica, self.started, self.seq, dict(self._counts()))

    def line(self) -> bytes:
        return json.dumps(self.report().to_json(), separators=(",", ":")).encode() + b"\n"

    async def stream(
        self, write: Callable[[bytes], Awaitable[object]], stop: asyncio.Event
    ) -> None:
        """Write reports and heartbeats with ``write`` (an async callable) until ``stop``."""
        ev = asyncio.Event()
        self._subscribers.add(ev)
        try:
            await write(self.line())
            while not stop.is_set():
                try:
                    await asyncio.wait_for(ev.wait(), HEARTBEAT_S)
                except TimeoutError:
                    await write(b"\n")
                    continue
                ev.clear()
                await write(self.line())
        finally:
            self._subscribers.discard(ev)
