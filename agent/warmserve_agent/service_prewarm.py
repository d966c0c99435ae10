"""``Prewarm`` and ``Evict``: loading a model's first layers into a prewarm slot, and freeing it.

``Prewarm`` (WarmServe §4.1: universal workers hold several models' first layers in prewarm
slots) fetches the model first when it names a ``source``, admits the slot once per request id
(:mod:`~warmserve_agent.service_idempotency`) and streams the slot's progress until the requested
layers are resident; a replay after the slot went away gets the last progress message sent.
``Evict`` frees a slot's pages and answers the GPUs it touched.

:class:`PrewarmHandler` is held by the servicer (:class:`~warmserve_agent.service.AgentService`),
which hands it the call table, the fetch coordinator, the describer and the Watch hub's
``waker`` (an event set whenever the core changed, so a stream waits without polling).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.api.agent.wire import SlotState
from warmserve_agent.fencing import enforce
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.service_describe import Describer
from warmserve_agent.service_fetch import FetchCoordinator
from warmserve_agent.service_idempotency import IdempotentCalls, abort


class PrewarmHandler:
    """``Prewarm`` and ``Evict`` (see module docstring)."""

    def __init__(
        self,
        core: NodeCore,
        calls: IdempotentCalls,
        fetches: FetchCoordinator,
        describer: Describer,
        waker: Callable[[], contextlib.AbstractContextManager[asyncio.Event]],
    ) -> None:
        self.core = core
        self.calls = calls
        self.fetches = fetches
        self.describer = describer
        self.waker = waker

    async def prewarm(
        self, request: pb.PrewarmRequest, context: Any
    ) -> AsyncIterator[pb.PrewarmProgress]:
        args = tuple(request.engine_args)
        fp = (
            request.model,
            tuple(sorted(request.gpus)),
            request.layers,
            request.owner,
            request.source,
            request.engine,
            args,
        )
        try:
            with self.waker() as changed, self.fetches.pin(request.model):
                if request.source:  # a deposed leader's call must not fill the store either
                    await enforce(self.calls.fence, "Prewarm", request.fencing_token, context)
                    try:  # a bad engine or argument is refused before a fetch changes the store
                        self.core.check_engine(request.engine, args)
                    except Refusal as r:
                        await abort(context, grpc.StatusCode[r.code], r.message)
                    async for info in self.fetches.fetch(
                        request.model, request.source, list(request.gpus), context
                    ):
                        yield pb.PrewarmProgress(fetch=info)
                slot, entry = await self.calls.once(
                    "Prewarm",
                    request.request_id,
                    fp,
                    context,
                    lambda: self.core.prewarm(
                        request.model,
                        request.gpus,
                        request.layers,
                        request.owner,
                        request.engine,
                        args,
                    ),
                    request.fencing_token,
                )
                last: tuple[Any, ...] | None = None
                while True:
                    changed.clear()  # before reading the state: a change from here on wakes us
                    live = self.core.slots.get(slot.slot_id) is slot
                    if not live:
                        if entry.final is not None:  # replay after the slot went away
                            yield entry.final
                            return
                        await abort(
                            context,
                            grpc.StatusCode.ABORTED,
                            f"slot {slot.slot_id} was evicted before {request.model} finished "
                            "loading; prewarm again with a new request_id",
                        )
                    if slot.state == SlotState.FAILED:
                        await abort(
                            context,
                            grpc.StatusCode.INTERNAL,
                            f"slot {slot.slot_id}: {slot.message}; evict it and retry",
                        )
                    # READY is set by the loader after the last layer lands (and the promise is
                    # released); an active slot keeps loading while it serves.
                    done = (
                        slot.layers_resident >= slot.layers_target
                        and slot.state != SlotState.LOADING
                    )
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
                            slot=self.describer.slot_pb(slot),
                        )
                        if done:
                            entry.final = msg
                        yield msg
                    if done:
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), timeout=0.5)
        finally:
            self.fetches.touch(request.model)

    async def evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        (slot, freed), _ = await self.calls.once(
            "Evict",
            request.request_id,
            (request.slot_id,),
            context,
            lambda: self.core.evict(request.slot_id),
            request.fencing_token,
        )
        return pb.EvictResponse(
            slot_id=slot.slot_id,
            freed_bytes_per_gpu=freed * self.core.page,
            gpus=[self.describer.gpu_pb(g) for g in slot.gpus],
        )
