"""Algorithm 1's first step: resident prewarm replicas matched to the requested ones (§5.2).

Per model, the replicas already resident (``state.replicas``) are matched to the replicas the
forecast asks for (Eq. 5-8, :func:`warmserve.policy.scoring.model_replicas`): the existing
ones, in (kind, rank, node, gpus) order, take the identity of the highest-priority requests
(basic rank 0 first) and are **kept** in place with their new kind, rank and score; only the
remaining requests are placed.  A resident replica is **stale** (evicted) when its degree is not
the model's, or a serving or starting instance now holds one of its GPUs (a dedicated GPU);
replicas beyond what the model asks for are evicted too.

:class:`MatchMemo` makes the match incremental: each model's outcome is a pure
function of its spec, forecast, active instances, spare count, resident replicas and their
staleness, so the outcome of the last plan is reused for every model whose inputs compare equal
(most models between two plans); the result is the same with or without a memo
(property-tested against the full match).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace

from warmserve.policy.cluster import (
    ClusterState,
    LoadForecast,
    ModelSpec,
    Node,
    Replica,
    WorkerState,
)
from warmserve.policy.gpu_groups import KIND_RANK
from warmserve.policy.scoring import ReplicaRequest, model_replicas, priority_key

__all__ = ["MatchMemo", "match_existing"]

# one model's inputs: spec, forecast, active instances, spare, resident replicas, stale flags
_Key = tuple[ModelSpec, LoadForecast | None, int, int, tuple[Replica, ...], tuple[bool, ...]]
# one model's outcome: keep, evict, still to place
_Outcome = tuple[tuple[Replica, ...], tuple[Replica, ...], tuple[ReplicaRequest, ...]]


class MatchMemo:
    """Each model's last match (its inputs and outcome), kept by one planner between plans.

    Pure memoisation: an outcome is reused only for inputs equal to the ones it was computed
    from (all immutable values), and only the last plan's entries are kept."""

    def __init__(self) -> None:
        self.models: dict[str, tuple[_Key, _Outcome]] = {}
        # id(node) -> (node, its dedicated GPUs); the node is kept, so its id is not reused
        self.dedicated: dict[int, tuple[Node, frozenset[int]]] = {}


def _blocked(node: Node, busy: set[int] | None, memo: MatchMemo | None) -> frozenset[int]:
    """GPUs of ``node`` a replica must not be on: dedicated ones and ``busy`` ones (those of
    serving and starting instances).  A node's dedicated GPUs are kept per node object in
    ``memo`` (the snapshot memo reuses the objects of unchanged nodes)."""
    hit = memo.dedicated.get(id(node)) if memo is not None else None
    if hit is not None and hit[0] is node:
        ded = hit[1]
    else:
        ded = frozenset(g.index for g in node.gpus if g.state == WorkerState.DEDICATED)
        if memo is not None:
            memo.dedicated[id(node)] = (node, ded)
    return ded | busy if busy else ded


def _match_model(
    spec: ModelSpec, fc: LoadForecast | None, active: int, extra: int,
    resident: tuple[Replica, ...], stale: tuple[bool, ...],
) -> _Outcome:
    wanted = model_replicas(spec, fc, active, extra) if fc else []
    order = sorted(
        range(len(resident)),
        key=lambda k: (KIND_RANK[resident[k].kind], resident[k].rank, resident[k].node,
                       resident[k].gpus),
    )
    usable = [resident[k] for k in order if not stale[k]]
    evict = [resident[k] for k in order if stale[k]]
    keep: list[Replica] = []
    for req, r in zip(wanted, usable, strict=False):
        b = r.bytes_per_gpu or spec.prewarm_bytes_per_gpu
        if (r.kind, r.rank, r.score, r.bytes_per_gpu) == (req.kind, req.rank, req.score, b):
            keep.append(r)  # already as the request says (the common case: an equal value)
        else:
            keep.append(replace(r, kind=req.kind, rank=req.rank, score=req.score,
                                bytes_per_gpu=b))
    evict += usable[len(wanted) :]
    return tuple(keep), tuple(evict), tuple(wanted[len(usable) :])


def match_existing(
    state: ClusterState,
    busy: Mapping[str, set[int]],
    spare: int | Mapping[str, int] = 0,
    memo: MatchMemo | None = None,
) -> tuple[list[Replica], list[Replica], list[ReplicaRequest]]:
    """Split resident replicas into keep/evict and return the requests still to place, in
    :func:`~warmserve.policy.scoring.priority_key` order (module docstring).  ``busy``: the GPUs
    of serving and starting instances per node."""
    by_model: dict[str, list[Replica]] = defaultdict(list)
    for r in state.replicas:
        by_model[r.model].append(r)
    keep: list[Replica] = []
    evict: list[Replica] = []
    todo: list[ReplicaRequest] = []
    # a replica is stale when its degree is not its model's or one of its GPUs is blocked
    blocked: dict[str, frozenset[int]] = {}
    for r in state.replicas:
        if r.node not in blocked:
            blocked[r.node] = _blocked(state.node(r.node), busy.get(r.node), memo)
    known = memo.models if memo is not None else {}
    seen: dict[str, tuple[_Key, _Outcome]] = {}
    for name in sorted(state.models):
        spec = state.models[name]
        resident = tuple(by_model.get(name, ()))
        tp = spec.tp
        key: _Key = (
            spec,
            state.forecasts.get(name),
            state.active_instances(name),
            spare if isinstance(spare, int) else spare.get(name, 0),
            resident,
            tuple(len(r.gpus) != tp or not blocked[r.node].isdisjoint(r.gpus)
                  for r in resident),
        )
        hit = known.get(name)
        out = hit[1] if hit is not None and hit[0] == key else _match_model(*key)
        seen[name] = (key, out)
        keep += out[0]
        evict += out[1]
        todo += out[2]
    if memo is not None:
        memo.models = seen
        if len(memo.dedicated) > 4 * max(len(state.nodes), 1):  # bounded: drop old nodes
            memo.dedicated = {id(n): memo.dedicated[id(n)] for n in state.nodes
                              if id(n) in memo.dedicated and memo.dedicated[id(n)][0] is n}
    return keep, evict, sorted(todo, key=priority_key)
