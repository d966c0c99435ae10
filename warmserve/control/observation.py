"""What an executor observes, as raw facts (no derived quantity: those are :mod:`.snapshot`'s).

The operator fills these from its agents' ``Describe`` answers (and its in-flight calls), the
simulator from its own state, a test from a script.  Nothing here says how much memory is free
or which state a GPU's worker is in: both follow from the facts by one rule
(:func:`warmserve.control.snapshot.build_state`), so no executor can compute them differently.

Identities (``SlotObs.id``, ``InstanceObs.id``) are the executor's own (agent slot/instance ids,
simulator names); decisions name them back so the executor can act.  Ownership is resolved by
the executor before it reports: ``models`` of an observation are only the ones the controller
manages; slots and instances of anything else are reported as ``foreign`` (they occupy memory
and GPUs, but no decision touches them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from warmserve.policy.cluster import GpuSet, InstancePhase, PolicyInputError, ReplicaKind


@dataclass(frozen=True, slots=True)
class GpuObs:
    """One GPU: where it is and how large.  ``reported_free``: what the runtime says a new
    prewarm may use now (an agent's page accounting), or ``None`` when the executor has no such
    report (the simulator); the snapshot rule never offers more than a runtime reports."""

    node: str
    index: int
    memory_bytes: int
    reported_free: int | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.index < 0:
            raise PolicyInputError(f"{self.node}/gpu{self.index}: bad index or memory")


@dataclass(frozen=True, slots=True)
class SlotObs:
    """Weights resident (or loading) on a GPU group that no instance serves from: a prewarm
    replica.  ``bytes_per_gpu`` is what the slot holds once loaded; ``layers_resident`` how many
    leading layers are in now (``None``: all it targets)."""

    id: str
    model: str
    node: str
    gpus: GpuSet
    bytes_per_gpu: int
    layers_resident: int | None = None
    foreign: bool = False
    # Kind, rank and score when the slot was made by a rule outside the controller (a
    # baseline's cache of stopped instances); the controller's own plan takes precedence.
    priority: tuple[ReplicaKind, int, float] | None = None


@dataclass(frozen=True, slots=True)
class InstanceObs:
    """A starting, serving or grace instance.

    ``in_flight``: requests at the instance (running + queued there), its share of the model's
    demand.  ``running``: requests admitted to the batch (R of Eq. 1; a grace period ends when it
    reaches 0).  ``kv_capacity_bytes`` / ``kv_used_bytes``: M and K of Eq. 1, over the whole
    group.  ``grace_started_s``: when its grace began, if the executor knows (else the
    controller's first sight of it in grace).
    """

    id: str
    model: str
    node: str
    gpus: GpuSet
    phase: InstancePhase
    in_flight: int = 0
    running: int = 0
    kv_capacity_bytes: int = 0  # M as configured at start, before any lending
    kv_used_bytes: int = 0
    grace_started_s: float | None = None
    max_batch: int = 0  # C of Eq. 1 when the controller has no spec of the model (foreign)
    foreign: bool = False


@dataclass(frozen=True)
class Observation:
    """Everything an executor knows at time ``now``.

    ``held``: requests held at gateways per model because no instance could take them yet (the
    gateway's demand feed; empty where there is no gateway).  Held requests are part of the
    model's demand (:mod:`.demand`), which is how a model with no instance gets started.
    """

    now: float
    gpus: tuple[GpuObs, ...]
    slots: tuple[SlotObs, ...] = ()
    instances: tuple[InstanceObs, ...] = ()
    held: Mapping[str, int] = field(default_factory=dict)

    def gpu_keys(self) -> set[tuple[str, int]]:
        return {(g.node, g.index) for g in self.gpus}
