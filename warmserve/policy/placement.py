"""Evict-aware prewarm placement (WarmServe §5.2, Algorithm 1) and instance start choice.

Two decisions live here, both pure functions of a :class:`~warmserve.policy.cluster.ClusterState`:

* :func:`plan_prewarm` — which prewarm replicas to keep, load and evict for the next window.
* :func:`choose_start` — where to start one more instance of a model: on a prewarmed replica
  (a *prewarm hit*) or on idle GPUs (a *cold start*), evicting as little score as possible.

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
   the other, so a second copy there would never add a warm start.
4. *Selection* (the paper's rule): let the *nested replicas* of a group be the replicas whose
   GPUs intersect it (all of them would be evicted if an instance started there).  Among valid
   groups whose nested replicas all have a **lower priority** than the new one — priority is the
   ``(kind, score)`` order of ``priority_key``, so a basic replica outranks every burst replica
   even when the burst one's raw score is larger — take the one with the least *sum of raw
   scores* of nested replicas; if there is none, the least sum over all valid groups.  Ties break
   by node name, then the group's lowest GPU index.
5. Reduce the free memory of the chosen GPUs and record the replica (it constrains later ones).

Group enumeration (the paper leaves it open)
--------------------------------------------
Per node, for degree D we consider the *aligned power-of-two blocks* of a buddy allocator: with
P = next_pow2(D), the groups are GPU positions ``[k·P, k·P + D)`` for every k with
``k·P + D <= n`` (positions are the node's GPUs sorted by index).  We add the exact GPU sets of
replicas and instances already on the node whose size is D (so a replica can nest exactly onto
an existing, possibly unaligned, group).

Why this is enough — and fast:

* Aligned power-of-two blocks form a *laminar* family (the buddy tree): any two are disjoint or
  nested.  Replicas we place on them therefore never partially overlap one another by
  construction; the exact check of step 3 is still run because existing replicas/instances may
  sit on arbitrary sets and because non-power-of-two degrees use a block prefix (two prefixes can
  partially overlap; the check then rejects the group).
* Nothing is lost for power-of-two degrees on identical GPUs: every valid (laminar) placement is
  a forest of sets with power-of-two sizes; packing each node's children in decreasing size
  order places every set on an aligned block (each offset is a sum of larger powers of two, hence
  a multiple of the set's size), so any laminar placement can be relabelled into an aligned one.
  With heterogeneous free memory the restriction is a heuristic — exactly as a buddy allocator.
* Size: a node of n GPUs has n/P groups per degree, at most 2n over all power-of-two degrees,
  instead of C(n, D) subsets (70 for n = 8, D = 4).  All groups of one degree across the cluster
  live in flat numpy arrays (min free bytes, highest nested priority, sum of nested scores); one
  replica is one vectorised mask + argmin over at most 1,024 entries, and placing it recomputes
  only its node's O(2n) groups.  1,024 GPUs × 500 models (~1,100 replicas) plan in under
  100 ms on one core (``bench/placement_bench.py``).

Non-power-of-two degrees (3, 5, 6, 7) are supported as the first D GPUs of an aligned block of
size next_pow2(D); a node whose GPU count leaves no such block (e.g. D = 3 on a 2-GPU node)
reports the replica unplaced with a reason.

Existing replicas
-----------------
Per model, the replicas already resident (``state.replicas``) are matched to the replicas the
forecast asks for: the existing ones, in (kind, rank, node, gpus) order, take the identity of the
highest-priority requests (basic rank 0 first) and are **kept** in place with their new kind,
rank and score; only the remaining requests are placed.  Resident replicas no longer wanted
(the model asks for fewer, the degree changed, or a serving instance now holds one of their GPUs)
are listed in ``evict`` and their memory is counted as free for this plan: the plan describes the
next window's target (keep + place): the plan counts the memory of ``evict`` as free.  When an
executor actually evicts is the control layer's rule (:mod:`warmserve.control.controller`): a
replica in ``evict`` whose GPUs no new replica needs stays resident at the lowest priority until
a start or a later placement wants them (measured better than evicting at once;
``docs/policy.md``, "The control loop").

Ablation (``evict_aware=False``)
--------------------------------
§7.5 disables "evict-aware model placement" and keeps everything else.  We read that as: the
same replicas (counts, scores, order) and the same candidate workers and memory limits, but no
nesting rule and no score-aware selection — each replica goes first-fit to the first node (by
name) with D candidate GPUs that have enough free memory, lowest GPU indices first.  Replicas can
then partially overlap, which is exactly the interference §2.3 describes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from warmserve.policy.cluster import (
    ClusterState,
    GpuSet,
    InstancePhase,
    ModelSpec,
    Node,
    PolicyInputError,
    Replica,
    ReplicaKind,
    WorkerState,
)
from warmserve.policy.scoring import ReplicaRequest, model_replicas, priority_key

__all__ = [
    "NoCapacity",
    "PrewarmPlan",
    "StartChoice",
    "Unplaced",
    "aligned_groups",
    "apply_plan",
    "choose_start",
    "evicted_by",
    "is_laminar",
    "plan_prewarm",
]

_KIND_RANK = {ReplicaKind.BASIC: 0, ReplicaKind.BURST: 1}
_NO_KIND = 2  # "no nested replica": lower than any real priority


# --------------------------------------------------------------------------- public types


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


@dataclass(frozen=True, slots=True)
class StartChoice:
    """Where to start one more instance of ``model``.

    ``hit`` is True when the instance starts on a prewarmed replica (``replica``); ``evicts``
    lists the other replicas whose GPUs intersect ``gpus`` and that the start evicts.
    """

    model: str
    node: str
    gpus: GpuSet
    hit: bool
    replica: Replica | None
    evicts: tuple[Replica, ...]

    @property
    def evicted_score(self) -> float:
        return math.fsum(r.score for r in self.evicts)


@dataclass(frozen=True, slots=True)
class NoCapacity:
    """No GPU group can host a new instance of ``model`` now; ``reason`` says why."""

    model: str
    reason: str


# --------------------------------------------------------------------------- helpers


def _unaligned_group(
    node: Node,
    spec: ModelSpec,
    replicas: Sequence[Replica],
    startable: Callable[[Node, Iterable[int]], bool],
) -> GpuSet | None:
    """D startable GPUs of ``node`` that fit S/D, preferring GPUs whose replicas score least.

    Greedy by the total score of the replicas touching each GPU (then GPU index).  Exact
    minimisation of the evicted score over all D-subsets is a set-cover-like problem; the
    greedy choice is optimal when no replica spans two of the candidate GPUs (TP-1 replicas,
    the common case on a fragmented node) and close otherwise.
    """
    free = [
        g.index
        for g in node.gpus
        if g.memory_bytes >= spec.bytes_per_gpu and startable(node, (g.index,))
    ]
    if len(free) < spec.tp:
        return None
    weight = {g: sum(r.score for r in replicas if g in r.gpus) for g in free}
    return tuple(sorted(sorted(free, key=lambda g: (weight[g], g))[: spec.tp]))


def _buddy_free(mask: int, free: int, degree: int, n: int) -> tuple[int, ...]:
    """Free GPUs left in each larger aligned block around ``mask`` (smallest block first):
    the buddy allocator's best fit — a start goes where the enclosing blocks are already most
    used, so that whole free blocks stay whole for wider models."""
    out = []
    size = _next_pow2(degree) * 2
    low = (mask & -mask).bit_length() - 1
    while size <= n:
        start = low // size * size
        block = ((1 << size) - 1) << start
        out.append(((free & ~mask) & block).bit_count())
        size *= 2
    return tuple(out)


def _next_pow2(d: int) -> int:
    return 1 << (d - 1).bit_length()


def aligned_groups(n_gpus: int, degree: int) -> list[tuple[int, ...]]:
    """Positions of the aligned buddy blocks for ``degree`` on a node of ``n_gpus`` GPUs.

    Each group is the first ``degree`` positions of an aligned block of size next_pow2(degree).
    Positions index the node's GPUs sorted by GPU index.
    """
    if degree < 1:
        raise PolicyInputError(f"degree must be >= 1, got {degree}")
    p = _next_pow2(degree)
    return [tuple(range(s, s + degree)) for s in range(0, n_gpus, p) if s + degree <= n_gpus]


def is_laminar(sets: Iterable[Iterable[int]]) -> bool:
    """True when every two sets are disjoint or nested (the §5.2 rule)."""
    fs = [frozenset(s) for s in sets]
    for i, a in enumerate(fs):
        for b in fs[i + 1 :]:
            inter = a & b
            if inter and inter != a and inter != b:
                return False
    return True


def _mask(positions: Iterable[int]) -> int:
    m = 0
    for p in positions:
        m |= 1 << p
    return m


def _compatible(a: int, b: int) -> bool:
    inter = a & b
    return inter == 0 or inter in (a, b)


def _priority(kind: ReplicaKind, score: float) -> tuple[int, float]:
    """(kind rank, score): lower kind rank wins, then higher score."""
    return (_KIND_RANK[kind], score)


def _higher(a: tuple[int, float], b: tuple[int, float]) -> bool:
    """True when priority ``a`` is strictly higher than ``b``."""
    return a[0] < b[0] or (a[0] == b[0] and a[1] > b[1])


def _busy_gpus(state: ClusterState, *, include_grace: bool) -> dict[str, set[int]]:
    """GPUs held by instances, per node (grace instances optionally)."""
    busy: dict[str, set[int]] = defaultdict(set)
    for inst in state.instances:
        if include_grace or inst.phase != InstancePhase.GRACE:
            busy[inst.node].update(inst.gpus)
    return busy


def evicted_by(replicas: Iterable[Replica], node: str, gpus: Iterable[int]) -> tuple[Replica, ...]:
    """The replicas on ``node`` whose GPUs intersect ``gpus`` (those a start there evicts)."""
    g = set(gpus)
    return tuple(r for r in replicas if r.node == node and g.intersection(r.gpus))


# --------------------------------------------------------------------------- placement engine


@dataclass(slots=True)
class _Occupant:
    mask: int
    prio: tuple[int, float] | None  # None for an instance
    score: float
    model: str = ""


class _NodeSlots:
    """Working state of one node during planning: free bytes, candidates, occupied sets."""

    def __init__(self, node: Node, order: int, busy: set[int]) -> None:
        self.name = node.name
        self.order = order
        gpus = sorted(node.gpus, key=lambda g: g.index)
        self.index = [g.index for g in gpus]
        self.pos = {g.index: p for p, g in enumerate(gpus)}
        self.memory = [g.memory_bytes for g in gpus]
        self.free = [g.free_bytes for g in gpus]
        self.candidate = [
            g.state in (WorkerState.IDLE, WorkerState.UNIVERSAL, WorkerState.GRACE)
            and g.index not in busy
            for g in gpus
        ]
        self.occupants: list[_Occupant] = []
        self.extra_masks: set[int] = set()

    @property
    def n(self) -> int:
        return len(self.index)

    def mask_of(self, gpus: Iterable[int]) -> int:
        return _mask(self.pos[g] for g in gpus)

    def gpus_of(self, mask: int) -> GpuSet:
        return tuple(self.index[p] for p in range(self.n) if mask >> p & 1)

    def groups(self, degree: int) -> list[int]:
        masks = {_mask(g) for g in aligned_groups(self.n, degree)}
        masks.update(m for m in self.extra_masks if m.bit_count() == degree)
        return sorted(masks, key=lambda m: ((m & -m).bit_length(), m))

    def evaluate(self, mask: int) -> tuple[bool, int, int, float, float]:
        """(valid, min free, highest nested kind rank, its score, sum of nested scores)."""
        positions = [p for p in range(self.n) if mask >> p & 1]
        if not all(self.candidate[p] for p in positions):
            return False, 0, _NO_KIND, -1.0, 0.0
        best: tuple[int, float] = (_NO_KIND, -1.0)
        total = 0.0
        for occ in self.occupants:
            if not occ.mask & mask:
                continue
            if not _compatible(occ.mask, mask):
                return False, 0, _NO_KIND, -1.0, 0.0
            if occ.prio is not None:
                total += occ.score
                if _higher(occ.prio, best):
                    best = occ.prio
        return True, min(self.free[p] for p in positions), best[0], best[1], total

    def place(self, mask: int, prio: tuple[int, float] | None, score: float, need: int) -> None:
        for p in range(self.n):
            if mask >> p & 1:
                self.free[p] -= need
        self.occupants.append(_Occupant(mask, prio, score))


class _DegreeIndex:
    """All groups of one degree across the cluster, in flat arrays for vectorised selection."""

    def __init__(self, degree: int, nodes: Sequence[_NodeSlots]) -> None:
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
        self.hkind = np.full(size, _NO_KIND, dtype=np.int8)
        self.hscore = np.full(size, -1.0)
        self.total = np.zeros(size)
        for i, ns in enumerate(nodes):
            self.refresh(i, ns)

    def refresh(self, i: int, ns: _NodeSlots) -> None:
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


def _stale(state: ClusterState, r: Replica, busy: dict[str, set[int]]) -> bool:
    spec = state.models[r.model]
    if len(r.gpus) != spec.tp or busy.get(r.node, set()).intersection(r.gpus):
        return True
    node = state.node(r.node)
    return any(node.gpu(g).state == WorkerState.DEDICATED for g in r.gpus)


def _match_existing(
    state: ClusterState, busy: dict[str, set[int]]
) -> tuple[list[Replica], list[Replica], list[ReplicaRequest]]:
    """Split resident replicas into keep/evict and return the requests still to place."""
    by_model: dict[str, list[Replica]] = defaultdict(list)
    for r in state.replicas:
        by_model[r.model].append(r)
    keep: list[Replica] = []
    evict: list[Replica] = []
    todo: list[ReplicaRequest] = []
    for name in sorted(set(state.models)):
        spec = state.models[name]
        fc = state.forecasts.get(name)
        wanted = model_replicas(spec, fc, state.active_instances(name)) if fc else []
        resident = sorted(
            by_model.get(name, []),
            key=lambda r: (_KIND_RANK[r.kind], r.rank, r.node, r.gpus),
        )
        usable = [r for r in resident if not _stale(state, r, busy)]
        evict += [r for r in resident if _stale(state, r, busy)]
        for req, r in zip(wanted, usable, strict=False):
            keep.append(
                replace(
                    r,
                    kind=req.kind,
                    rank=req.rank,
                    score=req.score,
                    bytes_per_gpu=r.bytes_per_gpu or spec.prewarm_bytes_per_gpu,
                )
            )
        evict += usable[len(wanted) :]
        todo += wanted[len(usable) :]
    return keep, evict, sorted(todo, key=priority_key)


def _build_nodes(
    state: ClusterState, keep: Sequence[Replica], evict: Sequence[Replica]
) -> tuple[list[_NodeSlots], dict[str, int]]:
    busy = _busy_gpus(state, include_grace=False)
    nodes = sorted(state.nodes, key=lambda n: n.name)
    slots = [_NodeSlots(n, i, busy.get(n.name, set())) for i, n in enumerate(nodes)]
    at = {ns.name: i for i, ns in enumerate(slots)}
    for r in evict:  # their memory is free for this plan
        ns = slots[at[r.node]]
        b = r.bytes_per_gpu or state.models[r.model].prewarm_bytes_per_gpu
        for g in r.gpus:
            p = ns.pos[g]
            ns.free[p] = min(ns.free[p] + b, ns.memory[p])
    for inst in state.instances:
        ns = slots[at[inst.node]]
        m = ns.mask_of(inst.gpus)
        ns.occupants.append(_Occupant(m, None, 0.0, inst.model))
        ns.extra_masks.add(m)
    for r in keep:
        ns = slots[at[r.node]]
        m = ns.mask_of(r.gpus)
        ns.occupants.append(_Occupant(m, _priority(r.kind, r.score), r.score, r.model))
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
    state: ClusterState, slots: Sequence[_NodeSlots]
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
    state: ClusterState, slots: list[_NodeSlots], todo: Sequence[ReplicaRequest]
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
        prio = _priority(req.kind, req.score)
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
    state: ClusterState, slots: list[_NodeSlots], todo: Sequence[ReplicaRequest]
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
                mask = _mask(fit[: spec.tp])
                ns.place(mask, _priority(req.kind, req.score), req.score, need)
                same[req.model].append((i, mask))
                placed.append(_new_replica(spec, req, ns.name, ns.gpus_of(mask)))
                break
        else:
            unplaced.append(
                _unplaced(req, f"no node has {spec.tp} candidate GPUs with {need} bytes free each")
            )
    return placed, unplaced


def plan_prewarm(state: ClusterState, *, evict_aware: bool = True) -> PrewarmPlan:
    """Plan the next window's prewarm replicas (Algorithm 1; see the module docstring).

    Deterministic: the same snapshot gives the same plan.  ``evict_aware=False`` is the §7.5
    ablation (first-fit, no nesting rule).
    """
    busy = _busy_gpus(state, include_grace=False)
    keep, evict, todo = _match_existing(state, busy)
    slots, _ = _build_nodes(state, keep, evict)
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


# --------------------------------------------------------------------------- start choice


def choose_start(state: ClusterState, model: str) -> StartChoice | NoCapacity:
    """Where to start one more instance of ``model`` (paper §5.2, last paragraph).

    1. *Prewarm hit*: among resident replicas of ``model`` whose GPUs are all startable (idle or
       universal, held by no instance — a replica lent memory by a grace instance cannot start
       until that instance ends), take the one whose start evicts the least total score of
       **other** replicas intersecting its GPUs.
    2. *Cold start*: else, among GPU groups of the model's degree (the same aligned enumeration
       as placement, plus the exact sets of resident groups) made only of startable GPUs whose
       memory holds S/D, take the one evicting the least total replica score.
    3. *Unaligned cold start*: else, when some node still has D startable GPUs that fit S/D but
       in no aligned block (serving instances scattered over the node), take the D of them on
       one node whose replicas carry the least score (:func:`_unaligned_group`).  The nesting
       rule of §5.2 is a *prewarm* rule: it keeps replicas from interfering with each other.
       An instance evicts every replica it intersects, so an unaligned instance creates no
       partial overlap, and placement treats its exact GPU set as occupied.  Refusing the start
       instead would leave the request queue waiting for a scale-down although the GPUs are
       free — the simulator measured thousands of such failed starts under heavy load.
    4. Else :class:`NoCapacity` with the reason.

    Ties (equal evicted score) break *best fit* first: the node with the fewest startable GPUs
    left after the start, so a narrow instance fills a node that is already fragmented and
    keeps another node's free block whole for a wider model; then, inside the node, the buddy
    allocator's best fit (issue 12): the group whose enclosing aligned blocks (2x, 4x ... its
    size) have the fewest free GPUs left, so a TP-1 start takes the free GPU beside a busy one
    rather than splitting an empty block a TP-4 model could use; then node name, then lowest
    GPU index.  (The paper does not say how ties break; with the node name alone, TP-1 starts
    took the last free GPU of a block and a TP-2/TP-4 model waited hundreds of seconds for two
    GPUs on one node while single GPUs were free on both — measured in the simulator,
    ``start_failure_kinds`` ``spread``.)
    """
    if model not in state.models:
        raise PolicyInputError(f"unknown model {model!r}")
    spec = state.models[model]
    busy = _busy_gpus(state, include_grace=True)
    by_node: dict[str, list[Replica]] = defaultdict(list)
    for r in state.replicas:
        by_node[r.node].append(r)

    def startable(node: Node, gpus: Iterable[int]) -> bool:
        held = busy.get(node.name, set())
        for g in gpus:
            if g in held or node.gpu(g).state not in (WorkerState.IDLE, WorkerState.UNIVERSAL):
                return False
        return True

    nodes = sorted(state.nodes, key=lambda n: n.name)
    spare = {n.name: sum(1 for g in n.gpus if startable(n, (g.index,))) for n in nodes}
    hits: list[tuple[float, int, str, GpuSet, StartChoice]] = []
    for node in nodes:
        for r in by_node.get(node.name, []):
            if r.model != model or len(r.gpus) != spec.tp or not startable(node, r.gpus):
                continue
            ev = tuple(o for o in evicted_by(by_node[node.name], node.name, r.gpus) if o is not r)
            choice = StartChoice(model, node.name, r.gpus, True, r, ev)
            hits.append((choice.evicted_score, spare[node.name], node.name, r.gpus, choice))
    if hits:
        return min(hits, key=lambda h: h[:4])[4]

    if all(len(n.gpus) < spec.tp for n in nodes):
        return NoCapacity(model, f"tp {spec.tp} exceeds the GPU count of every node")
    if all(g.memory_bytes < spec.bytes_per_gpu for n in nodes for g in n.gpus):
        return NoCapacity(
            model, f"{spec.bytes_per_gpu} bytes per GPU exceed the memory of every GPU"
        )
    best: tuple[float, int, tuple[int, ...], int, int, StartChoice] | None = None
    for order, node in enumerate(nodes):
        ns = _NodeSlots(node, order, set())
        for r in by_node.get(node.name, []):
            ns.extra_masks.add(ns.mask_of(r.gpus))
        free_mask = ns.mask_of(g.index for g in node.gpus if startable(node, (g.index,)))
        for m in ns.groups(spec.tp):
            gpus = ns.gpus_of(m)
            if not startable(node, gpus):
                continue
            if any(node.gpu(g).memory_bytes < spec.bytes_per_gpu for g in gpus):
                continue
            ev = evicted_by(by_node.get(node.name, []), node.name, gpus)
            choice = StartChoice(model, node.name, gpus, False, None, ev)
            key = (
                choice.evicted_score,
                spare[node.name],
                _buddy_free(m, free_mask, spec.tp, ns.n),
                order,
                (m & -m).bit_length(),
            )
            if best is None or key < best[:5]:
                best = (*key, choice)
    if best is not None:
        return best[5]
    for node in sorted(nodes, key=lambda n: spare[n.name]):
        group = _unaligned_group(node, spec, by_node.get(node.name, []), startable)
        if group is not None:
            ev = evicted_by(by_node.get(node.name, []), node.name, group)
            return StartChoice(model, node.name, group, False, None, ev)
    return NoCapacity(
        model,
        f"no group of {spec.tp} idle/universal GPUs with {spec.bytes_per_gpu} bytes of memory "
        "on one node: the GPUs are serving or draining instances",
    )
