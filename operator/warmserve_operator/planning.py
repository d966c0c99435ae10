"""Decision -> action translation: from agent snapshots to the policy core and back.

Pure functions, no I/O, so they are unit-tested without Kubernetes or gRPC:

* :func:`build_state` turns what the agents report (plus the actions still in flight) into the
  policy core's :class:`~warmserve.policy.cluster.ClusterState`, and lists what no deployment
  owns (orphan slots and instances).
* :func:`window_actions` runs Algorithm 1 (:func:`warmserve.policy.placement.plan_prewarm`) and
  turns its keep/place/evict plan into agent calls.
* :func:`scaling_actions` runs the autoscaler (:func:`warmserve.policy.autoscaler.decide`) and
  :func:`warmserve.policy.placement.choose_start` for each scale-up, applying every start to
  the snapshot before the next one so two starts never pick the same GPUs.
* :func:`teardown_actions` lists what deleting a deployment must remove.

Identity: what belongs to a deployment is what the agent recorded with its *UID* as owner
(``SlotView.owner`` / ``InstanceView.owner``, set by the Prewarm/Activate calls), never what
merely has the same model name: a ``DuplicateModel`` deployment in another namespace names the
same model but owns nothing, so deleting it touches nothing (issue 16, H2).  Slots and
instances without an owner (made by an operator before owners existed) keep the old rule:
they belong to whichever deployment serves their model.

Ending an instance always goes through its grace period: the agent refuses ``EndInstance`` for
a serving instance, so teardown and orphan removal first ``BeginGrace`` and end the instance
once it is idle or its grace is over (:func:`drain_actions`, issue 16, H1).

No policy logic lives here: counts, scores, placement, start choice and hysteresis are the
policy core's; this module only maps identities (slot ids, instance ids, request ids).

Existing replicas enter the snapshot as ``basic`` rank ``i`` with score 0: the placement core
re-scores resident replicas itself (it matches them to this window's requests), so the operator
keeps no replica metadata that a restart could lose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from enum import StrEnum

from warmserve.policy.autoscaler import AutoscalerConfig, ScaleDecision, ScaleMemory, decide
from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    Instance,
    InstancePhase,
    LoadForecast,
    ModelSpec,
    Node,
    Replica,
    ReplicaKind,
    WorkerState,
)
from warmserve.policy.placement import NoCapacity, PrewarmPlan, choose_start, plan_prewarm

from .actions import Action, Activate, BeginGrace, EndInstance, Evict, Prewarm, gpus_str, request_id
from .agents import InstanceView, NodeSnapshot, SlotView

SlotKey = tuple[str, str, tuple[int, ...]]  # (node, model, gpus)


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


class Ownership(StrEnum):
    MINE = "mine"  # the model's current owner deployment's (or legacy, unowned)
    FOREIGN = "foreign"  # another live deployment's (e.g. one being deleted): hands off
    ORPHAN = "orphan"  # no live deployment owns it: remove


def ownership(
    model: str,
    owner: str,
    models: Mapping[str, object],
    owners: Mapping[str, str] | None,
    live: AbstractSet[str],
) -> Ownership:
    """Whose a slot/instance of ``model`` with agent-recorded ``owner`` UID is.

    ``owners``: model -> UID of the deployment that serves it now (``None``: ownership by model
    name only, for callers without UIDs); ``live``: UIDs of every listed deployment (also
    duplicates and those being deleted).
    """
    if owners is None or not owner:  # by model name (legacy: no owner recorded)
        return Ownership.MINE if model in models else Ownership.ORPHAN
    if model in models and owners.get(model) == owner:
        return Ownership.MINE
    return Ownership.FOREIGN if owner in live else Ownership.ORPHAN


@dataclass(frozen=True)
class Built:
    """A policy snapshot plus the identity maps needed to act on its decisions."""

    state: ClusterState
    slot_of: Mapping[SlotKey, str]
    orphan_slots: tuple[tuple[str, SlotView, str], ...] = ()
    orphan_instances: tuple[tuple[str, InstanceView], ...] = ()
    snaps: Mapping[str, NodeSnapshot] = field(default_factory=dict)
    owners: Mapping[str, str] = field(default_factory=dict)  # model -> owner UID


def _gpu(g: object) -> GPU:
    from .agents import GpuView

    assert isinstance(g, GpuView)
    free = 0 if g.state == WorkerState.DEDICATED else max(0, min(g.free_bytes, g.memory_bytes))
    return GPU(g.index, g.memory_bytes, free, g.state)


def build_state(
    models: Mapping[str, ModelSpec],
    snaps: Mapping[str, NodeSnapshot],
    forecasts: Mapping[str, LoadForecast],
    *,
    pending_prewarms: Iterable[PendingPrewarm] = (),
    pending_starts: Iterable[PendingStart] = (),
    owners: Mapping[str, str] | None = None,
    live: AbstractSet[str] = frozenset(),
) -> Built:
    """The policy's view of the cluster from the agents' snapshots (see module docstring).

    ``owners``/``live``: see :func:`ownership`; a foreign slot or instance is neither a replica
    nor an orphan (its GPUs' free memory and state already account for it).
    """
    nodes: list[Node] = []
    replicas: list[Replica] = []
    instances: list[Instance] = []
    slot_of: dict[SlotKey, str] = {}
    orphan_slots: list[tuple[str, SlotView, str]] = []
    orphan_instances: list[tuple[str, InstanceView]] = []
    for name in sorted(snaps):
        snap = snaps[name]
        node = Node(name, tuple(_gpu(g) for g in sorted(snap.gpus, key=lambda g: g.index)))
        nodes.append(node)
        valid = {g.index for g in node.gpus}
        for s in sorted(snap.slots, key=lambda s: (s.model, s.gpus, s.slot_id)):
            if s.state == "active":
                continue
            if not set(s.gpus) <= valid or not s.gpus:
                orphan_slots.append((name, s, "slot names GPUs the agent does not report"))
            elif s.state == "failed":
                orphan_slots.append((name, s, "loading failed"))
            elif (own := ownership(s.model, s.owner, models, owners, live)) != Ownership.MINE:
                if own == Ownership.ORPHAN:
                    orphan_slots.append((name, s, "no ModelDeployment owns this slot"))
            elif (name, s.model, s.gpus) in slot_of:
                orphan_slots.append((name, s, "duplicate slot of the same model on the same GPUs"))
            else:
                slot_of[(name, s.model, s.gpus)] = s.slot_id
        for inst in snap.instances:
            own = ownership(inst.model, inst.owner, models, owners, live)
            if own == Ownership.FOREIGN and set(inst.gpus) <= valid and inst.gpus:
                continue
            if own == Ownership.ORPHAN or not set(inst.gpus) <= valid or not inst.gpus:
                orphan_instances.append((name, inst))
                continue
            instances.append(
                Instance(
                    model=inst.model,
                    node=name,
                    gpus=inst.gpus,
                    running=inst.running,
                    kv_capacity_bytes=inst.kv_capacity_bytes,
                    kv_used_bytes=min(inst.kv_used_bytes, inst.kv_capacity_bytes),
                    phase=inst.phase,
                    name=inst.instance_id,
                )
            )
    by_model: dict[str, int] = {}
    for (node_name, model, gpus), slot_id in sorted(slot_of.items()):
        snap = snaps[node_name]
        slot = snap.slot(slot_id)
        assert slot is not None
        rank = by_model.get(model, 0)
        by_model[model] = rank + 1
        replicas.append(
            Replica(
                model=model,
                kind=ReplicaKind.BASIC,
                rank=rank,
                score=0.0,
                node=node_name,
                gpus=gpus,
                bytes_per_gpu=slot.target_bytes_per_gpu,
                layers_resident=slot.layers_resident or None,
            )
        )
    node_names = {n.name for n in nodes}
    for p in pending_prewarms:
        if p.node in node_names and p.model in models and (p.node, p.model, p.gpus) not in slot_of:
            rank = by_model.get(p.model, 0)
            by_model[p.model] = rank + 1
            replicas.append(
                Replica(p.model, ReplicaKind.BASIC, rank, 0.0, p.node, p.gpus, p.bytes_per_gpu)
            )
    busy = {(i.node, g) for i in instances for g in i.gpus}
    for p in pending_starts:
        if (
            p.node in node_names
            and p.model in models
            and not any((p.node, g) in busy for g in p.gpus)
        ):
            instances.append(
                Instance(
                    p.model,
                    p.node,
                    p.gpus,
                    phase=InstancePhase.STARTING,
                    name=f"pending:{p.node}:{gpus_str(p.gpus)}",
                )
            )
    state = ClusterState(
        nodes=tuple(nodes),
        models=dict(models),
        replicas=tuple(replicas),
        instances=tuple(instances),
        forecasts={m: f for m, f in forecasts.items() if m in models},
    )
    return Built(
        state,
        slot_of,
        tuple(orphan_slots),
        tuple(orphan_instances),
        dict(snaps),
        dict(owners or {}),
    )


def _rid(built: Built, verb: str, model: str, node: str, subject: str) -> str:
    snap = built.snaps.get(node)
    return request_id(
        verb, model, node, subject, snap.agent_id if snap else "", snap.generation if snap else 0
    )


def window_actions(built: Built, *, evict_aware: bool = True) -> tuple[PrewarmPlan, list[Action]]:
    """Algorithm 1 for this window, as agent calls: evictions first, then new prewarms."""
    plan = plan_prewarm(built.state, evict_aware=evict_aware)
    actions: list[Action] = []
    for r in plan.evict:
        slot_id = built.slot_of.get((r.node, r.model, r.gpus))
        if slot_id is None:
            continue  # an in-flight prewarm the agent does not report yet
        actions.append(
            Evict(
                r.node,
                r.model,
                slot_id,
                r.gpus,
                "the forecast no longer asks for this replica",
                _rid(built, "evict", r.model, r.node, slot_id),
            )
        )
    for r in plan.place:
        spec = built.state.models[r.model]
        layers = (
            spec.prewarm_layers
            if spec.prewarm_layers and spec.prewarm_layers < spec.num_layers
            else 0
        )
        actions.append(
            Prewarm(
                r.node,
                r.model,
                r.gpus,
                layers,
                r.kind,
                r.rank,
                r.score,
                _rid(built, "prewarm", r.model, r.node, gpus_str(r.gpus)),
                built.owners.get(r.model, ""),
            )
        )
    return plan, actions


def drain_actions(
    node: str,
    snap: NodeSnapshot | None,
    inst: InstanceView,
    reason: str,
    now_s: float,
    grace_started_s: Mapping[str, float],
    max_grace_s: float,
) -> list[Action]:
    """Remove an instance the way the agent allows: serving -> BeginGrace; grace -> EndInstance
    (evicting its weights) once no request is left or ``max_grace_s`` has passed since its grace
    began (the agent's ``grace_started_unix``, else when this operator first saw it in grace);
    starting -> nothing yet (the next poll sees it serving)."""
    agent_id, gen = (snap.agent_id, snap.generation) if snap else ("", 0)
    if inst.phase == InstancePhase.SERVING:
        rid = request_id("grace", inst.model, node, inst.instance_id, agent_id, gen)
        return [BeginGrace(node, inst.model, inst.instance_id, rid)]
    if inst.phase != InstancePhase.GRACE:
        return []
    started = inst.grace_started_unix or grace_started_s.get(inst.instance_id, now_s)
    if inst.load > 0 and now_s - started < max_grace_s:
        return []
    rid = request_id("end", inst.model, node, inst.instance_id, agent_id, gen)
    return [EndInstance(node, inst.model, inst.instance_id, True, reason, rid)]


def orphan_actions(
    built: Built,
    now_s: float = 0.0,
    grace_started_s: Mapping[str, float] | None = None,
    max_grace_s: float = 0.0,
) -> list[Action]:
    """Remove what no ModelDeployment owns (deleted while the operator was away, failed loads);
    instances drain through grace (:func:`drain_actions`)."""
    out: list[Action] = []
    for node, s, reason in built.orphan_slots:
        out.append(
            Evict(
                node,
                s.model,
                s.slot_id,
                s.gpus,
                reason,
                _rid(built, "evict", s.model, node, s.slot_id),
            )
        )
    for node, inst in built.orphan_instances:
        out += drain_actions(
            node,
            built.snaps.get(node),
            inst,
            "no ModelDeployment owns this instance",
            now_s,
            grace_started_s or {},
            max_grace_s,
        )
    return out


@dataclass(frozen=True)
class Scaling:
    actions: list[Action]
    decisions: dict[str, ScaleDecision]
    memory: dict[str, ScaleMemory]
    no_capacity: dict[str, str]
    state: ClusterState


def _start(
    state: ClusterState, node: str, gpus: tuple[int, ...], model: str, removed: Iterable[Replica]
) -> ClusterState:
    """The snapshot after starting ``model`` on ``gpus``: replicas there gone, GPUs dedicated."""
    gone = set(removed)
    replicas = tuple(r for r in state.replicas if r not in gone)
    nodes = []
    for n in state.nodes:
        if n.name != node:
            nodes.append(n)
            continue
        nodes.append(
            replace(
                n,
                gpus=tuple(
                    replace(g, state=WorkerState.DEDICATED, free_bytes=0) if g.index in gpus else g
                    for g in n.gpus
                ),
            )
        )
    inst = Instance(
        model, node, gpus, phase=InstancePhase.STARTING, name=f"new:{node}:{gpus_str(gpus)}"
    )
    return replace(state, nodes=tuple(nodes), replicas=replicas, instances=(*state.instances, inst))


def scaling_actions(
    built: Built,
    loads: Mapping[str, float],
    bounds: Mapping[str, tuple[int, int]],
    config: AutoscalerConfig,
    now_s: float,
    memory: Mapping[str, ScaleMemory],
    grace_started_s: Mapping[str, float],
) -> Scaling:
    """Autoscaler decisions and the agent calls that carry them out.

    ``bounds``: model -> (minInstances, maxInstances) from its ModelDeployment.
    """
    state = built.state
    actions: list[Action] = []
    decisions: dict[str, ScaleDecision] = {}
    new_memory: dict[str, ScaleMemory] = {}
    no_capacity: dict[str, str] = {}
    for model in sorted(state.models):
        spec = state.models[model]
        lo, hi = bounds.get(model, (0, 0))
        d = decide(
            spec,
            float(loads.get(model, 0.0)),
            [i for i in state.instances if i.model == model],
            config,
            now_s,
            memory.get(model),
            grace_started_s=dict(grace_started_s),
            min_instances=lo,
            max_instances=hi,
        )
        decisions[model] = d
        new_memory[model] = d.memory
        for _ in range(d.scale_up):
            choice = choose_start(state, model)
            if isinstance(choice, NoCapacity):
                no_capacity[model] = choice.reason
                break
            slot_id = built.slot_of.get((choice.node, model, choice.gpus), "") if choice.hit else ""
            evicts = tuple(
                sid
                for r in choice.evicts
                if (sid := built.slot_of.get((r.node, r.model, r.gpus))) is not None
            )
            actions.append(
                Activate(
                    choice.node,
                    model,
                    choice.gpus,
                    slot_id,
                    choice.hit and bool(slot_id),
                    evicts,
                    _rid(built, "activate", model, choice.node, gpus_str(choice.gpus)),
                    built.owners.get(model, ""),
                )
            )
            removed = [*choice.evicts, *([choice.replica] if choice.replica else [])]
            state = _start(state, choice.node, choice.gpus, model, removed)
        for inst in d.drain:
            if inst.name.startswith(("pending:", "new:")):
                continue
            actions.append(
                BeginGrace(
                    inst.node, model, inst.name, _rid(built, "grace", model, inst.node, inst.name)
                )
            )
        for inst in d.grace_ended:
            actions.append(
                EndInstance(
                    inst.node,
                    model,
                    inst.name,
                    False,
                    "grace period over",
                    _rid(built, "end", model, inst.node, inst.name),
                )
            )
    return Scaling(actions, decisions, new_memory, no_capacity, state)


def teardown_actions(
    owner: str,
    snaps: Mapping[str, NodeSnapshot],
    now_s: float,
    grace_started_s: Mapping[str, float],
    max_grace_s: float,
) -> tuple[list[Action], list[str]]:
    """What deleting the deployment with UID ``owner`` must do now, and what is left after it.

    Only slots and instances the agents recorded with this owner are touched (never by model
    name: a duplicate deployment owns nothing).  Instances drain through grace
    (:func:`drain_actions`); the second list names everything still present, for the
    finalizer's "waiting for ..." message.
    """
    out: list[Action] = []
    left: list[str] = []
    if not owner:
        return out, left
    for name in sorted(snaps):
        snap = snaps[name]
        for inst in snap.instances:
            if inst.owner != owner:
                continue
            acts = drain_actions(
                name, snap, inst, "ModelDeployment deleted", now_s, grace_started_s, max_grace_s
            )
            out += acts
            left.append(
                f"instance {inst.instance_id} of {inst.model} on {name} ({inst.phase.value}, "
                f"{inst.load} request(s) in flight)"
            )
        for s in snap.slots:
            if s.owner == owner and s.state != "active":
                out.append(
                    Evict(
                        name,
                        s.model,
                        s.slot_id,
                        s.gpus,
                        "ModelDeployment deleted",
                        request_id(
                            "evict", s.model, name, s.slot_id, snap.agent_id, snap.generation
                        ),
                    )
                )
                left.append(f"slot {s.slot_id} of {s.model} on {name}")
    return out, left
