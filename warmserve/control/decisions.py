"""Typed decisions of the controller; executors carry them out (agent calls, simulated events).

Every decision names the executor's own identities back (slot ids, instance ids from the
observation), so carrying it out needs no lookup by model name.  ``reason`` is for a person
(logs, Events).  The order of :attr:`Decisions.items` is the order to act in: per model (sorted)
starts, drains and grace ends; then the plan's evictions before its prewarms (the plan's memory
accounting assumes the evicted bytes are free).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from warmserve.policy.autoscaler import ScaleDecision
from warmserve.policy.cluster import GpuSet, ReplicaKind
from warmserve.policy.evict_aware_placement import PrewarmPlan


@dataclass(frozen=True, slots=True)
class Start:
    """Start one instance of ``model`` on ``gpus``; a prewarm hit on slot ``slot_id`` when
    ``hit``; the start evicts the slots ``evicts`` (other models' replicas on the group)."""

    model: str
    node: str
    gpus: GpuSet
    hit: bool
    slot_id: str = ""
    evicts: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    """Put a serving instance into its grace period (no new requests; lends KV memory)."""

    model: str
    node: str
    gpus: GpuSet
    instance_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class EndGrace:
    """End a grace instance: its last request finished, or its grace period is over (requests
    still running are cut off).  Its weights stay resident as a slot unless ``evict_weights``."""

    model: str
    node: str
    gpus: GpuSet
    instance_id: str
    reason: str = ""
    evict_weights: bool = False


@dataclass(frozen=True, slots=True)
class Prewarm:
    """Load ``model``'s first ``layers`` (0 = all) onto ``gpus`` as a prewarm replica."""

    model: str
    node: str
    gpus: GpuSet
    kind: ReplicaKind
    rank: int
    score: float
    layers: int
    bytes_per_gpu: int


@dataclass(frozen=True, slots=True)
class Evict:
    """Remove the prewarm replica in slot ``slot_id``."""

    model: str
    node: str
    gpus: GpuSet
    slot_id: str
    reason: str = ""


Decision = Start | Drain | EndGrace | Prewarm | Evict


@dataclass(frozen=True)
class Decisions:
    """One ``decide`` call's outcome: the decisions in acting order, plus what status reports
    need (the autoscaler's per-model decision, the plan if one ran, why starts found no room)."""

    items: tuple[Decision, ...] = ()
    scale: Mapping[str, ScaleDecision] = field(default_factory=dict)
    plan: PrewarmPlan | None = None
    no_capacity: Mapping[str, str] = field(default_factory=dict)

    def of(self, kind: type) -> list[Decision]:
        return [d for d in self.items if isinstance(d, kind)]


def canonical(d: Decision) -> tuple[object, ...]:
    """An executor-independent form (no ids): what the parity test compares."""
    name = type(d).__name__
    if isinstance(d, Start):
        return (name, d.model, d.node, d.gpus, d.hit, len(d.evicts))
    if isinstance(d, Prewarm):
        return (
            name, d.model, d.node, d.gpus, d.kind.value, d.rank, round(d.score, 6), d.layers,
            d.bytes_per_gpu,
        )
    if isinstance(d, EndGrace):
        return (name, d.model, d.node, d.gpus, d.reason)
    return (name, d.model, d.node, d.gpus)
