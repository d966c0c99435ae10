"""The gRPC service ``warmserve.agent.v1.NodeAgent`` over :class:`~warmserve_agent.node.NodeCore`.

Responsibilities beyond translating messages:

* **Idempotency.** Every mutating call carries a ``request_id``.  The first call with an id runs;
  a replay with the same id and the same arguments waits for / returns the first outcome (the
  same answer, or the same error) without redoing the work; the same id with different
  arguments is refused with ALREADY_EXISTS.  The last ``max_request_ids`` ids are remembered.
* **Fencing.** Every mutating call and ``Describe`` pass the caller's ``fencing_token`` through
  :mod:`~warmserve_agent.fencing` before anything changes: a deposed operator leader's late
  call is refused (FAILED_PRECONDITION, ``fenced: ...``).
* **Status codes.** :class:`~warmserve_agent.node_records.Refusal` carries the gRPC status name
  and a message a person can act on; it becomes ``context.abort(code, message)``.
* **Streams.** ``Prewarm`` streams progress of its slot until the requested layers are resident;
  ``Watch`` streams every state change (the core's event bus) with the changed object.  Each event
  is fanned out once (one hop onto the event loop, converted to protobuf once for all watchers) into
  per-watcher queues of at most ``max_watch_queue`` events; a watcher whose queue overflows or that
  does not take a message for ``watch_write_timeout_s`` (a client that stopped reading) is dropped
  with RESOURCE_EXHAUSTED and must re-Watch with a snapshot.
* **Error messages** echo client input only through :mod:`~warmserve_agent.safe_text` and are
  bounded as a whole (printable, at most 1 KiB).
* Core calls run in threads (``asyncio.to_thread``): loading and engine start-up block.

:class:`AgentService` is the servicer (the generated ``NodeAgentServicer`` is its only base);
it builds and holds one collaborator per concept and answers each RPC through one of them::

    AgentService ─┬─▶ PrewarmHandler ──┬─▶ IdempotentCalls ─▶ Fence
                  ├─▶ InstanceHandler ─┼─▶ FetchCoordinator ─▶ ModelFetcher
                  └─▶ WatchHub ────────┴─▶ Describer ─▶ NodeCore

(the prewarm handler waits on the hub's ``waker``, handed over as a callable).

* :mod:`~warmserve_agent.service_idempotency`: request ids, run-once calls, :func:`abort`.
* :mod:`~warmserve_agent.service_describe`: ``Describe``, the protobuf views of GPUs, slots and
  instances, the cached model catalogue.
* :mod:`~warmserve_agent.service_fetch`: fetching a model named by ``source``, ``InspectModel``.
* :mod:`~warmserve_agent.service_watch`: the event fan-out and ``Watch``.
* :mod:`~warmserve_agent.service_prewarm`: ``Prewarm`` (§4.1 prewarm slots) and ``Evict``.
* :mod:`~warmserve_agent.service_instances`: ``Activate`` (§4.2), ``BeginGrace`` and
  ``GetLendable`` (Eq. 1 lending), ``EndInstance``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.api.agent.v1 import agent_pb2_grpc as pb_grpc
from warmserve_agent.fencing import Fence, enforce
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Event
from warmserve_agent.service_describe import Describer, ServiceInfo
from warmserve_agent.service_fetch import FetchCoordinator
from warmserve_agent.service_idempotency import IdempotentCalls
from warmserve_agent.service_instances import InstanceHandler
from warmserve_agent.service_prewarm import PrewarmHandler
from warmserve_agent.service_watch import WatchHub
from warmserve_agent.sources.fetcher import ModelFetcher


class AgentService(pb_grpc.NodeAgentServicer):
    """The ``NodeAgent`` servicer (see module docstring)."""

    def __init__(
        self,
        core: NodeCore,
        info: ServiceInfo,
        *,
        max_request_ids: int = 10000,
        max_watch_queue: int = 1024,
        watch_write_timeout_s: float = 30.0,
        fetcher: ModelFetcher | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.core = core
        self.info = info
        self.fetcher = fetcher
        self.fence = fence if fence is not None else Fence()
        self.calls = IdempotentCalls(self.fence, max_request_ids)
        self.fetches = FetchCoordinator(core, fetcher)
        self.describer = Describer(core, info, fetcher)
        self.hub = WatchHub(
            core,
            self.describer,
            fetcher,
            max_watch_queue=max_watch_queue,
            watch_write_timeout_s=watch_write_timeout_s,
        )
        self.prewarms = PrewarmHandler(
            core, self.calls, self.fetches, self.describer, self.hub.waker
        )
        self.instances = InstanceHandler(core, self.calls, self.fetches, self.describer)

    # ---- for the server and tests ----------------------------------------------------------
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.hub.bind_loop(loop)

    def describe_pb(self, refresh: bool = True) -> pb.NodeDescription:
        return self.describer.describe_pb(refresh)

    def publish(self, ev: Event) -> None:
        self.hub.publish(ev)

    @property
    def watcher_count(self) -> int:
        return self.hub.watcher_count

    @property
    def watchers_dropped(self) -> int:
        return self.hub.watchers_dropped

    def queued_events(self) -> int:
        return self.hub.queued_events()

    # ---- RPCs ------------------------------------------------------------------------------
    async def Describe(self, request: pb.DescribeRequest, context: Any) -> pb.NodeDescription:
        # A leader's token raises the fence before it decides from this state: a deposed
        # leader's call that lands after it cannot act on what the new leader saw.
        await enforce(self.fence, "Describe", request.fencing_token, context, read=True)
        return await asyncio.to_thread(self.describer.describe_pb)

    async def Watch(self, request: pb.WatchRequest, context: Any) -> None:
        await self.hub.watch(request, context)

    async def Prewarm(
        self, request: pb.PrewarmRequest, context: Any
    ) -> AsyncIterator[pb.PrewarmProgress]:
        # grpc.aio tells a streaming handler by its kind (an async generator function), so
        # this one yields; aclosing ends the handler's stream (its pins) when the call ends.
        async with contextlib.aclosing(self.prewarms.prewarm(request, context)) as progress:
            async for msg in progress:
                yield msg

    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        return await self.prewarms.evict(request, context)

    async def Activate(self, request: pb.ActivateRequest, context: Any) -> pb.ActivateResponse:
        return await self.instances.activate(request, context)

    async def BeginGrace(
        self, request: pb.BeginGraceRequest, context: Any
    ) -> pb.BeginGraceResponse:
        return await self.instances.begin_grace(request, context)

    async def EndInstance(
        self, request: pb.EndInstanceRequest, context: Any
    ) -> pb.EndInstanceResponse:
        return await self.instances.end_instance(request, context)

    async def GetLendable(self, request: pb.LendableRequest, context: Any) -> pb.LendableResponse:
        return await self.instances.get_lendable(request, context)

    async def InspectModel(self, request: pb.InspectModelRequest, context: Any) -> pb.ModelInfo:
        return await self.fetches.inspect_model(request, context)
