"""The one rule from observed facts to the policy's :class:`~warmserve.policy.cluster.ClusterState`.

Every executor builds its snapshot here, so free memory, worker states and Eq. 1 are computed
once (issue 11: they used to be computed in the simulator, the scenario reader and the operator,
three slightly different ways).

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

from .observation import InstanceObs, Observation

ReplicaKey = tuple[str, str, GpuSet]  # (model, node, gpus)
ReplicaMeta = tuple[ReplicaKind, int, float]  # kind, rank, score


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
) -> ClusterState:
    """The policy snapshot of ``obs`` for the managed ``models`` (module docstring)."""
    meta = meta or {}
    slot_bytes: dict[tuple[str, int], int] = defaultdict(int)
    for s in obs.slots:
        for g in s.gpus:
            slot_bytes[(s.node, g)] += s.bytes_per_gpu
    holder: dict[tuple[str, int], InstanceObs] = {}
    for inst in obs.instances:
        for g in inst.gpus:
            holder[(inst.node, g)] = inst
    by_node: dict[str, list[GPU]] = defaultdict(list)
    for g in sorted(obs.gpus, key=lambda g: (g.node, g.index)):
        key = (g.node, g.index)
        inst = holder.get(key)
        if inst is not None:
            state = (
                WorkerState.GRACE if inst.phase == InstancePhase.GRACE else WorkerState.DEDICATED
            )
        else:
            state = WorkerState.UNIVERSAL if key in slot_bytes else WorkerState.IDLE
        lend = (
            instance_lendable_per_gpu(inst, models.get(inst.model))
            if proactive and inst is not None
            else 0
        )
        free = gpu_free_bytes(g.memory_bytes, state, slot_bytes.get(key, 0), lend, g.reported_free)
        by_node[g.node].append(GPU(g.index, g.memory_bytes, free, state))
    nodes = tuple(Node(name, tuple(gpus)) for name, gpus in sorted(by_node.items()))
    return ClusterState(
        nodes=nodes,
        models=dict(models),
        replicas=_replicas(obs, models, meta),
        instances=tuple(
            policy_instance(i) for i in obs.instances if not i.foreign and i.model in models
        ),
        forecasts={m: f for m, f in forecasts.items() if m in models},
    )


def _replicas(
    obs: Observation, models: Mapping[str, ModelSpec], meta: Mapping[ReplicaKey, ReplicaMeta]
) -> tuple[Replica, ...]:
    known: list[tuple[ReplicaMeta, Replica]] = []
    unknown: list[Replica] = []
    for s in sorted(obs.slots, key=lambda s: (s.model, s.node, s.gpus, s.id)):
        if s.foreign or s.model not in models:
            continue
        layers = s.layers_resident
        r = Replica(s.model, ReplicaKind.BASIC, 0, 0.0, s.node, s.gpus, s.bytes_per_gpu, layers)
        m = meta.get((s.model, s.node, s.gpus)) or s.priority
        if m is None:
            unknown.append(r)
        else:
            known.append((m, replace(r, kind=m[0], rank=m[1], score=m[2])))
    out = [r for _m, r in known]
    next_rank: dict[str, int] = defaultdict(int)
    for r in out:
        if r.kind == ReplicaKind.BASIC:
            next_rank[r.model] = max(next_rank[r.model], r.rank + 1)
    for r in unknown:
        out.append(replace(r, rank=next_rank[r.model]))
        next_rank[r.model] += 1
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
