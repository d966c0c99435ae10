"""Start choice: where one more instance of a model starts (WarmServe §5.2, last paragraph).

"When creating new instances on top of prewarmed models, WarmServe reduces the impact on
existing prewarmed models by minimizing the sum of prewarming scores for evicted replicas."
:func:`choose_start` answers, as a pure function of a
:class:`~warmserve.policy.cluster.ClusterState`, with a *prewarm hit* on a resident replica or a
*cold start* on idle GPUs (:class:`StartChoice`), or :class:`NoCapacity`; :func:`evicted_by`
names the replicas a start evicts.  Cold starts use the same GPU group enumeration as
Algorithm 1 (:mod:`warmserve.policy.gpu_groups`); the rule and its tie-breaks are in
:func:`choose_start`'s docstring.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from warmserve.policy.cluster import (
    ClusterState,
    GpuSet,
    ModelSpec,
    Node,
    PolicyInputError,
    Replica,
    WorkerState,
)
from warmserve.policy.gpu_groups import NodeSlots, busy_gpus, next_pow2

__all__ = ["NoCapacity", "StartChoice", "choose_start", "evicted_by"]


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
    size = next_pow2(degree) * 2
    low = (mask & -mask).bit_length() - 1
    while size <= n:
        start = low // size * size
        block = ((1 << size) - 1) << start
        out.append(((free & ~mask) & block).bit_count())
        size *= 2
    return tuple(out)


def evicted_by(replicas: Iterable[Replica], node: str, gpus: Iterable[int]) -> tuple[Replica, ...]:
    """The replicas on ``node`` whose GPUs intersect ``gpus`` (those a start there evicts)."""
    g = set(gpus)
    return tuple(r for r in replicas if r.node == node and g.intersection(r.gpus))


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
    allocator's best fit: the group whose enclosing aligned blocks (2x, 4x ... its
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
    busy = busy_gpus(state, include_grace=True)
    by_node: dict[str, list[Replica]] = defaultdict(list)
    for r in state.replicas:
        by_node[r.node].append(r)

    # per node, its startable GPUs: idle or universal, held by no instance (once per call:
    # asked per GPU of every candidate group)
    ok: dict[str, set[int]] = {
        n.name: {
            g.index
            for g in n.gpus
            if g.index not in busy.get(n.name, ())
            and g.state in (WorkerState.IDLE, WorkerState.UNIVERSAL)
        }
        for n in state.nodes
    }

    def startable(node: Node, gpus: Iterable[int]) -> bool:
        good = ok[node.name]
        for g in gpus:
            if g not in good:
                if g not in busy.get(node.name, ()):
                    node.gpu(g)  # raises for a GPU the node does not have
                return False
        return True

    nodes = sorted(state.nodes, key=lambda n: n.name)
    spare = {n.name: len(ok[n.name]) for n in nodes}
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
        if spare[node.name] < spec.tp:
            continue  # fewer startable GPUs than one group needs: no group of it is startable
        ns = NodeSlots(node, order, set())
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
