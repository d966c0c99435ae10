"""Report: ModelDeployment and GPUNode statuses, conditions and Events.

Statuses are written only when something a person reads changed (:func:`.status.strip_volatile`),
Events for decisions come from :mod:`.act`, and a condition posts an Event only when its reason
changes, never every poll.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from warmserve.api.crd import ModelDeploymentSpec
from warmserve.control.controller import Controller
from warmserve.policy.cluster import ModelSpec, Replica
from warmserve.policy.prewarm_depth import DepthChoice

from .event_budget import EventBudget
from .metrics import Metrics
from .observe import NodeRuntime
from .ports import KubePort, ObjRef, md_ref
from .snapshot import NodeSnapshot
from .status import (
    Condition,
    ModelView,
    model_status,
    node_status,
    now_iso,
    scale_selector,
    strip_volatile,
)

log = logging.getLogger("warmserve.operator")

REPORT_CONCURRENCY = 16
EVENT_RATE = 20.0  # Events per second the operator posts at most (and bursts of EVENT_BURST)
EVENT_BURST = 200.0
BACKLOG = 10_000  # lifecycle Events (Accepted, SpecChanged) waiting for the budget, at most


@dataclass
class Deployment:
    """What the operator remembers about one ModelDeployment between polls (rebuilt after a
    restart from the cluster: history, hit counters in its status, slots at the agents)."""

    md: ModelDeploymentSpec
    spec: ModelSpec | None = None
    depth: DepthChoice | None = None  # how spec.prewarm_layers was chosen (status.model)
    hits: int = 0
    misses: int = 0
    counters_loaded: bool = False
    history_loaded: bool = False
    history_missed_at: float | None = None  # when no stored history was found the first time
    replicas: tuple[Replica, ...] = ()
    unplaced: int = 0
    unplaced_reason: str = ""
    no_capacity: str = ""
    desired: int | None = None
    inflight: float = 0.0  # demand at its instances, last poll
    held: float | None = None  # ... and at the gateways (None: no gateway configured)
    gateway_replicas: int | None = None
    last_status: Any = None
    raw_status: Mapping[str, Any] | None = None
    seen_generation: int | None = None  # the spec generation its lifecycle Event was about

    @property
    def ref(self) -> ObjRef:
        return md_ref(self.md.namespace, self.md.name, self.md.uid)


class Reporter:
    """Writes statuses and posts Events (deduplicated)."""

    def __init__(self, kube: KubePort, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.kube = kube
        self.metrics = metrics
        self.clock = clock
        self._seen: dict[tuple[str, str, str], float] = {}
        self.problem_seen: dict[str, str] = {}  # uid -> last problem status written
        self._budget: EventBudget[tuple[ObjRef, str, str, str]] = EventBudget(
            clock(), EVENT_RATE, EVENT_BURST, BACKLOG
        )
        self.writes = 0  # status writes and Events posted (the loop logs them per slow poll)
        self.posted = 0
        self._flushing: asyncio.Task[None] | None = None

    async def event(
        self, ref: ObjRef | None, type_: str, reason: str, message: str, dedupe_s: float = 0.0
    ) -> None:
        if ref is None:
            return
        key = (f"{ref.kind}/{ref.namespace}/{ref.name}", reason, message)
        now = self.clock()
        if dedupe_s and now - self._seen.get(key, -math.inf) < dedupe_s:
            return
        self._seen[key] = now
        # Over the budget: dropped and counted (event_budget.py says why).
        if not self._budget.take(now):
            self.metrics.events_dropped.inc()
            return
        self.posted += 1
        await self.kube.emit_event(ref, type_, reason, message)

    def later(self, ref: ObjRef, type_: str, reason: str, message: str) -> None:
        """Queue a lifecycle Event (``Accepted``, ``SpecChanged``): :meth:`flush` posts it within
        the budget, so 1,000 new deployments get theirs over a minute instead of 1,000 POSTs
        competing with their status writes (or 800 of them dropped)."""
        if not self._budget.queue((ref, type_, reason, message)):
            self.metrics.events_dropped.inc()

    def flush_soon(self) -> None:
        """:meth:`flush` beside the loop (one at a time): posting 200 queued Events held the
        first poll of 1,000 new deployments ~6 s before any status was written."""
        if self._budget and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.get_running_loop().create_task(self.flush())

    async def flush(self) -> None:
        """Post queued lifecycle Events as far as the budget allows, together."""
        todo = self._budget.drain(self.clock())
        self.posted += len(todo)
        gate = asyncio.Semaphore(REPORT_CONCURRENCY)

        async def one(ref: ObjRef, type_: str, reason: str, message: str) -> None:
            async with gate:
                await self.kube.emit_event(ref, type_, reason, message)

        await asyncio.gather(*(one(*e) for e in todo))

    async def problem(
        self,
        md_ns: str,
        md_name: str,
        uid: str,
        reason: str,
        msg: str,
        generation: int | None = None,
    ) -> None:
        """Degraded + not Ready for a deployment the controller does not act on (invalid
        spec, duplicate model), written once per change, with a Warning Event.  ``generation``:
        the spec generation that was read (a spec that does not parse has none)."""
        if self.problem_seen.get(uid) == f"{reason}:{msg}":
            return
        self.problem_seen[uid] = f"{reason}:{msg}"
        stamp = now_iso(self.clock())
        await self.event(md_ref(md_ns, md_name, uid), "Warning", reason, msg)
        extra = {"observedGeneration": generation} if generation is not None else {}
        await self.kube.patch_md_status(
            md_ns,
            md_name,
            {
                **extra,
                "selector": scale_selector(uid),
                "conditions": [
                    {
                        "type": t,
                        "status": s,
                        "reason": reason,
                        "message": msg,
                        "lastTransitionTime": stamp,
                    }
                    for t, s in (("Degraded", "True"), ("Ready", "False"))
                ]
            },
        )

    def conditions(
        self, d: Deployment, snaps: Mapping[str, NodeSnapshot], problem: Condition | None
    ) -> list[Condition]:
        active = sum(
            1
            for s in snaps.values()
            for i in s.instances
            if i.model == d.md.model and i.phase.value == "serving"
        )
        desired = d.desired if d.desired is not None else d.md.min_instances
        max_gpus = max((len(s.gpus) for s in snaps.values()), default=0)
        if problem is None and not snaps:
            problem = Condition("Degraded", True, "NoAgents", "no GPUNode agent is reachable")
        if problem is None and d.md.tp > max_gpus:
            problem = Condition(
                "Degraded",
                True,
                "Unplaceable",
                f"spec.tensorParallel={d.md.tp} exceeds the GPU count of every node "
                f"(largest: {max_gpus})",
            )
        if problem is None and d.no_capacity:
            problem = Condition("Degraded", True, "NoCapacity", d.no_capacity)
        degraded = problem or Condition("Degraded", False, "AsExpected", "")
        if problem is not None and problem.reason in (
            "Unplaceable",
            "ModelNotFound",
            "ModelNotInStore",
            "SourceUnavailable",
            "SourceNotAllowed",
            "DuplicateModel",
            "NoAgents",
        ):
            ready = Condition("Ready", False, problem.reason, problem.message)
        elif active >= desired and active > 0:
            ready = Condition("Ready", True, "Serving", f"{active} of {desired} desired serving")
        elif desired == 0 and active == 0:
            # Nothing can serve right now: a request waits for a start (issue 16).
            ready = Condition(
                "Ready",
                False,
                "ScaledToZero",
                "no instance runs; the first request starts one (it waits for the start)",
            )
        else:
            ready = Condition(
                "Ready", False, "Starting", f"{active} of {desired} desired instances serving"
            )
        if not d.md.prewarm:
            pre = Condition("Prewarmed", False, "Disabled", "spec.prewarm.enabled is false")
        elif d.unplaced:
            pre = Condition(
                "Prewarmed",
                False,
                "Unplaced",
                f"{d.unplaced} replica(s) not placed: {d.unplaced_reason}",
            )
        elif d.replicas:
            loading = any(
                not any(
                    s.model == r.model and s.gpus == r.gpus and s.state == "ready"
                    for s in snaps[r.node].slots
                )
                if r.node in snaps
                else True
                for r in d.replicas
            )
            pre = Condition(
                "Prewarmed",
                not loading,
                "Loading" if loading else "AllPlaced",
                f"{len(d.replicas)} replica(s) planned",
            )
        else:
            pre = Condition(
                "Prewarmed",
                False,
                "NotRequested",
                "the forecast asks for no prewarm replica this window",
            )
        return [ready, pre, degraded]

    async def deployment(
        self,
        d: Deployment,
        ctl: Controller,
        mine: Mapping[str, NodeSnapshot],
        problem: Condition | None,
        window_s: float,
        events: list[tuple[ObjRef, str, str, str]] | None = None,
    ) -> None:
        """``mine``: every node's snapshot with only what ``d`` owns (:func:`by_owner`).
        ``events``: collects its condition Events for the caller to post (else posted here)."""
        md, spec = d.md, d.spec
        model = md.model
        fc = ctl.forecast_of(model) if spec else None
        last = ctl.last_window(model) if spec else None
        slot_of = {
            (n, s.model, s.gpus): s.slot_id
            for n, snap in mine.items()
            for s in snap.slots
            if s.state != "active"
        }
        view = ModelView(
            generation=md.generation,
            window_s=window_s,
            window_start=(ctl.window_index or 0) * window_s,
            predicted_avg=fc.avg if fc else None,
            predicted_peak=fc.peak if fc else None,
            observed_avg=last[1] if last else None,
            observed_peak=last[2] if last else None,
            history_windows=len(ctl.history(model)) if model in ctl.models else 0,
            hits=d.hits,
            misses=d.misses,
            replicas=d.replicas,
            unplaced=d.unplaced,
            unplaced_reason=d.unplaced_reason,
            weight_bytes=spec.weight_bytes if spec else None,
            num_layers=spec.num_layers if spec else None,
            cold_start_s=spec.cold_start_s if spec else None,
            depth=d.depth if spec else None,
            engine_overhead_bytes=spec.engine_overhead_bytes if spec else 0,
            desired=d.desired,
            inflight=d.inflight,
            held=d.held,
            gateway_replicas=d.gateway_replicas,
            ttft_objective_s=md.ttft_s,
            selector=scale_selector(md.uid),
        )
        view.conditions = self.conditions(d, mine, problem)
        status = model_status(model, view, mine, slot_of, d.raw_status, now_iso(self.clock()))
        self.metrics.instances.labels(model).set(status["instanceCount"])
        self.metrics.replicas.labels(model).set(status["prewarmedCount"])
        key = strip_volatile(status)
        old, write = d.raw_status, key != d.last_status
        if write:  # the status first: what people and tools wait on; its Events after it
            self.writes += 1
            await self.kube.patch_md_status(md.namespace, md.name, status)
            d.last_status = key
            d.raw_status = status
        todo = self._condition_events(old, status)
        if events is None:
            for type_, reason, message in todo:
                await self.event(d.ref, type_, reason, message)
        else:
            events += [(d.ref, type_, reason, message) for type_, reason, message in todo]

    async def everything(
        self,
        deployments: list[Deployment],
        dup_uids: set[str],
        problems: Mapping[str, Condition],
        snaps: Mapping[str, NodeSnapshot],
        ctl: Controller,
        window_s: float,
    ) -> None:
        """Every deployment's status; the writes of a poll go out together, not one after the
        other, and their Events after all of them (issue 16: 1,000 deployments)."""
        owned = by_owner(snaps, [d.md.uid for d in deployments])
        gate = asyncio.Semaphore(REPORT_CONCURRENCY)
        events: list[tuple[ObjRef, str, str, str]] = []

        async def one(d: Deployment) -> None:
            uid = d.md.uid
            async with gate:
                if uid in dup_uids:
                    c = problems[uid]
                    await self.problem(
                        d.md.namespace, d.md.name, uid, c.reason, c.message, d.md.generation
                    )
                else:
                    await self.deployment(d, ctl, owned[uid], problems.get(uid), window_s, events)

        await asyncio.gather(*(one(d) for d in deployments))

        async def post(ref: ObjRef, type_: str, reason: str, message: str) -> None:
            async with gate:
                await self.event(ref, type_, reason, message)

        await asyncio.gather(*(post(*e) for e in events))

    @staticmethod
    def _condition_events(
        before: Mapping[str, Any] | None, status: Mapping[str, Any]
    ) -> list[tuple[str, str, str]]:
        """An Event whenever Degraded or Prewarmed changes reason (not every poll)."""
        old = {c.get("type"): c for c in (before or {}).get("conditions") or []}
        out = []
        for c in status["conditions"]:
            prev = old.get(c["type"])
            if prev and prev.get("reason") == c["reason"] and prev.get("status") == c["status"]:
                continue
            if c["type"] == "Degraded" and c["status"] == "True":
                out.append(("Warning", c["reason"], c["message"]))
            elif c["type"] == "TTFTObjectiveMet" and c["status"] == "False":
                out.append(("Warning", "TTFTObjectiveMissed", c["message"]))
            elif c["type"] == "Prewarmed" and c["reason"] == "Unplaced":
                out.append(("Warning", "Unplaced", c["message"]))
            elif c["type"] == "Prewarmed" and c["reason"] == "AllPlaced":
                out.append(("Normal", "Prewarmed", "every requested prewarm replica is resident"))
        return out

    async def node(self, name: str, nrt: NodeRuntime, now: float, refresh_s: float) -> None:
        reachable = nrt.failures == 0 and nrt.snap is not None
        msg = f"agent {nrt.spec.address}" + (f": {nrt.error}" if nrt.error else "")
        status = node_status(
            nrt.snap if not nrt.lost else None,
            reachable,
            msg,
            nrt.raw_status,
            now_iso(now),
            nrt.last_seen,
        )
        key = strip_volatile(status)
        if key != nrt.last_status or now - nrt.last_write >= refresh_s:
            await self.kube.patch_node_status(name, status)
            nrt.last_status, nrt.last_write, nrt.raw_status = key, now, status


def by_owner(
    snaps: Mapping[str, NodeSnapshot], uids: Iterable[str]
) -> dict[str, dict[str, NodeSnapshot]]:
    """Per deployment UID, every node's snapshot with only the slots and instances it owns (or
    that no one owns): one pass over the snapshots, not one per deployment."""
    slots: dict[tuple[str, str], list[Any]] = defaultdict(list)
    insts: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for n, snap in snaps.items():
        for s in snap.slots:
            slots[(s.owner, n)].append(s)
        for i in snap.instances:
            insts[(i.owner, n)].append(i)
    return {
        uid: {
            n: replace(
                snap,
                slots=(*slots.get((uid, n), ()), *slots.get(("", n), ())),
                instances=(*insts.get((uid, n), ()), *insts.get(("", n), ())),
            )
            for n, snap in snaps.items()
        }
        for uid in uids
    }
