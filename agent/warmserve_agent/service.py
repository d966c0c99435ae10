"""The gRPC service ``warmserve.agent.v1.NodeAgent`` over :class:`~warmserve_agent.node.NodeCore`.

Responsibilities beyond translating messages:

* **Idempotency.** Every mutating call carries a ``request_id``.  The first call with an id runs;
  a replay with the same id and the same arguments waits for / returns the first outcome (the
  same answer, or the same error) without redoing the work; the same id with different
  arguments is refused with ALREADY_EXISTS.  The last ``max_request_ids`` ids are remembered.
* **Status codes.** :class:`~warmserve_agent.node_records.Refusal` carries the gRPC status name
  and a message a person can act on; it becomes ``context.abort(code, message)``.
* **Streams.** ``Prewarm`` streams progress of its slot until the requested layers are resident;
  ``Watch`` streams every state change (the core's event bus) with the changed object.  Each event
  is fanned out once (one hop onto the event loop, converted to protobuf once for all watchers) into
  per-watcher queues of at most ``max_watch_queue`` events; a watcher whose queue overflows or that
  does not take a message for ``watch_write_timeout_s`` (a client that stopped reading) is dropped
  with RESOURCE_EXHAUSTED and must re-Watch with a snapshot (issue 16: 20 stalled watchers made the
  agent ~4x slower and held 8 MB).
* **Error messages** echo client input only through :mod:`~warmserve_agent.safe_text` and are
  bounded as a whole (printable, at most 1 KiB).
* Core calls run in threads (``asyncio.to_thread``): loading and engine start-up block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent import __version__
from warmserve_agent.api.v1 import agent_pb2 as pb
from warmserve_agent.api.v1 import agent_pb2_grpc as pb_grpc
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import ID_RE, Event, InstanceRec, Refusal, SlotRec
from warmserve_agent.safe_text import bounded, shown
from warmserve_agent.sources.fetcher import FetchFailed, ModelFetcher
from warmserve_agent.sources.wire import fetch_pb, store_pb
from warmserve_agent.store import StoreError
from warmserve_agent.wire import PHASE_TO_PB, SLOT_TO_PB, WORKER_TO_PB

log = logging.getLogger("warmserve.agent.service")

CATALOG_TTL_S = 10.0  # see AgentService._catalog

_WS = WORKER_TO_PB
_SS = SLOT_TO_PB
_IP = PHASE_TO_PB
_KIND = {
    "gpu": pb.WatchEvent.KIND_GPU,
    "slot": pb.WatchEvent.KIND_SLOT,
    "slot_removed": pb.WatchEvent.KIND_SLOT_REMOVED,
    "instance": pb.WatchEvent.KIND_INSTANCE,
    "instance_removed": pb.WatchEvent.KIND_INSTANCE_REMOVED,
    "worker_replaced": pb.WatchEvent.KIND_WORKER_REPLACED,
    "fetch": pb.WatchEvent.KIND_FETCH,
}


@dataclass
class _Idem:
    method: str
    fingerprint: tuple[Any, ...]
    future: asyncio.Future[Any]
    final: Any = None  # Prewarm: the last progress message sent


@dataclass(eq=False)  # identity: watchers live in a set
class _Watcher:
    """One Watch stream's bounded queue."""

    queue: deque[Event] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    deadline: asyncio.Timeout | None = None  # of the write in progress, if any


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Every refusal leaves through here: the message bounded and printable."""
    await context.abort(code, bounded(message))


@dataclass
class ServiceInfo:
    agent_id: str
    started_unix: float = field(default_factory=time.time)
    spare_workers: Callable[[], int] = lambda: 0
    worker_pid: Callable[[int], int] = lambda g: 0
    worker_restarts: Callable[[int], int] = lambda g: 0


class AgentService(pb_grpc.NodeAgentServicer):
    def __init__(
        self,
        core: NodeCore,
        info: ServiceInfo,
        *,
        max_request_ids: int = 10000,
        max_watch_queue: int = 1024,
        watch_write_timeout_s: float = 30.0,
        fetcher: ModelFetcher | None = None,
    ) -> None:
        self.core = core
        self.info = info
        self.fetcher = fetcher
        self._usage: tuple[int, float, pb.StoreInfo] | None = None
        self.max_request_ids = max_request_ids
        self.max_watch_queue = max_watch_queue
        self.watch_write_timeout_s = watch_write_timeout_s
        self._idem: OrderedDict[str, _Idem] = OrderedDict()
        self._catalog_cache: tuple[tuple[int, ...], float, list[pb.ModelInfo]] | None = None
        self._catalog_orgs: tuple[str, ...] = ()  # ORG directories seen by the last scan
        self._watchers: set[_Watcher] = set()
        self._wakers: set[asyncio.Event] = set()  # Prewarm streams: "something changed"
        self._pb_cache: OrderedDict[int, pb.WatchEvent] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.watchers_dropped = 0
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

    def _drop(self, w: _Watcher, reason: str) -> None:
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

    # ---- conversions -----------------------------------------------------------------------
    def gpu_pb(self, g: int) -> pb.GpuInfo:
        rec = self.core.gpus[g]
        mm = self.core.mm
        page = self.core.page
        return pb.GpuInfo(
            index=g,
            memory_bytes=rec.memory_bytes,
            page_bytes=page,
            pages_total=mm.num_pages(g),
            pages_free=mm.free_pages(g),
            free_bytes=0 if rec.state == WorkerState.DEDICATED else mm.available_pages(g) * page,
            state=_WS[rec.state],
            worker_pid=self.info.worker_pid(g),
            worker_restarts=self.info.worker_restarts(g),
            slot_ids=[s.slot_id for s in self.core.slots.values() if g in s.gpus],
            instance_id=rec.instance_id,
        )

    @staticmethod
    def slot_pb(s: SlotRec) -> pb.SlotInfo:
        return pb.SlotInfo(
            slot_id=s.slot_id,
            model=s.model,
            gpus=list(s.gpus),
            layers_resident=s.layers_resident,
            layers_total=s.layers_total,
            layers_target=s.layers_target,
            resident_bytes_per_gpu=s.resident_bytes,
            weight_bytes_per_gpu=s.layout.total_bytes,
            state=_SS[s.state],
            message=s.message,
            owner=s.owner,
        )

    def instance_pb(self, i: InstanceRec) -> pb.InstanceInfo:
        st = i.last_stats
        slot = self.core.slots.get(i.slot_id)
        page = self.core.page
        return pb.InstanceInfo(
            instance_id=i.instance_id,
            model=i.model,
            gpus=list(i.gpus),
            endpoint=i.endpoint,
            phase=_IP[i.phase],
            running=st.running,
            waiting=st.waiting,
            max_batch=i.max_batch,
            kv_capacity_bytes=i.kv_pages * page * len(i.gpus),
            kv_used_bytes=st.kv_used_bytes,
            lendable_bytes=(
                min(self.core.mm.available_pages(g) for g in i.gpus) * page
                if i.phase == InstancePhase.GRACE
                else 0
            ),
            lent_bytes=(i.kv_pages_initial - i.kv_pages) * page,
            prewarm_hit=i.prewarm_hit,
            slot_id=i.slot_id,
            layers_resident=slot.layers_resident if slot else 0,
            layers_total=slot.layers_total if slot else 0,
            started_unix=i.started_unix,
            engine=i.engine_name,
            ttft_p95_seconds=st.ttft_p95_s,
            ttft_samples=st.ttft_samples,
            ttft_window_seconds=st.ttft_window_s,
            dropped_requests=st.dropped,
            owner=i.owner,
            grace_started_unix=i.grace_started_unix,
        )

    def _refresh_stats(self) -> None:
        for i in list(self.core.instances.values()):
            if i.phase == InstancePhase.STARTING:
                continue
            try:
                i.last_stats = i.engine.stats()
            except Exception as exc:  # worker died: the monitor will reconcile
                log.debug("event=stats_failed instance=%s err=%s", i.instance_id, exc)

    def _catalog_stamp(self) -> tuple[int, ...]:
        """What changes when a model is added or removed: the mtimes of the store's root and of
        its ``ORG`` directories (``ORG/NAME`` models change only their org's mtime), and the
        fetcher's generation (fetch end, eviction)."""
        root = self.core.store.root
        stamp = [self.fetcher.generation if self.fetcher else 0]
        for d in (root, *(root / org for org in self._catalog_orgs)):
            try:
                stamp.append(d.stat().st_mtime_ns)
            except OSError:
                stamp.append(0)
        return tuple(stamp)

    def _catalog(self) -> list[pb.ModelInfo]:
        """The weight store's models, re-scanned when the store changed (a model added or
        removed: see ``_catalog_stamp``) and at most every ``CATALOG_TTL_S`` otherwise: with
        1,000 models a scan per Describe made every poll slow (issue 16)."""
        store = self.core.store
        stamp = self._catalog_stamp()
        now = time.monotonic()
        cached = self._catalog_cache
        if cached is not None and cached[0] == stamp and now - cached[1] < CATALOG_TTL_S:
            return cached[2]
        models = []
        names = store.list_models()
        for name in names:
            try:
                m = store.model(name)
            except Exception:  # a malformed model dir is reported by Prewarm, not here
                continue
            source, disk, used = self.fetcher.model_info(name) if self.fetcher else ("", 0, 0)
            models.append(
                pb.ModelInfo(
                    name=name,
                    num_layers=m.num_layers,
                    weight_bytes=m.weight_bytes,
                    num_tensors=len(m.tensors),
                    max_batch=m.profile.max_batch,
                    source=source,
                    disk_bytes=disk,
                    last_used_unix=used,
                )
            )
        orgs = tuple(sorted({n.split("/", 1)[0] for n in names if "/" in n}))
        if orgs != self._catalog_orgs:  # their mtimes were not in the stamp: scan once more
            self._catalog_orgs = orgs
            stamp = ()
        self._catalog_cache = (stamp, now, models)
        return models

    def describe_pb(self, refresh: bool = True) -> pb.NodeDescription:
        core = self.core
        with core._lock:
            if refresh:
                self._refresh_stats()
            models = self._catalog()
            return pb.NodeDescription(
                node_name=core.node_name,
                agent_version=__version__,
                backend=core.mm.backend.name,
                page_bytes=core.page,
                gpus=[self.gpu_pb(g) for g in sorted(core.gpus)],
                slots=[self.slot_pb(s) for s in core.slots.values()],
                instances=[self.instance_pb(i) for i in core.instances.values()],
                models=models,
                generation=core.generation,
                agent_id=self.info.agent_id,
                agent_started_unix=self.info.started_unix,
                spare_workers=self.info.spare_workers(),
                fetches=[fetch_pb(f) for f in self.fetcher.statuses()] if self.fetcher else [],
                store=self._store_info(),
            )

    def _store_info(self) -> pb.StoreInfo:
        """The store's usage, recomputed after each fetch or eviction, else at most every 5 s (it
        walks pre-filled models)."""
        if self.fetcher is None:
            return pb.StoreInfo()
        now = time.monotonic()
        gen = self.fetcher.generation
        if self._usage is None or self._usage[0] != gen or now - self._usage[1] > 5.0:
            self._usage = (gen, now, store_pb(self.fetcher.usage()))
        return self._usage[2]

    # ---- fetching models into the store ----------------------------------------------------
    def _pin(self, model: str) -> contextlib.AbstractContextManager[None]:
        return self.fetcher.pinned(model) if self.fetcher else contextlib.nullcontext()

    async def _fetch(
        self, model: str, source: str, gpus: list[int] | None, context: Any
    ) -> AsyncIterator[pb.FetchInfo]:
        """Make ``model`` present (fetching it from ``source``), yielding progress while a fetch
        runs; aborts the RPC with the fetch's status code when it fails."""
        if self.fetcher is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this agent has no model fetcher"
            )
        assert self.fetcher is not None
        try:
            if gpus is not None:
                with self.core._lock:
                    self.core._check_gpus(gpus)  # refuse a bad request before a long fetch
            fetch = await asyncio.to_thread(self.fetcher.ensure, model, source)
        except Refusal as r:
            await context.abort(grpc.StatusCode[r.code], r.message)
        except FetchFailed as f:
            await context.abort(grpc.StatusCode[f.code], f.message)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        last = None
        while True:
            st = fetch.status
            if st is not last and st.started_unix:  # nothing to report for a model present
                last = st
                yield fetch_pb(st)
            if (fetch.done.is_set() and fetch.status is last) or not st.started_unix:
                break
            await asyncio.sleep(0.25)
        if fetch.error is not None:
            await context.abort(grpc.StatusCode[fetch.error.code], fetch.error.message)

    async def InspectModel(self, request: pb.InspectModelRequest, context: Any) -> pb.ModelInfo:
        if self.fetcher is None or (not request.source and not self.core.store.has(request.model)):
            try:
                m = await asyncio.to_thread(self.core.store.model, request.model)
            except StoreError as exc:
                code = "NOT_FOUND" if "unknown model" in str(exc) else "INVALID_ARGUMENT"
                await context.abort(grpc.StatusCode[code], str(exc))
            return pb.ModelInfo(
                name=request.model,
                num_layers=m.num_layers,
                weight_bytes=m.weight_bytes,
                num_tensors=len(m.tensors),
                max_batch=m.profile.max_batch,
            )
        try:
            facts = await asyncio.to_thread(self.fetcher.inspect, request.model, request.source)
        except FetchFailed as f:
            await context.abort(grpc.StatusCode[f.code], f.message)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ModelInfo(
            name=request.model,
            num_layers=facts.num_layers,
            weight_bytes=facts.weight_bytes,
            num_tensors=facts.num_tensors,
            max_batch=facts.max_batch,
            source=request.source,
        )

    # ---- idempotency -----------------------------------------------------------------------
    async def _check_request_id(self, rid: str, context: grpc.aio.ServicerContext) -> None:
        if not rid:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id is required: send a unique id per intended action and reuse it "
                "when retrying",
            )
        if not ID_RE.match(rid):
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed request_id {rid[:40]!r}: use 1-128 characters of [A-Za-z0-9._:-]",
            )

    async def _once(
        self,
        method: str,
        rid: str,
        fingerprint: tuple[Any, ...],
        context: grpc.aio.ServicerContext,
        fn: Callable[[], Any],
    ) -> tuple[Any, _Idem]:
        """Run ``fn`` in a thread once per request id; replays get the first outcome."""
        await self._check_request_id(rid, context)
        entry = self._idem.get(rid)
        if entry is not None:
            if entry.method != method or entry.fingerprint != fingerprint:
                await _abort(
                    context,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {rid} was already used for a different request "
                    f"({entry.method} {shown(entry.fingerprint, 160)}); use a new id for a new "
                    "action",
                )
        else:
            # The work runs in its own task: a caller that disconnects (cancelling this RPC)
            # does not cancel it, and replays of the id still get its outcome.
            task: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(fn))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # mark retrieved
            entry = _Idem(method, fingerprint, task)
            self._idem[rid] = entry
            while len(self._idem) > self.max_request_ids:
                self._idem.popitem(last=False)
        try:
            return await asyncio.shield(entry.future), entry
        except Refusal as r:
            await _abort(context, grpc.StatusCode[r.code], r.message)
        except Exception as exc:
            log.exception("event=internal_error method=%s", method)
            await _abort(context, grpc.StatusCode.INTERNAL, f"{method} failed: {exc}")
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    # ---- RPCs ------------------------------------------------------------------------------
    async def Describe(self, request: pb.DescribeRequest, context: Any) -> pb.NodeDescription:
        return await asyncio.to_thread(self.describe_pb)

    async def Prewarm(
        self, request: pb.PrewarmRequest, context: Any
    ) -> AsyncIterator[pb.PrewarmProgress]:
        fp = (
            request.model,
            tuple(sorted(request.gpus)),
            request.layers,
            request.owner,
            request.source,
        )
        changed = asyncio.Event()
        self._wakers.add(changed)
        pin = self._pin(request.model)
        pin.__enter__()
        try:
            if request.source:
                async for info in self._fetch(
                    request.model, request.source, list(request.gpus), context
                ):
                    yield pb.PrewarmProgress(fetch=info)
            slot, entry = await self._once(
                "Prewarm",
                request.request_id,
                fp,
                context,
                lambda: self.core.prewarm(
                    request.model, request.gpus, request.layers, request.owner
                ),
            )
            last: tuple[Any, ...] | None = None
            while True:
                changed.clear()  # before reading the state: a change from here on wakes us
                live = self.core.slots.get(slot.slot_id) is slot
                if not live:
                    if entry.final is not None:  # replay after the slot went away
                        yield entry.final
                        return
                    await _abort(
                        context,
                        grpc.StatusCode.ABORTED,
                        f"slot {slot.slot_id} was evicted before {request.model} finished "
                        "loading; prewarm again with a new request_id",
                    )
                if slot.state == "failed":
                    await _abort(
                        context,
                        grpc.StatusCode.INTERNAL,
                        f"slot {slot.slot_id}: {slot.message}; evict it and retry",
                    )
                # "ready" is set by the loader after the last layer lands (and the promise is
                # released); an active slot keeps loading while it serves.
                done = slot.layers_resident >= slot.layers_target and slot.state != "loading"
                key = (slot.layers_resident, slot.state, done)
                if key != last:
                    last = key
                    msg = pb.PrewarmProgress(
                        slot_id=slot.slot_id,
                        layers_loaded=slot.layers_resident,
                        layers_target=slot.layers_target,
                        bytes_loaded=slot.resident_bytes,
                        bytes_target=slot.layout.bytes_for_layers(slot.layers_target),
                        bandwidth_bytes_per_s=slot.bandwidth,
                        done=done,
                        slot=self.slot_pb(slot),
                    )
                    if done:
                        entry.final = msg
                    yield msg
                if done:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=0.5)
        finally:
            self._wakers.discard(changed)
            pin.__exit__(None, None, None)
            if self.fetcher is not None:
                self.fetcher.touch(request.model)

    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        (slot, freed), _ = await self._once(
            "Evict",
            request.request_id,
            (request.slot_id,),
            context,
            lambda: self.core.evict(request.slot_id),
        )
        return pb.EvictResponse(
            slot_id=slot.slot_id,
            freed_bytes_per_gpu=freed * self.core.page,
            gpus=[self.gpu_pb(g) for g in slot.gpus],
        )

    async def Activate(self, request: pb.ActivateRequest, context: Any) -> pb.ActivateResponse:
        args = tuple(request.engine_args)
        fp = (
            request.model,
            tuple(sorted(request.gpus)),
            request.slot_id,
            request.owner,
            request.source,
            request.engine,
            args,
        )
        if request.source:
            try:  # a bad engine or argument is refused before a fetch changes the store
                self.core.check_engine(request.engine, args)
            except Refusal as r:
                await _abort(context, grpc.StatusCode[r.code], r.message)
        with self._pin(request.model):
            if request.source:
                async for _ in self._fetch(
                    request.model, request.source, list(request.gpus), context
                ):
                    pass  # progress shows in Describe/Watch; Activate answers once
            (inst, evicted), _ = await self._once(
                "Activate",
                request.request_id,
                fp,
                context,
                lambda: self.core.activate(
                    request.model,
                    request.gpus,
                    request.slot_id,
                    request.engine,
                    args,
                    request.owner,
                ),
            )
        if self.fetcher is not None:
            self.fetcher.touch(request.model)
        return pb.ActivateResponse(
            instance=self.instance_pb(inst),
            prewarm_hit=inst.prewarm_hit,
            activation_seconds=inst.activation_seconds,
            evicted_slot_ids=evicted,
        )

    async def BeginGrace(
        self, request: pb.BeginGraceRequest, context: Any
    ) -> pb.BeginGraceResponse:
        inst, _ = await self._once(
            "BeginGrace",
            request.request_id,
            (request.instance_id,),
            context,
            lambda: self.core.begin_grace(request.instance_id),
        )
        return pb.BeginGraceResponse(instance=self.instance_pb(inst))

    async def EndInstance(
        self, request: pb.EndInstanceRequest, context: Any
    ) -> pb.EndInstanceResponse:
        inst, _ = await self._once(
            "EndInstance",
            request.request_id,
            (request.instance_id, request.evict_weights),
            context,
            lambda: self.core.end_instance(request.instance_id, request.evict_weights),
        )
        gs = set(inst.gpus)
        return pb.EndInstanceResponse(
            instance_id=inst.instance_id,
            gpus=[self.gpu_pb(g) for g in inst.gpus],
            slots=[self.slot_pb(s) for s in self.core.slots.values() if gs & set(s.gpus)],
        )

    async def GetLendable(self, request: pb.LendableRequest, context: Any) -> pb.LendableResponse:
        try:
            rows = await asyncio.to_thread(self.core.lendable, list(request.instance_ids))
        except Refusal as r:
            await _abort(context, grpc.StatusCode[r.code], r.message)
        return pb.LendableResponse(
            instances=[pb.LendableInfo(**{**r, "gpus": list(r["gpus"])}) for r in rows]
        )

    async def Watch(self, request: pb.WatchRequest, context: Any) -> None:
        w = _Watcher()
        self._watchers.add(w)
        try:
            if request.include_snapshot:
                snap = await asyncio.to_thread(self.describe_pb, False)
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
                    await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, w.reason)
                await self._write(context, w, self._event_pb_once(w.queue.popleft()))
        finally:
            self._watchers.discard(w)

    async def _write(self, context: Any, w: _Watcher, msg: pb.WatchEvent) -> None:
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
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, w.reason)
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
        try:
            if ev.kind in ("gpu", "worker_replaced"):
                out.gpu.CopyFrom(self.gpu_pb(int(ev.subject)))
            elif ev.kind == "slot" and ev.subject in self.core.slots:
                out.slot.CopyFrom(self.slot_pb(self.core.slots[ev.subject]))
            elif ev.kind == "instance" and ev.subject in self.core.instances:
                out.instance.CopyFrom(self.instance_pb(self.core.instances[ev.subject]))
            elif ev.kind == "fetch" and self.fetcher is not None:
                st = next((f for f in self.fetcher.statuses() if f.model == ev.subject), None)
                if st is not None:
                    out.fetch.CopyFrom(fetch_pb(st))
        except Exception:  # object changed under us; subject_id + kind still tell the story
            log.debug("event=watch_convert_failed kind=%s", ev.kind)
        return out
