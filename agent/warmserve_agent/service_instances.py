"""Serving instances over gRPC: ``Activate``, ``BeginGrace``, ``EndInstance`` and ``GetLendable``.

``Activate`` starts an instance on a GPU group (WarmServe §4.2: a prewarm hit on a slot that
holds the model's first layers, else a cold start), fetching the model first when it names a
``source`` (a bad engine or argument is refused before a fetch changes the store).  ``BeginGrace``
moves an instance into its grace period, whose free KV pages can be lent to prewarm slots
(proactive prewarming, §4.1, Eq. 1); ``GetLendable`` reports them; ``EndInstance`` ends it.  Each
mutating call runs once per request id (:mod:`~warmserve_agent.service_idempotency`).

:class:`InstanceHandler` is held by the servicer (:class:`~warmserve_agent.service.AgentService`),
which hands it the call table, the fetch coordinator and the describer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.policy.cluster import InstancePhase
from warmserve_agent.fencing import enforce
from warmserve_agent.model_profile import time_forward
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.service_describe import Describer
from warmserve_agent.service_fetch import FetchCoordinator
from warmserve_agent.service_idempotency import IdempotentCalls, abort


class InstanceHandler:
    """Instance lifecycle RPCs (see module docstring)."""

    def __init__(
        self,
        core: NodeCore,
        calls: IdempotentCalls,
        fetches: FetchCoordinator,
        describer: Describer,
    ) -> None:
        self.core = core
        self.calls = calls
        self.fetches = fetches
        self.describer = describer
        self._probing: set[str] = set()  # models whose forward is being timed
        # instance id -> the probe timing a forward on it (held: a task nothing references may
        # be collected mid-run)
        self._probes: dict[str, asyncio.Task[None]] = {}

    async def activate(self, request: pb.ActivateRequest, context: Any) -> pb.ActivateResponse:
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
            await enforce(self.calls.fence, "Activate", request.fencing_token, context)
            try:  # a bad engine or argument is refused before a fetch changes the store
                self.core.check_engine(request.engine, args)
            except Refusal as r:
                await abort(context, grpc.StatusCode[r.code], r.message)
        with self.fetches.pin(request.model):
            if request.source:
                async for _ in self.fetches.fetch(
                    request.model, request.source, list(request.gpus), context
                ):
                    pass  # progress shows in Describe/Watch; Activate answers once
            (inst, evicted), _ = await self.calls.once(
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
        self.fetches.touch(request.model)
        self._profile(inst)
        return pb.ActivateResponse(
            instance=self.describer.instance_pb(inst),
            prewarm_hit=inst.prewarm_hit,
            activation_seconds=inst.activation_seconds,
            evicted_slot_ids=evicted,
        )

    def _profile(self, inst: Any) -> None:
        """Feed the model's profile (:mod:`~warmserve_agent.model_profile`): a prewarm hit's
        activation is the head start the streamed layers get; a model without a timed forward
        gets one on this instance, in the background (Activate answers first), while it serves:
        BeginGrace and EndInstance cancel it (:meth:`_stop_probe`)."""
        profiles = self.core.state.profiles
        if inst.prewarm_hit:
            profiles.record_activation(inst.model, inst.activation_seconds)
        if not inst.endpoint or inst.model in self._probing or not profiles.wants_forward(
            inst.model
        ):
            return
        # a replayed Activate answers an instance that may be in grace or gone by now
        if inst.phase != InstancePhase.SERVING or inst.instance_id not in self.core.instances:
            return
        try:
            layers = self.core.store.model(inst.model).num_layers
        except Exception:  # the store lost the model meanwhile: measure at the next start
            return

        async def probe() -> None:
            try:
                got = await time_forward(inst.endpoint, inst.model, layers)
                if got is not None:
                    profiles.record_forward(inst.model, len(inst.gpus), got[1], got[0])
            finally:
                self._probing.discard(inst.model)
                if self._probes.get(inst.instance_id) is task:
                    del self._probes[inst.instance_id]

        self._probing.add(inst.model)
        task = asyncio.get_running_loop().create_task(probe())
        self._probes[inst.instance_id] = task

    async def _stop_probe(self, instance_id: str) -> None:
        """Cancel the probe on ``instance_id`` and wait until its request is given up: a
        grace instance lends its free KV (Eq. 1), where the probe's request would wait for
        blocks and hold the engine's stop; an ended one has nothing left to measure."""
        task = self._probes.pop(instance_id, None)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # never raises: our own cancellation stays ours

    async def close(self) -> None:
        """Stop timing forwards (the agent stops)."""
        for iid in list(self._probes):
            await self._stop_probe(iid)

    async def begin_grace(
        self, request: pb.BeginGraceRequest, context: Any
    ) -> pb.BeginGraceResponse:
        await enforce(self.calls.fence, "BeginGrace", request.fencing_token, context)
        await self._stop_probe(request.instance_id)  # before any of its KV is lent
        inst, _ = await self.calls.once(
            "BeginGrace",
            request.request_id,
            (request.instance_id,),
            context,
            lambda: self.core.begin_grace(request.instance_id),
            request.fencing_token,
        )
        await self._stop_probe(request.instance_id)  # one a racing Activate replay started
        return pb.BeginGraceResponse(instance=self.describer.instance_pb(inst))

    async def end_instance(
        self, request: pb.EndInstanceRequest, context: Any
    ) -> pb.EndInstanceResponse:
        await enforce(self.calls.fence, "EndInstance", request.fencing_token, context)
        await self._stop_probe(request.instance_id)
        inst, _ = await self.calls.once(
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
            gpus=[self.describer.gpu_pb(g) for g in inst.gpus],
            slots=[self.describer.slot_pb(s) for s in self.core.slots.values() if gs & set(s.gpus)],
        )

    async def get_lendable(self, request: pb.LendableRequest, context: Any) -> pb.LendableResponse:
        try:
            rows = await asyncio.to_thread(self.core.lendable, list(request.instance_ids))
        except Refusal as r:
            await abort(context, grpc.StatusCode[r.code], r.message)
        return pb.LendableResponse(
            instances=[pb.LendableInfo(**{**r, "gpus": list(r["gpus"])}) for r in rows]
        )
