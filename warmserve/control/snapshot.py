"""The one rule from observed facts to the policy's :class:`~warmserve.policy.cluster.ClusterState`.

Every executor builds its snapshot here, so free memory, worker states and Eq. 1 are computed
once, the same way for every executor.

Worker state (paper Figure 5), per GPU: held by an instance — ``grace`` if the instance is in
its grace period, else ``dedicated``; otherwise ``universal`` if any slot holds weights on it,
else ``idle``.

Free bytes (what a new prewarm replica may use now, ``GPU.free_bytes``):

* ``dedicated``: 0 — a serving instance owns the GPU;
* ``idle`` / ``universal``: capacity minus the bytes of every slot on the GPU (at their loaded
  size, so a slot still loading is counted in full);
* ``grace``: the instance's Eq. 1 lendable memory per GPU
  (:func:`lendable_per_gpu`, whole pages) minus the slots already lent memory there — when
  proactive prewarming is on; otherwise 0;
* clamped to ``[0, capacity]``, and never above what the runtime reports (``GpuObs.reported_free``:
  an agent's page accounting knows about memory the facts do not show).

Replica identity: resident slots of managed models become :class:`~warmserve.policy.cluster.Replica`
objects with the kind, rank and score the controller assigned when it last planned them
(``meta``); a slot the controller never planned (after a restart, or placed by hand) enters as
a basic replica ranked after the known ones, with score 0, and the next plan re-scores it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache

from warmserve.policy.autoscaler import lendable_per_gpu
from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    GpuSet,
    Instance,
    InstancePhase,
    LoadForecast,
    ModelSpec,
    Node,
    Replica,
    ReplicaKind,
    WorkerState,
)
from warmserve.policy.start_choice import StartChoice

from .observation import GpuObs, InstanceObs, Observation

ReplicaKey = tuple[str, str, GpuSet]  # (model, node, gpus)
ReplicaMeta = tuple[ReplicaKind, int, float]  # kind, rank, score


@lru_cache(maxsize=8192)  # pure; asked for every instance at every decision
def instance_key(node: str, gpus: GpuSet) -> str:
    """The name an instance has in the policy: where it runs, not the executor's id (agents
    name instances randomly, the simulator by a counter), so tie-breaks by name decide alike
    in every executor and across restarts."""
    return f"{node}/{'.'.join(map(str, gpus))}"


def policy_instance(inst: InstanceObs) -> Instance:
    """The policy's view of an observed instance (R, M, K of Eq. 1; phase; identity)."""
    cap = max(inst.kv_capacity_bytes, 0)
    return Instance(
        inst.model,
        inst.node,
        inst.gpus,
        running=max(inst.running, 0),
        kv_capacity_bytes=cap,
        kv_used_bytes=min(max(inst.kv_used_bytes, 0), cap),
        phase=inst.phase,
        name=instance_key(inst.node, inst.gpus),
    )


def instance_lendable_per_gpu(inst: InstanceObs, spec: ModelSpec | None) -> int:
    """Eq. 1 per GPU for a grace instance (0 for any other phase): the one Eq. 1 rule."""
    if inst.phase != InstancePhase.GRACE:
        return 0
    max_batch = spec.max_batch if spec is not None else inst.max_batch
    if max_batch < 1:
        return 0  # nothing known about its batch size: lend nothing rather than guess
    probe = spec or ModelSpec(inst.model, 1, tp=len(inst.gpus), max_batch=max_batch)
    return lendable_per_gpu(policy_instance(inst), probe)


def gpu_free_bytes(
    memory: int, state: WorkerState, slot_bytes: int, lendable: int, reported: int | None
) -> int:
    """The free-bytes rule (module docstring)."""
    if state == WorkerState.DEDICATED:
        free = 0
    elif state == WorkerState.GRACE:
        free = lendable - slot_bytes
    else:
        free = memory - slot_bytes
    free = min(max(free, 0), memory)
    return free if reported is None else min(free, max(reported, 0))


def build_state(
    obs: Observation,
    models: Mapping[str, ModelSpec],
    forecasts: Mapping[str, LoadForecast],
    *,
    meta: Mapping[ReplicaKey, ReplicaMeta] | None = None,
    proactive: bool = True,
    memo: SnapshotMemo | None = None,
) -> ClusterState:
    """The policy snapshot of ``obs`` for the managed ``models`` (module docstring).

    ``memo``: reuse, across calls, the parts of the snapshot whose facts did not change
    (:class:`SnapshotMemo`; the result is the same with or without one)."""
    meta = meta or {}
    memo = memo if memo is not None else SnapshotMemo()
    instances = []
    known = memo.instances
    seen: dict[InstanceObs, Instance] = {}
    for i in obs.instances:
        if not i.foreign and i.model in models:
            p = known.get(i)
            if p is None:
                p = policy_instance(i)
            seen[i] = p
            instances.append(p)
    memo.instances = seen
    return ClusterState(
        nodes=_nodes(obs, models, proactive, memo),
        models=dict(models),
        replicas=_replicas(obs, models, meta, memo),
        instances=tuple(instances),
        forecasts={m: f for m, f in forecasts.items() if m in models},
    )


class SnapshotMemo:
    """What :func:`build_state` may reuse from its previous call by one executor (a
    controller's): each node's :class:`~warmserve.policy.cluster.Node`, keyed on the facts it is
    computed from (the node's GPUs, the slots and the instances on it — a grace instance in
    full, with its model's spec, since Eq. 1 reads its load); each observed instance's policy
    view; each slot's replica, keyed on its facts and its kind, rank and score.  A cluster of
    1,024 GPUs changes a few nodes between two polls, and rebuilding every GPU was most of a
    poll's cost.  Pure memoisation: only equal immutable inputs map to the
    stored immutable outputs, and only last call's entries are kept."""

    def __init__(self) -> None:
        self.gpus: tuple[GpuObs, ...] | None = None
        self.gpus_by_node: dict[str, tuple[GpuObs, ...]] = {}
        self.nodes: dict[str, tuple[tuple[object, ...], Node]] = {}
        self.instances: dict[InstanceObs, Instance] = {}
        self.replicas: dict[tuple[object, ...], Replica] = {}

    def group_gpus(self, gpus: tuple[GpuObs, ...]) -> dict[str, tuple[GpuObs, ...]]:
        """``gpus`` per node, each sorted by index (regrouped only when ``gpus`` changes)."""
        if self.gpus is not gpus and self.gpus != gpus:
            by_node: dict[str, list[GpuObs]] = defaultdict(list)
            for g in sorted(gpus, key=lambda g: (g.node, g.index)):
                by_node[g.node].append(g)
            self.gpus_by_node = {n: tuple(gs) for n, gs in sorted(by_node.items())}
            self.nodes = {}
        self.gpus = gpus
        return self.gpus_by_node


def _nodes(
    obs: Observation, models: Mapping[str, ModelSpec], proactive: bool, memo: SnapshotMemo
) -> tuple[Node, ...]:
    """Each node's GPUs with their worker state and free bytes (the module docstring's rules)."""
    slots_on: dict[str, list[tuple[GpuSet, int]]] = defaultdict(list)
    for s in obs.slots:
        slots_on[s.node].append((s.gpus, s.bytes_per_gpu))
    insts_on: dict[str, list[tuple[GpuSet, InstanceObs | None, ModelSpec | None]]]
    insts_on = defaultdict(list)
    for inst in obs.instances:
        if inst.phase == InstancePhase.GRACE:
            # Eq. 1 reads a grace instance's facts and its model's spec
            spec = models.get(inst.model) if proactive else None
            insts_on[inst.node].append((inst.gpus, inst, spec))
        else:
            insts_on[inst.node].append((inst.gpus, None, None))
    out = []
    for name, gpus in memo.group_gpus(obs.gpus).items():
        key = (proactive, tuple(slots_on.get(name, ())), tuple(insts_on.get(name, ())))
        hit = memo.nodes.get(name)
        if hit is not None and hit[0] == key:
            out.append(hit[1])
            continue
        node = _node(name, gpus, key[1], key[2], proactive)
        memo.nodes[name] = (key, node)
        out.append(node)
    return tuple(out)


def _node(
    name: str,
    gpus: tuple[GpuObs, ...],
    slots: tuple[tuple[GpuSet, int], ...],
    insts: tuple[tuple[GpuSet, InstanceObs | None, ModelSpec | None], ...],
    proactive: bool,
) -> Node:
    slot_bytes: dict[int, int] = defaultdict(int)
    for sgpus, b in slots:
        for g in sgpus:
            slot_bytes[g] += b
    # the last instance on a GPU holds it; (gpus, grace instance or None, its spec)
    holder: dict[int, tuple[InstanceObs | None, ModelSpec | None]] = {}
    for igpus, grace, spec in insts:
        for g in igpus:
            holder[g] = (grace, spec)
    out = []
    for g in gpus:
        held = holder.get(g.index)
        lend = 0
        if held is not None:
            grace, spec = held
            state = WorkerState.GRACE if grace is not None else WorkerState.DEDICATED
            if proactive and grace is not None:
                lend = instance_lendable_per_gpu(grace, spec)
        else:
            state = WorkerState.UNIVERSAL if g.index in slot_bytes else WorkerState.IDLE
        free = gpu_free_bytes(
            g.memory_bytes, state, slot_bytes.get(g.index, 0), lend, g.reported_free
        )
        out.append(GPU(g.index, g.memory_bytes, free, state))
    return Node(name, tuple(out))


def _replicas(
    obs: Observation,
    models: Mapping[str, ModelSpec],
    meta: Mapping[ReplicaKey, ReplicaMeta],
    memo: SnapshotMemo,
) -> tuple[Replica, ...]:
    known: list[tuple[ReplicaMeta, Replica]] = []
    unknown: list[Replica] = []
    cached = memo.replicas
    seen: dict[tuple[object, ...], Replica] = {}
    for s in sorted(obs.slots, key=lambda s: (s.model, s.node, s.gpus, s.id)):
        if s.foreign or s.model not in models:
            continue
        layers = s.layers_resident
        m = meta.get((s.model, s.node, s.gpus)) or s.priority
        key = (s.model, s.node, s.gpus, s.bytes_per_gpu, layers, m)
        r = cached.get(key)
        if r is None:
            r = Replica(
                s.model, ReplicaKind.BASIC, 0, 0.0, s.node, s.gpus, s.bytes_per_gpu, layers
            )
            if m is not None:
                r = replace(r, kind=m[0], rank=m[1], score=m[2])
        seen[key] = r
        if m is None:
            unknown.append(r)
        else:
            known.append((m, r))
    out = [r for _m, r in known]
    next_rank: dict[str, int] = defaultdict(int)
    for r in out:
        if r.kind == ReplicaKind.BASIC:
            next_rank[r.model] = max(next_rank[r.model], r.rank + 1)
    for r in unknown:
        out.append(replace(r, rank=next_rank[r.model]))
        next_rank[r.model] += 1
    memo.replicas = seen
    return tuple(out)


def apply_start(state: ClusterState, choice: StartChoice, name: str) -> ClusterState:
    """The snapshot after starting ``choice``: its replica and evicted replicas gone, its GPUs
    dedicated with nothing free, a starting instance called ``name`` on them."""
    gone = set(choice.evicts) | ({choice.replica} if choice.replica is not None else set())
    nodes = tuple(
        n
        if n.name != choice.node
        else replace(
            n,
            gpus=tuple(
                replace(g, state=WorkerState.DEDICATED, free_bytes=0)
                if g.index in choice.gpus
                else g
                for g in n.gpus
            ),
        )
        for n in state.nodes
    )
    inst = Instance(
        choice.model,
        choice.node,
        choice.gpus,
        phase=InstancePhase.STARTING,
        name=name or instance_key(choice.node, choice.gpus),
    )
    return replace(
        state,
        nodes=nodes,
        replicas=tuple(r for r in state.replicas if r not in gone),
        instances=(*state.instances, inst),
    )
