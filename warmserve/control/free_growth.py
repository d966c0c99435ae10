"""Re-plan trigger (c) of :mod:`.controller`: free memory grew on some GPU since the last plan.

The rule (``docs/policy.md``): remember, per GPU that is not dedicated, the least free memory
seen since the last plan (the plan itself sets it to what it planned on); a snapshot in which
some GPU has more than :data:`FREE_GROWTH_BYTES` above that asks for a re-plan (and leaves the
memory untouched, so the next snapshot asks again until a plan runs).  A GPU that was dedicated
(absent) counts from 0: when its instance ends, its memory "grew".

Incremental: a snapshot of 1,024 GPUs changes a few nodes between two decisions,
and :class:`~warmserve.policy.cluster.Node` objects are immutable and reused by the snapshot
memo while their facts stay.  A node whose object is the one its remembered minimum was last
computed from cannot have grown, and its minimum cannot change: it is skipped.  The result is
the rule's, node for node (``tests/control/test_free_growth.py`` checks it against the rule
computed in full).
"""

from __future__ import annotations

from warmserve.policy.cluster import ClusterState, Node, WorkerState

FREE_GROWTH_BYTES = 2**20  # free memory must grow by more than this to trigger a re-plan

NodeFree = tuple[tuple[int, int], ...]  # (GPU index, free bytes) of its non-dedicated GPUs


def node_free(n: Node) -> NodeFree:
    return tuple((g.index, g.free_bytes) for g in n.gpus if g.state != WorkerState.DEDICATED)


class FreeGrowth:
    """The least free memory per GPU since the last plan (module docstring)."""

    def __init__(self) -> None:
        self.least: dict[str, NodeFree] = {}
        # node name -> the Node object its ``least`` entry was computed from
        self._from: dict[str, Node] = {}
        # names whose ``least`` entry is exactly ``node_free`` of that object (no lower minimum)
        self._exact: set[str] = set()

    def reset(self, state: ClusterState) -> None:
        """A plan ran on ``state``: the least free memory is what it planned on."""
        least, src, exact = self.least, self._from, self._exact
        names = set()
        for n in state.nodes:
            names.add(n.name)
            if src.get(n.name) is n and n.name in exact:
                continue  # already node_free(n): nothing to recompute
            least[n.name] = node_free(n)
            src[n.name] = n
            exact.add(n.name)
        if len(least) != len(names):  # nodes gone since: forget them
            self.least = {k: v for k, v in least.items() if k in names}
            self._from = {k: v for k, v in src.items() if k in names}
            self._exact &= names

    def grew(self, state: ClusterState) -> bool:
        """True when some GPU of ``state`` has more than :data:`FREE_GROWTH_BYTES` above its
        least free memory (nothing is remembered then); otherwise remember the new minima."""
        least, src = self.least, self._from
        updates: list[tuple[Node, NodeFree, NodeFree]] = []
        for n in state.nodes:
            if src.get(n.name) is n:
                continue  # the same facts as its minimum was taken from: no growth, no change
            old = dict(least.get(n.name, ()))
            cur = node_free(n)
            for g, v in cur:
                if v > old.get(g, 0) + FREE_GROWTH_BYTES:
                    return True
            updates.append((n, tuple((g, min(v, old.get(g, v))) for g, v in cur), cur))
        for n, low, cur in updates:
            least[n.name] = low
            src[n.name] = n
            if low == cur:
                self._exact.add(n.name)
            else:
                self._exact.discard(n.name)
        return False

    def as_map(self) -> dict[tuple[str, int], int]:
        """The remembered minima per (node, GPU index)."""
        return {(name, g): v for name, gs in self.least.items() for g, v in gs}
