"""Observe: the GPU nodes' agents, and what they report as the controller's observation.

:class:`Observer` keeps one :class:`NodeRuntime` per ``GPUNode`` (from the kopf index, see
:mod:`.handlers`), asks every agent to ``Describe`` itself each poll (the agents are the source
of truth for slots and instances, so a restarted operator rebuilds its view from them), and
declares an agent lost after ``agent_lost_after`` failed polls.

:func:`observation` turns the agents' snapshots into a
:class:`warmserve.control.observation.Observation`: raw facts only (free memory and worker
states are the control layer's rule), ownership resolved by UID (:mod:`.identity`; what another
deployment owns is reported as *foreign*), and the agent calls still in flight added (a prewarm
as a slot, a start as a starting instance) so the controller does not decide them twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from warmserve.api.crd import GPUNodeSpec, SpecError, parse_gpu_node
from warmserve.control.observation import GpuObs, InstanceObs, Observation, SlotObs
from warmserve.policy.cluster import InstancePhase

from .agents import AgentPool
from .context import NodePort
from .identity import Ownership, gpus_str, ownership
from .ports import KubePort, ObjRef, node_ref
from .snapshot import AgentCallError, NodeSnapshot

log = logging.getLogger("warmserve.operator")

EventSink = Callable[[ObjRef | None, str, str, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class PendingPrewarm:
    node: str
    model: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    owner: str = ""


@dataclass(frozen=True, slots=True)
class PendingStart:
    node: str
    model: str
    gpus: tuple[int, ...]
    owner: str = ""


@dataclass
class NodeRuntime:
    spec: GPUNodeSpec
    snap: NodeSnapshot | None = None
    failures: int = 0
    lost: bool = False
    last_seen: float | None = None
    error: str = ""
    last_status: Any = None
    last_write: float = 0.0
    raw_status: Mapping[str, Any] | None = None


class Observer:
    """GPU nodes and their agents' snapshots."""

    def __init__(
        self,
        kube: KubePort,
        agents: AgentPool,
        events: EventSink,
        *,
        poll_s: float,
        agent_lost_after: int,
        on_nodes: Callable[[], None] = lambda: None,
    ) -> None:
        self.kube = kube
        self.agents = agents
        self.events = events
        self.poll_s = poll_s
        self.agent_lost_after = agent_lost_after
        self.on_nodes = on_nodes
        self.nodes: dict[str, NodeRuntime] = {}

    async def load_nodes(self) -> None:
        seen: set[str] = set()
        for body in await self.kube.list_gpu_nodes():
            try:
                spec = parse_gpu_node(body)
            except SpecError as exc:
                log.warning("event=gpunode_invalid error=%r", str(exc))
                continue
            seen.add(spec.name)
            rt = self.nodes.get(spec.name)
            if rt is None:
                rt = self.nodes[spec.name] = NodeRuntime(spec, raw_status=body.get("status"))
            rt.spec = spec
        for name in list(self.nodes):
            if name not in seen:
                self.nodes.pop(name)
        self.agents.forget_except(seen)
        self.on_nodes()

    async def _describe_one(self, rt: NodeRuntime, now: float) -> None:
        client = self.agents.get(rt.spec.name, rt.spec.address)
        try:
            snap = await asyncio.wait_for(client.describe(), timeout=max(self.poll_s * 2, 2.0))
        except (AgentCallError, TimeoutError, OSError) as exc:
            rt.failures += 1
            rt.error = str(exc) or type(exc).__name__
            if rt.failures >= self.agent_lost_after and not rt.lost:
                rt.lost = True
                rt.snap = None
                log.warning("event=agent_lost node=%s error=%r", rt.spec.name, rt.error)
                await self.events(
                    node_ref(rt.spec.name),
                    "Warning",
                    "AgentLost",
                    f"agent at {rt.spec.address} did not answer {rt.failures} polls: {rt.error}",
                )
            return
        if rt.lost:
            await self.events(
                node_ref(rt.spec.name),
                "Normal",
                "AgentBack",
                f"agent at {rt.spec.address} answers again (agent id {snap.agent_id})",
            )
        rt.snap, rt.failures, rt.lost, rt.last_seen, rt.error = snap, 0, False, now, ""

    async def describe_all(self, now: float) -> int:
        """Describe every agent; returns how many answered."""
        await asyncio.gather(*(self._describe_one(rt, now) for rt in self.nodes.values()))
        return sum(1 for rt in self.nodes.values() if rt.failures == 0 and rt.snap)

    def live_ports(self) -> dict[str, NodePort]:
        """The nodes the controller sees (reachable, or not yet declared lost; not cordoned):
        each agent's port and its snapshot of this poll."""
        return {
            name: NodePort(self.agents.get(name, rt.spec.address), rt.snap)
            for name, rt in self.nodes.items()
            if rt.snap is not None and not rt.lost and not rt.spec.cordoned
        }


def observation(
    now: float,
    snaps: Mapping[str, NodeSnapshot],
    owners: Mapping[str, str],
    live: AbstractSet[str],
    pending_prewarms: Iterable[PendingPrewarm] = (),
    pending_starts: Iterable[PendingStart] = (),
    held: Mapping[str, int] | None = None,
    engine_bytes: Mapping[str, int] | None = None,
) -> Observation:
    """The controller's observation of ``snaps`` (module docstring).  ``owners``: model ->
    owning deployment UID of the models the controller manages; ``live``: every listed UID;
    ``engine_bytes``: model -> what a slot's prepared engine occupies per GPU beside the
    weights the agent reports (``ModelSpec.engine_overhead_bytes``), so a slot is observed at
    what the simulator's slot of the same model occupies."""
    engine_bytes = engine_bytes or {}
    gpus: list[GpuObs] = []
    slots: list[SlotObs] = []
    insts: list[InstanceObs] = []
    reported: set[tuple[str, str, tuple[int, ...]]] = set()
    busy: set[tuple[str, int]] = set()
    for name in sorted(snaps):
        snap = snaps[name]
        valid = {g.index for g in snap.gpus}
        for g in sorted(snap.gpus, key=lambda g: g.index):
            gpus.append(GpuObs(name, g.index, g.memory_bytes, max(g.free_bytes, 0)))
        for s in sorted(snap.slots, key=lambda s: (s.model, s.gpus, s.slot_id)):
            if s.state == "active" or not s.gpus or not set(s.gpus) <= valid:
                continue
            mine = ownership(s.model, s.owner, owners, live) == Ownership.MINE
            # a second slot of one model on the same GPUs is removed as a duplicate (.identity)
            usable = mine and s.state != "failed" and (name, s.model, s.gpus) not in reported
            slots.append(
                SlotObs(
                    s.slot_id,
                    s.model,
                    name,
                    s.gpus,
                    s.target_bytes_per_gpu + engine_bytes.get(s.model, 0),
                    s.layers_resident or None,
                    foreign=not usable,
                )
            )
            reported.add((name, s.model, s.gpus))
        for i in snap.instances:
            if not i.gpus or not set(i.gpus) <= valid:
                continue
            mine = ownership(i.model, i.owner, owners, live) == Ownership.MINE
            busy.update((name, g) for g in i.gpus)
            insts.append(
                InstanceObs(
                    i.instance_id,
                    i.model,
                    name,
                    i.gpus,
                    i.phase,
                    in_flight=i.load,
                    running=i.running,
                    # M of Eq. 1 as configured: the agent reports it shrunk by what was lent
                    kv_capacity_bytes=i.kv_capacity_bytes + i.lent_bytes * len(i.gpus),
                    kv_used_bytes=i.kv_used_bytes,
                    grace_started_s=i.grace_started_unix or None,
                    max_batch=i.max_batch,
                    foreign=not mine,
                )
            )
    nodes = set(snaps)
    for p in pending_prewarms:
        key = (p.node, p.model, p.gpus)
        if p.node in nodes and p.model in owners and key not in reported:
            slots.append(SlotObs("", p.model, p.node, p.gpus, p.bytes_per_gpu))
    for p in pending_starts:
        if p.node in nodes and p.model in owners and not any((p.node, g) in busy for g in p.gpus):
            insts.append(
                InstanceObs(
                    f"pending:{p.node}:{gpus_str(p.gpus)}",
                    p.model,
                    p.node,
                    p.gpus,
                    InstancePhase.STARTING,
                )
            )
    return Observation(now, tuple(gpus), tuple(slots), tuple(insts), dict(held or {}))


def note_grace(started: dict[str, float], snap: NodeSnapshot, now: float) -> set[str]:
    """Record in ``started`` when each grace instance of ``snap`` began its grace (the agent's
    record, else now: first sight); return their ids."""
    seen = set()
    for inst in snap.instances:
        if inst.phase.value == "grace":
            seen.add(inst.instance_id)
            first = started.setdefault(inst.instance_id, now)
            if inst.grace_started_unix:
                started[inst.instance_id] = min(inst.grace_started_unix, first)
    return seen
