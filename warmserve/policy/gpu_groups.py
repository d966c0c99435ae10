"""GPU groups for evict-aware placement (WarmServe §5.2, Fig. 7): aligned blocks and nesting.

Shared by :mod:`warmserve.policy.evict_aware_placement` (Algorithm 1) and
:mod:`warmserve.policy.start_choice`: which GPU groups of a node are considered for a degree D,
whether a group keeps the §5.2 rule (disjoint from or nested with every replica and instance,
never a partial overlap, checked exactly with bit masks), and the per-node working state that
tracks free memory, candidate GPUs and the occupied sets during one decision.

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
  construction; the exact check of Algorithm 1's step 3 is still run because existing
  replicas/instances may sit on arbitrary sets and because non-power-of-two degrees use a block
  prefix (two prefixes can partially overlap; the check then rejects the group).
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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from warmserve.policy.cluster import (
    ClusterState,
    GpuSet,
    InstancePhase,
    Node,
    PolicyInputError,
    ReplicaKind,
    WorkerState,
)

__all__ = [
    "KIND_RANK",
    "NO_KIND",
    "NodeSlots",
    "Occupant",
    "aligned_groups",
    "busy_gpus",
    "is_laminar",
    "next_pow2",
    "positions_mask",
    "replica_priority",
]

KIND_RANK = {ReplicaKind.BASIC: 0, ReplicaKind.BURST: 1}
NO_KIND = 2  # "no nested replica": lower than any real priority


def next_pow2(d: int) -> int:
    """The buddy block size for degree ``d``: the least power of two >= d."""
    return 1 << (d - 1).bit_length()


def aligned_groups(n_gpus: int, degree: int) -> list[tuple[int, ...]]:
    """Positions of the aligned buddy blocks for ``degree`` on a node of ``n_gpus`` GPUs.

    Each group is the first ``degree`` positions of an aligned block of size next_pow2(degree).
    Positions index the node's GPUs sorted by GPU index.
    """
    if degree < 1:
        raise PolicyInputError(f"degree must be >= 1, got {degree}")
    p = next_pow2(degree)
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


def positions_mask(positions: Iterable[int]) -> int:
    """The bit mask of node positions (bit p set for position p)."""
    m = 0
    for p in positions:
        m |= 1 << p
    return m


def _compatible(a: int, b: int) -> bool:
    inter = a & b
    return inter == 0 or inter in (a, b)


def replica_priority(kind: ReplicaKind, score: float) -> tuple[int, float]:
    """(kind rank, score): lower kind rank wins, then higher score."""
    return (KIND_RANK[kind], score)


def _higher(a: tuple[int, float], b: tuple[int, float]) -> bool:
    """True when priority ``a`` is strictly higher than ``b``."""
    return a[0] < b[0] or (a[0] == b[0] and a[1] > b[1])


def busy_gpus(state: ClusterState, *, include_grace: bool) -> dict[str, set[int]]:
    """GPUs held by instances, per node (grace instances optionally)."""
    busy: dict[str, set[int]] = defaultdict(set)
    for inst in state.instances:
        if include_grace or inst.phase != InstancePhase.GRACE:
            busy[inst.node].update(inst.gpus)
    return busy


@dataclass(slots=True)
class Occupant:
    """A GPU set already taken on a node: a replica (with its priority) or an instance."""

    mask: int
    prio: tuple[int, float] | None  # None for an instance
    score: float
    model: str = ""


# id(node) -> (node, busy GPUs, the node's facts of NodeSlots): pure memoisation (the node is
# kept, so its id is not reused while the entry lives); bounded.
_NODE_FACTS: dict[int, tuple[Node, frozenset[int], tuple]] = {}
_NODE_FACTS_MAX = 8192


class NodeSlots:
    """Working state of one node during planning: free bytes, candidates, occupied sets."""

    def __init__(self, node: Node, order: int, busy: set[int]) -> None:
        self.name = node.name
        self.order = order
        # What depends only on the (immutable) node and its busy GPUs is computed once per
        # node and shared read-only (a plan builds every node's slots; most nodes are the same
        # objects from one snapshot to the next); ``free`` is this plan's own copy.
        key = frozenset(busy)
        hit = _NODE_FACTS.get(id(node))
        if hit is None or hit[0] is not node or hit[1] != key:
            if len(_NODE_FACTS) >= _NODE_FACTS_MAX:
                _NODE_FACTS.clear()
            gpus = sorted(node.gpus, key=lambda g: g.index)
            facts: tuple = (  # _NODE_FACTS's value (typed for mypyc: the simulator compiled)
                tuple(g.index for g in gpus),
                {g.index: p for p, g in enumerate(gpus)},
                tuple(g.memory_bytes for g in gpus),
                tuple(g.free_bytes for g in gpus),
                tuple(
                    g.state in (WorkerState.IDLE, WorkerState.UNIVERSAL, WorkerState.GRACE)
                    and g.index not in busy
                    for g in gpus
                ),
                {},  # mask_of's answers (derived from the positions only)
            )
            hit = (node, key, facts)
            _NODE_FACTS[id(node)] = hit
        self.index, self.pos, self.memory, free, self.candidate, self.masks = hit[2]
        self.free = list(free)
        self.occupants: list[Occupant] = []
        self.extra_masks: set[int] = set()

    @property
    def n(self) -> int:
        return len(self.index)

    def mask_of(self, gpus: Iterable[int]) -> int:
        if type(gpus) is not tuple:
            return positions_mask(self.pos[g] for g in gpus)
        m = self.masks.get(gpus)
        if m is None:
            m = self.masks[gpus] = positions_mask(self.pos[g] for g in gpus)
        return m

    def gpus_of(self, mask: int) -> GpuSet:
        return tuple(self.index[p] for p in range(self.n) if mask >> p & 1)

    def groups(self, degree: int) -> list[int]:
        masks = {positions_mask(g) for g in aligned_groups(self.n, degree)}
        masks.update(m for m in self.extra_masks if m.bit_count() == degree)
        return sorted(masks, key=lambda m: ((m & -m).bit_length(), m))

    def evaluate(self, mask: int) -> tuple[bool, int, int, float, float]:
        """(valid, min free, highest nested kind rank, its score, sum of nested scores)."""
        positions = [p for p in range(self.n) if mask >> p & 1]
        if not all(self.candidate[p] for p in positions):
            return False, 0, NO_KIND, -1.0, 0.0
        best: tuple[int, float] = (NO_KIND, -1.0)
        total = 0.0
        for occ in self.occupants:
            if not occ.mask & mask:
                continue
            if not _compatible(occ.mask, mask):
                return False, 0, NO_KIND, -1.0, 0.0
            if occ.prio is not None:
                total += occ.score
                if _higher(occ.prio, best):
                    best = occ.prio
        return True, min(self.free[p] for p in positions), best[0], best[1], total

    def place(self, mask: int, prio: tuple[int, float] | None, score: float, need: int) -> None:
        for p in range(self.n):
            if mask >> p & 1:
                self.free[p] -= need
        self.occupants.append(Occupant(mask, prio, score))
