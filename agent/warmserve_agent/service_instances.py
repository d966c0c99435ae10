"""Serving instances over gRPC: ``Activate``, ``BeginGrace``, ``EndInstance`` and ``GetLendable``.

``Activate`` starts an instance on a GPU group (WarmServe §4.2: a prewarm hit on a slot that
holds the model's first layers, else a cold start), fetching the model first when it names a
``source`` (a bad engine or argument is refused before a fetch changes the store).  ``BeginGrace``
moves an instance into its grace period, whose free KV pages can be lent to prewarm slots
(proactive prewarming, §4.1, Eq. 1); ``GetLendable`` reports them; ``EndInstance`` ends it.  Each
mutating call runs once per request id (:mod:`~warmserve_agent.service_idempotency`).

A layer of :class:`~warmserve_agent.service.AgentService` (see that module's docstring).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from warmserve_agent.api.v1 import agent_pb2 as pb
from warmserve_agent.fencing import enforce
from warmserve_agent.node_records import Refusal
from warmserve_agent.service_describe import Description
from warmserve_agent.service_fetch import ModelFetching
from warmserve_agent.service_idempotency import IdempotentCalls, abort


class InstanceRPCs(IdempotentCalls, ModelFetching, Description):
    """Instance lifecycle RPCs (see module docstring); the state is set by
    :class:`~warmserve_agent.service.AgentService`."""

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
            await enforce(self.fence, "Activate", request.fencing_token, context)
            try:  # a bad engine or argument is refused before a fetch changes the store
                self.core.check_engine(request.engine, args)
            except Refusal as r:
                await abort(context, grpc.StatusCode[r.code], r.message)
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
                request.fencing_token,
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
            request.fencing_token,
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
            request.fencing_token,
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
            await abort(context, grpc.StatusCode[r.code], r.message)
        return pb.LendableResponse(
            instances=[pb.LendableInfo(**{**r, "gpus": list(r["gpus"])}) for r in rows]
        )
