"""Reclaim: free a GPU group for a model whose requests wait and that has nowhere to start.

The autoscaler scales each model on its own load;
:func:`~warmserve.policy.start_choice.choose_start` finds a group of free (idle or universal) GPUs
for a new instance.  Under load the GPUs can all
be held by *other* models' instances that no longer need them — a model scales down only after
its load stayed below the scale-down threshold for ``scale_down_delay_s``, and one whose load
sits inside the hysteresis band never does — or the free GPUs lie scattered over the nodes so
that a TP-2 or TP-4 model finds no group.  Measured in the simulator (paper testbed,
alpha 0.5, RPS 25): the 70B model queued 1,800 requests for minutes while single GPUs were free
on both nodes and 7B instances ran at a quarter of their batch; which model starved depended on
the order in which models had grabbed GPUs.  Nothing let a model with a long queue take GPUs
from idle-ish instances of other models.

:func:`plan_reclaim` is that rule.  For a model ``M`` with requests waiting and no group to start
on, it looks for a GPU group of ``M``'s degree (the same aligned groups as placement) whose GPUs
are free, or held by grace instances (they free themselves), or held by **serving instances of
other models that those models can spare**: model ``V`` can spare ``c`` instances when its demand
still fits the remaining ones at the scale-*down* threshold,

    load_V <= (active_V - c) * B_V * scale_down_utilization,      active_V - c >= min_V,

i.e. the instances the autoscaler itself would drain once the load had stayed that low for
``scale_down_delay_s``: reclaim only skips that delay.  ``V`` keeps serving everything it serves
now with the same headroom as after any scale-down, so it does not want them back at once (no
ping-pong; with the scale-up threshold instead, measured in the simulator, the victims restarted
instances within minutes and the tail got worse at moderate load).

A victim is never wider than ``M`` (a TP-4 instance is not drained for a TP-1 model: it would
free three GPUs nobody asked for and leave the wide model a fragmented cluster to come back to;
measured: with it, the 70B's P99 at alpha 0.5, RPS 15 went from 7.4 s to 21.9 s).

Among such groups it takes the one that frees soonest: the fewest requests still running on the
instances in it (they must finish first; a drained instance takes no new
requests and ends when its last request finishes), then the fewest GPUs freed beyond the group,
the fewest instances drained, node name, lowest GPU.  If the best group needs no drain (only
grace instances in it), nothing is drained: it is already being freed.  ``M`` must be below its
fair share (:mod:`warmserve.policy.fairness`) when one is given: reclaim never lets a model grow
past it.

The victims are *drained* (grace period, §4.1), never killed: their requests finish, their KV
memory can be lent to prewarm ``M`` meanwhile (proactive prewarming), and ``M`` starts there when
the group is free.  Pure and deterministic; property tests in ``tests/policy/test_reclaim.py``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import (
    ClusterState,
    GpuSet,
    Instance,
    InstancePhase,
    PolicyInputError,
    WorkerState,
)
from warmserve.policy.gpu_groups import aligned_groups

__all__ = ["Reclaim", "plan_reclaim", "spare_instances"]


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Drain ``victims`` so that ``model`` can start on ``gpus`` of ``node``.

    ``waiting``: requests still running on the instances of the group (victims and grace
    instances alike) that must finish before the group is free.
    """

    model: str
    node: str
    gpus: GpuSet
    victims: tuple[Instance, ...]
    waiting: int


def spare_instances(
    active: int, load: float, max_batch: int, config: AutoscalerConfig, min_instances: int = 0
) -> int:
    """How many of ``active`` serving instances a model can give up now (module docstring)."""
    if active < 0 or max_batch < 1 or not math.isfinite(load) or load < 0:
        raise PolicyInputError(
            f"need active >= 0, max_batch >= 1, finite load >= 0, got {active}, {max_batch}, {load}"
        )
    needed = math.ceil(round(load / (max_batch * config.scale_down_utilization), 9))
    return max(active - max(needed, min_instances), 0)


def plan_reclaim(
    state: ClusterState,
    model: str,
    loads: Mapping[str, float],
    config: AutoscalerConfig,
    *,
    caps: Mapping[str, int] | None = None,
    min_instances: Mapping[str, int] | None = None,
) -> Reclaim | None:
    """A group to free for ``model`` and the instances to drain for it (module docstring), or
    ``None`` when there is none, the best one is already being freed, or ``model`` is at its
    fair share."""
    if model not in state.models:
        raise PolicyInputError(f"unknown model {model!r}")
    spec = state.models[model]
    if caps is not None and state.active_instances(model) >= caps.get(model, math.inf):
        return None
    mins = min_instances or {}
    holder: dict[tuple[str, int], Instance] = {}
    active: dict[str, int] = defaultdict(int)
    for inst in state.instances:
        for g in inst.gpus:
            holder[(inst.node, g)] = inst
        if inst.phase != InstancePhase.GRACE:
            active[inst.model] += 1
    spare = {
        v: spare_instances(
            active[v], loads.get(v, 0.0), state.models[v].max_batch, config, mins.get(v, 0)
        )
        for v in state.models
    }
    best: tuple[tuple[int, int, int, int, int], Reclaim] | None = None
    for order, node in enumerate(sorted(state.nodes, key=lambda n: n.name)):
        gpus = sorted(node.gpus, key=lambda g: g.index)
        for positions in aligned_groups(len(gpus), spec.tp):
            group = tuple(gpus[p].index for p in positions)
            if any(gpus[p].memory_bytes < spec.bytes_per_gpu for p in positions):
                continue
            found = _group(state, model, node.name, group, holder, spare)
            if found is None:
                continue
            victims, waiting, extra = found
            key = (waiting, extra, len(victims), order, group[0])
            if best is None or key < best[0]:
                best = (key, Reclaim(model, node.name, group, victims, waiting))
    if best is None or not best[1].victims:
        return None
    return best[1]


def _group(
    state: ClusterState,
    model: str,
    node: str,
    group: GpuSet,
    holder: Mapping[tuple[str, int], Instance],
    spare: Mapping[str, int],
) -> tuple[tuple[Instance, ...], int, int] | None:
    """(victims, requests waiting, GPUs freed outside the group) for freeing ``group``, or
    ``None`` when it cannot be freed by draining spare instances of other models."""
    states = {g.index: g.state for g in state.node(node).gpus}
    seen: dict[str, Instance] = {}
    for g in group:
        inst = holder.get((node, g))
        if inst is None:
            if states[g] not in (WorkerState.IDLE, WorkerState.UNIVERSAL):
                return None  # held by something the snapshot does not show as an instance
            continue
        if inst.model == model or inst.phase == InstancePhase.STARTING:
            return None
        if inst.phase == InstancePhase.SERVING and len(inst.gpus) > len(group):
            return None  # never break a wider instance for a narrower model
        seen[inst.name or f"{inst.node}/{inst.gpus}"] = inst
    victims = tuple(
        i for _, i in sorted(seen.items()) if i.phase == InstancePhase.SERVING
    )
    taken: dict[str, int] = defaultdict(int)
    for v in victims:
        taken[v.model] += 1
        if taken[v.model] > spare.get(v.model, 0):
            return None
    waiting = sum(i.running for i in seen.values())
    extra = sum(len(set(i.gpus) - set(group)) for i in seen.values())
    return victims, waiting, extra
