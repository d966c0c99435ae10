"""The ``Watch`` stream: every state change of the node core, fanned out to bounded queues.

``Watch`` streams every state change (the core's event bus) with the changed object: the GPU
worker (Figure 5 state, §4), the prewarm slot (§4.1), the instance or the model fetch.  Each event
is fanned out once (one hop onto the event loop, converted to protobuf once for all watchers) into
per-watcher queues of at most ``max_watch_queue`` events; a watcher whose queue overflows or that
does not take a message for ``watch_write_timeout_s`` (a client that stopped reading) is dropped
with RESOURCE_EXHAUSTED and must re-Watch with a snapshot (unbounded, 20 stalled watchers made the
agent ~4x slower and held 8 MB).  The same fan-out wakes ``Prewarm`` streams waiting for their
slot to change (:meth:`WatchHub.waker`).

:class:`WatchHub` subscribes to the node core's events; the servicer
(:class:`~warmserve_agent.service.AgentService`) holds it and hands it to the prewarm handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Event, EventKind
from warmserve_agent.service_describe import Describer
from warmserve_agent.service_idempotency import abort
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.sources.wire import fetch_pb

log = logging.getLogger("warmserve.agent.service")  # one logger for the whole service

_KIND = {
    EventKind.GPU: pb.WatchEvent.KIND_GPU,
    EventKind.SLOT: pb.WatchEvent.KIND_SLOT,
    EventKind.SLOT_REMOVED: pb.WatchEvent.KIND_SLOT_REMOVED,
    EventKind.INSTANCE: pb.WatchEvent.KIND_INSTANCE,
    EventKind.INSTANCE_REMOVED: pb.WatchEvent.KIND_INSTANCE_REMOVED,
    EventKind.WORKER_REPLACED: pb.WatchEvent.KIND_WORKER_REPLACED,
    EventKind.FETCH: pb.WatchEvent.KIND_FETCH,
}


@dataclass(eq=False)  # identity: watchers live in a set
class Watcher:
    """One Watch stream's bounded queue."""

    queue: deque[Event] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    deadline: asyncio.Timeout | None = None  # of the write in progress, if any


class WatchHub:
    """Event fan-out and ``Watch`` (see module docstring)."""

    def __init__(
        self,
        core: NodeCore,
        describer: Describer,
        fetcher: ModelFetcher | None,
        *,
        max_watch_queue: int = 1024,
        watch_write_timeout_s: float = 30.0,
    ) -> None:
        self.core = core
        self.describer = describer
        self.fetcher = fetcher
        self.max_watch_queue = max_watch_queue
        self.watch_write_timeout_s = watch_write_timeout_s
        self.watchers_dropped = 0
        self._watchers: set[Watcher] = set()
        self._wakers: set[asyncio.Event] = set()  # Prewarm streams: "something changed"
        self._pb_cache: OrderedDict[int, pb.WatchEvent] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        core.subscribe(self._on_event)

    # ---- event fan-out ---------------------------------------------------------------------
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def watcher_count(self) -> int:
        return len(self._watchers)

    def queued_events(self) -> int:
        """Events waiting in all watchers' queues (bounded by watchers x max_watch_queue)."""
        return sum(len(w.queue) for w in self._watchers)

    def _on_event(self, ev: Event) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or not (self._watchers or self._wakers):
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._fanout, ev)

    def _fanout(self, ev: Event) -> None:
        """On the event loop: one pass over the subscribers per event."""
        for w in list(self._watchers):
            if len(w.queue) >= self.max_watch_queue:
                self._drop(
                    w,
                    f"watch client fell {self.max_watch_queue} events behind (it reads too "
                    "slowly); Watch again with include_snapshot",
                )
                continue
            w.queue.append(ev)
            w.wake.set()
        for waker in self._wakers:
            waker.set()

    def _drop(self, w: Watcher, reason: str) -> None:
        if w in self._watchers:
            self._watchers.discard(w)
            w.queue.clear()  # its memory goes now, not when the client finally reads
            w.reason = reason
            w.dropped.set()
            w.wake.set()
            if w.deadline is not None and self._loop is not None:
                w.deadline.reschedule(self._loop.time())  # end a write blocked on the client
            self.watchers_dropped += 1
            log.warning("event=watch_dropped reason=%s", reason.split(";")[0])

    def publish(self, ev: Event) -> None:
        self._on_event(ev)

    @contextlib.contextmanager
    def waker(self) -> Iterator[asyncio.Event]:
        """An event set whenever anything changed, for a stream waiting on the core."""
        changed = asyncio.Event()
        self._wakers.add(changed)
        try:
            yield changed
        finally:
            self._wakers.discard(changed)

    # ---- RPC ------------------------------------------------------------------------------
    async def watch(self, request: pb.WatchRequest, context: Any) -> None:
        w = Watcher()
        self._watchers.add(w)
        try:
            if request.include_snapshot:
                snap = await asyncio.to_thread(self.describer.describe_pb, False)
                await self._write(
                    context,
                    w,
                    pb.WatchEvent(
                        kind=pb.WatchEvent.KIND_SNAPSHOT,
                        generation=snap.generation,
                        time_unix=time.time(),
                        snapshot=snap,
                    ),
                )
            while True:
                while not w.queue and not w.dropped.is_set():
                    w.wake.clear()
                    await w.wake.wait()
                if w.dropped.is_set():
                    await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, w.reason)
                await self._write(context, w, self._event_pb_once(w.queue.popleft()))
        finally:
            self._watchers.discard(w)

    async def _write(self, context: Any, w: Watcher, msg: pb.WatchEvent) -> None:
        """Send one message; a client that does not take it in time, or whose queue overflows
        meanwhile (``_drop`` moves the deadline to now), is dropped with RESOURCE_EXHAUSTED."""
        try:
            async with asyncio.timeout(self.watch_write_timeout_s) as w.deadline:
                await context.write(msg)
        except TimeoutError:
            self._drop(
                w,
                f"watch client took no message for {self.watch_write_timeout_s:g} s (it stopped "
                "reading); Watch again with include_snapshot",
            )
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, w.reason)
        finally:
            w.deadline = None

    def _event_pb_once(self, ev: Event) -> pb.WatchEvent:
        """Convert each event once, whatever the number of watchers (cached by generation)."""
        msg = self._pb_cache.get(ev.generation)
        if msg is None:
            msg = self._event_pb(ev)
            self._pb_cache[ev.generation] = msg
            while len(self._pb_cache) > max(64, self.max_watch_queue):
                self._pb_cache.popitem(last=False)
        return msg

    def _event_pb(self, ev: Event) -> pb.WatchEvent:
        out = pb.WatchEvent(
            kind=_KIND.get(ev.kind, pb.WatchEvent.KIND_UNSPECIFIED),
            generation=ev.generation,
            time_unix=time.time(),
            subject_id=ev.subject,
            message=ev.message,
        )
        describer = self.describer
        try:
            if ev.kind in (EventKind.GPU, EventKind.WORKER_REPLACED):
                out.gpu.CopyFrom(describer.gpu_pb(int(ev.subject)))
            elif ev.kind == EventKind.SLOT and ev.subject in self.core.slots:
                out.slot.CopyFrom(describer.slot_pb(self.core.slots[ev.subject]))
            elif ev.kind == EventKind.INSTANCE and ev.subject in self.core.instances:
                out.instance.CopyFrom(describer.instance_pb(self.core.instances[ev.subject]))
            elif ev.kind == EventKind.FETCH and self.fetcher is not None:
                st = next((f for f in self.fetcher.statuses() if f.model == ev.subject), None)
                if st is not None:
                    out.fetch.CopyFrom(fetch_pb(st))
        except Exception:  # object changed under us; subject_id + kind still tell the story
            log.debug("event=watch_convert_failed kind=%s", ev.kind)
        return out
