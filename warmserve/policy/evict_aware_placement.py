"""Evict-aware nested prewarm placement (WarmServe §5.2, Algorithm 1).

:func:`plan_prewarm` decides which prewarm replicas to keep, load and evict for the next window,
as a pure function of a :class:`~warmserve.policy.cluster.ClusterState`; :func:`apply_plan`
advances a snapshot by a plan.  The GPU groups considered and the nesting check live in
:mod:`warmserve.policy.gpu_groups`; where an instance starts is
:mod:`warmserve.policy.start_choice`.

Algorithm 1, as implemented
---------------------------
Replica requests come from :mod:`warmserve.policy.scoring` (Eq. 5-8) and are processed in
:func:`~warmserve.policy.scoring.priority_key` order: **basic before burst regardless of score**,
then score descending, then model name and rank (determinism).  For each replica of a model with
weight S and tensor-parallel degree D:

1. *Candidate workers*: GPUs whose state is idle, universal or grace and which no serving or
   starting instance holds.  Dedicated GPUs are never candidates; grace GPUs offer only their
   lendable memory (``GPU.free_bytes``, computed by the caller with Eq. 1, see
   :mod:`warmserve.policy.proactive`).
2. *Demand*: D GPUs on one node, each with ``ModelSpec.prewarm_bytes_per_gpu`` free (S/D, or the
   first layers' share when only the first layers are prewarmed, paper §4).
3. *Valid groups*: the group's GPU set must be disjoint from or nested with (subset or superset
   of) the GPU set of **every** replica and **every** instance on the node — never a partial
   overlap.  This is checked exactly, with bit masks, against all sets present.  A group may
   also not intersect a replica or an instance of the **same** model: starting one would evict
   the other, so a second copy there would never add a warm start.  Which groups are enumerated
   (aligned buddy blocks, and why that is enough) is in :mod:`warmserve.policy.gpu_groups`.
4. *Selection* (the paper's rule): let the *nested replicas* of a group be the replicas whose
   GPUs intersect it (all of them would be evicted if an instance started there).  Among valid
   groups whose nested replicas all have a **lower priority** than the new one — priority is the
   ``(kind, score)`` order of ``priority_key``, so a basic replica outranks every burst replica
   even when the burst one's raw score is larger — take the one with the least *sum of raw
   scores* of nested replicas; if there is none, the least sum over all valid groups.  Ties break
   by node name, then the group's lowest GPU index.
5. Reduce the free memory of the chosen GPUs and record the replica (it constrains later ones).

Existing replicas
-----------------
(:mod:`warmserve.policy.replica_match`, incremental with a ``MatchMemo``.)  Per model, the
replicas already resident (``state.replicas``) are matched to the replicas the forecast asks for:
the existing ones, in (kind, rank, node, gpus) order, take the identity of the highest-priority
requests (basic rank 0 first) and are **kept** in place with their new kind, rank and score;
only the remaining requests are placed.  Resident replicas no longer wanted (the model asks for
fewer, the degree changed, or a serving instance now holds one of their GPUs) are listed in
``evict`` and their memory is counted as free for this plan: the plan describes the next
window's target (keep + place).  When an executor actually evicts is the control layer's rule
(:mod:`warmserve.control.controller`): a replica in ``evict`` whose GPUs no new replica needs
stays resident at the lowest priority until a start or a later placement wants them (measured
better than evicting at once; ``docs/policy.md``, "The control loop").

Ablation (``evict_aware=False``)
--------------------------------
§7.5 disables "evict-aware model placement" and keeps everything else.  We read that as: the
same replicas (counts, scores, order) and the same candidate workers and memory limits, but no
nesting rule and no score-aware selection — each replica goes first-fit to the first node (by
name) with D candidate GPUs that have enough free memory, lowest GPU indices first.  Replicas can
then partially overlap, which is exactly the interference §2.3 describes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from warmserve.policy.cluster import (
    ClusterState,
    GpuSet,
    ModelSpec,
    Replica,
    ReplicaKind,
    WorkerState,
)
from warmserve.policy.gpu_groups import (
    NO_KIND,
    NodeSlots,
    Occupant,
    busy_gpus,
    positions_mask,
    replica_priority,
)
from warmserve.policy.replica_match import MatchMemo, match_existing
from warmserve.policy.scoring import ReplicaRequest

__all__ = ["PrewarmPlan", "Unplaced", "apply_plan", "plan_prewarm"]


@dataclass(frozen=True, slots=True)
class Unplaced:
    """A requested replica the plan could not place, and why."""

    model: str
    kind: ReplicaKind
    rank: int
    score: float
    reason: str


@dataclass(frozen=True, slots=True)
class PrewarmPlan:
    """The outcome of :func:`plan_prewarm`.

    ``keep``: resident replicas still wanted, re-scored (new kind/rank/score, same GPUs).
    ``place``: new replicas to load (``bytes_per_gpu`` set; ``layers_resident`` = the model's
    prewarm layers).  ``evict``: resident replicas no longer wanted, exactly as given in the
    snapshot.  ``unplaced``: requests that found no valid group, with a reason.
    """

    keep: tuple[Replica, ...]
    place: tuple[Replica, ...]
    evict: tuple[Replica, ...]
    unplaced: tuple[Unplaced, ...]

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The target set of resident replicas after the plan: keep + place."""
        return self.keep + self.place

    @property
    def requested(self) -> int:
        return len(self.keep) + len(self.place) + len(self.unplaced)


class _DegreeIndex:
    """All groups of one degree across the cluster, in flat arrays for vectorised selection."""

    def __init__(self, degree: int, nodes: Sequence[NodeSlots]) -> None:
        self.degree = degree
        self.node_of: list[int] = []
        self.masks: list[int] = []
        self.offset: dict[int, tuple[int, int]] = {}
        for i, ns in enumerate(nodes):
            gs = ns.groups(degree)
            self.offset[i] = (len(self.masks), len(gs))
            self.masks += gs
            self.node_of += [i] * len(gs)
        size = len(self.masks)
        self.valid = np.zeros(size, dtype=bool)
        self.minfree = np.zeros(size, dtype=np.int64)
        self.hkind = np.full(size, NO_KIND, dtype=np.int8)
        self.hscore = np.full(size, -1.0)
        self.total = np.zeros(size)
        for i, ns in enumerate(nodes):
            self.refresh(i, ns)

    def refresh(self, i: int, ns: NodeSlots) -> None:
        start, count = self.offset[i]
        for k in range(start, start + count):
            ok, mf, hk, hs, tot = ns.evaluate(self.masks[k])
            self.valid[k] = ok
            self.minfree[k] = mf
            self.hkind[k] = hk
            self.hscore[k] = hs
            self.total[k] = tot

    def select(
        self, need: int, prio: tuple[int, float], same_model: Sequence[tuple[int, int]] = ()
    ) -> int | str:
        """Index of the chosen group, or the reason none fits.

        ``same_model``: (node slot, mask) of replicas and instances of the same model; groups
        intersecting them are excluded (two replicas of one model on shared GPUs can never both
        start, so the second would be worthless).
        """
        if not len(self.masks):
            return f"no node has {self.degree} GPUs for a tensor-parallel degree {self.degree}"
        if not self.valid.any():
            return (
                f"no group of {self.degree} idle/universal/grace GPUs on one node avoids a partial "
                "overlap with resident replicas or instances"
            )
        fits = self.valid & (self.minfree >= need)
        if not fits.any():
            most = int(self.minfree[self.valid].max())
            return (
                f"no valid group of {self.degree} GPUs has {need} bytes free on each GPU "
                f"(most free on a valid group: {most} bytes)"
            )
        for i, m in same_model:
            start, count = self.offset[i]
            for k in range(start, start + count):
                if self.masks[k] & m:
                    fits[k] = False
        if not fits.any():
            return (
                f"every valid group of {self.degree} GPUs with {need} bytes free per GPU "
                "already holds a replica or instance of this model"
            )
        kind, score = prio
        lower = fits & ((self.hkind > kind) | ((self.hkind == kind) & (self.hscore < score)))
        pool = lower if lower.any() else fits
        return int(np.argmin(np.where(pool, self.total, np.inf)))


def _build_nodes(  # busy: busy_gpus(state, include_grace=False), as plan_prewarm has it
    state: ClusterState, keep: Sequence[Replica], evict: Sequence[Replica],
    busy: Mapping[str, set[int]],
) -> tuple[list[NodeSlots], dict[str, int]]:
    nodes = sorted(state.nodes, key=lambda n: n.name)
    slots = [NodeSlots(n, i, busy.get(n.name, set())) for i, n in enumerate(nodes)]
    at = {ns.name: i for i, ns in enumerate(slots)}
    for r in evict:  # their memory is free for this plan
        ns = slots[at[r.node]]
        b = r.bytes_per_gpu or state.models[r.model].prewarm_bytes_per_gpu
        for g in r.gpus:
            p = ns.pos[g]
            ns.free[p] = min(ns.free[p] + b, ns.memory[p])
    for inst in state.instances:
        ns = slots[at[inst.node]]
        m = ns.masks.get(inst.gpus) or ns.mask_of(inst.gpus)  # the cached answer, else computed
        ns.occupants.append(Occupant(m, None, 0.0, inst.model))
        ns.extra_masks.add(m)
    for r in keep:
        ns = slots[at[r.node]]
        m = ns.mask_of(r.gpus)
        ns.occupants.append(Occupant(m, replica_priority(r.kind, r.score), r.score, r.model))
        ns.extra_masks.add(m)
    return slots, at


def _new_replica(spec: ModelSpec, req: ReplicaRequest, node: str, gpus: GpuSet) -> Replica:
    return Replica(
        model=req.model,
        kind=req.kind,
        rank=req.rank,
        score=req.score,
        node=node,
        gpus=gpus,
        bytes_per_gpu=spec.prewarm_bytes_per_gpu,
        layers_resident=spec.resident_layers,
    )


def _unplaced(req: ReplicaRequest, reason: str) -> Unplaced:
    return Unplaced(req.model, req.kind, req.rank, req.score, reason)


def _same_model_masks(
    state: ClusterState, slots: Sequence[NodeSlots]
) -> dict[str, list[tuple[int, int]]]:
    """Per model, the (node slot, mask) of its kept replicas and its instances."""
    at = {ns.name: i for i, ns in enumerate(slots)}
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for ns in slots:
        for occ in ns.occupants:
            if occ.model:
                out[occ.model].append((at[ns.name], occ.mask))
    return out


def _place_evict_aware(
    state: ClusterState, slots: list[NodeSlots], todo: Sequence[ReplicaRequest]
) -> tuple[list[Replica], list[Unplaced]]:
    indexes: dict[int, _DegreeIndex] = {}
    degrees = sorted({state.models[r.model].tp for r in todo})
    for d in degrees:
        indexes[d] = _DegreeIndex(d, slots)
    placed: list[Replica] = []
    unplaced: list[Unplaced] = []
    same = _same_model_masks(state, slots)
    for req in todo:
        spec = state.models[req.model]
        need = spec.prewarm_bytes_per_gpu
        prio = replica_priority(req.kind, req.score)
        idx = indexes[spec.tp]
        k = idx.select(need, prio, same[req.model])
        if isinstance(k, str):
            unplaced.append(_unplaced(req, k))
            continue
        i = idx.node_of[k]
        ns = slots[i]
        mask = idx.masks[k]
        ns.place(mask, prio, req.score, need)
        same[req.model].append((i, mask))
        for other in indexes.values():
            other.refresh(i, ns)
        placed.append(_new_replica(spec, req, ns.name, ns.gpus_of(mask)))
    return placed, unplaced


def _place_first_fit(
    state: ClusterState, slots: list[NodeSlots], todo: Sequence[ReplicaRequest]
) -> tuple[list[Replica], list[Unplaced]]:
    placed: list[Replica] = []
    unplaced: list[Unplaced] = []
    same = _same_model_masks(state, slots)
    for req in todo:
        spec = state.models[req.model]
        need = spec.prewarm_bytes_per_gpu
        for i, ns in enumerate(slots):
            taken = 0
            for j, m in same[req.model]:
                if j == i:
                    taken |= m
            fit = [
                p
                for p in range(ns.n)
                if ns.candidate[p] and ns.free[p] >= need and not taken >> p & 1
            ]
            if len(fit) >= spec.tp:
                mask = positions_mask(fit[: spec.tp])
                ns.place(mask, replica_priority(req.kind, req.score), req.score, need)
                same[req.model].append((i, mask))
                placed.append(_new_replica(spec, req, ns.name, ns.gpus_of(mask)))
                break
        else:
            unplaced.append(
                _unplaced(req, f"no node has {spec.tp} candidate GPUs with {need} bytes free each")
            )
    return placed, unplaced


def plan_prewarm(
    state: ClusterState,
    *,
    evict_aware: bool = True,
    spare_replicas: int | Mapping[str, int] = 0,
    memo: MatchMemo | None = None,
) -> PrewarmPlan:
    """Plan the next window's prewarm replicas (Algorithm 1; see the module docstring).

    Deterministic: the same snapshot gives the same plan.  ``evict_aware=False`` is the §7.5
    ablation (first-fit, no nesting rule).  ``spare_replicas``: extra burst replicas per model
    beyond Eq. 6 (:mod:`warmserve.policy.scoring`), the same for every model or per model (a
    mapping; models not in it get none: :mod:`warmserve.policy.overshoot`).  ``memo``: the
    planner's :class:`~warmserve.policy.replica_match.MatchMemo` (reuses the match of the models
    whose inputs did not change since its last plan; the plan is the same with or without one).
    """
    busy = busy_gpus(state, include_grace=False)
    keep, evict, todo = match_existing(state, busy, spare_replicas, memo)
    if not todo:
        # nothing to place (most re-plans: the match kept every request): either placement
        # places and refuses nothing, so the nodes' working state is not needed
        return PrewarmPlan(tuple(keep), (), tuple(evict), ())
    slots, _ = _build_nodes(state, keep, evict, busy)
    if evict_aware:
        place, unplaced = _place_evict_aware(state, slots, todo)
    else:
        place, unplaced = _place_first_fit(state, slots, todo)
    return PrewarmPlan(tuple(keep), tuple(place), tuple(evict), tuple(unplaced))


def apply_plan(state: ClusterState, plan: PrewarmPlan) -> ClusterState:
    """The snapshot after executing ``plan``: evicted memory freed, new replicas' memory taken.

    GPUs that end up holding replicas and were idle become universal; universal GPUs left with
    no replica become idle.  Used by the simulator to advance its state; never mutates ``state``.
    """
    delta: dict[tuple[str, int], int] = defaultdict(int)
    for r in plan.evict:
        b = r.bytes_per_gpu or state.models[r.model].prewarm_bytes_per_gpu
        for g in r.gpus:
            delta[(r.node, g)] += b
    for r in plan.place:
        for g in r.gpus:
            delta[(r.node, g)] -= r.bytes_per_gpu
    holding = {(r.node, g) for r in plan.replicas for g in r.gpus}
    nodes = []
    for node in state.nodes:
        gpus = []
        for g in node.gpus:
            free = min(max(g.free_bytes + delta.get((node.name, g.index), 0), 0), g.memory_bytes)
            st = g.state
            if st in (WorkerState.IDLE, WorkerState.UNIVERSAL):
                st = WorkerState.UNIVERSAL if (node.name, g.index) in holding else WorkerState.IDLE
            gpus.append(replace(g, free_bytes=free, state=st))
        nodes.append(replace(node, gpus=tuple(gpus)))
    return replace(state, nodes=tuple(nodes), replicas=plan.replicas)
