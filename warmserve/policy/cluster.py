"""The cluster model every policy function takes and returns.

One set of typed, immutable dataclasses describes what the policy needs to know about a
cluster: nodes and their GPUs (capacity, free memory, worker state), the models served
(weight size, tensor-parallel degree D, max batch B, cold-start latency T_c, layers), the
prewarm replicas already placed or planned, and the running instances.  The operator builds
these from the Kubernetes API and the node agents, the simulator from its own state; both then
call the same policy functions (``predictor``, ``scoring``, ``placement``, ``autoscaler``).

Why immutable: the policy is a pure function of a snapshot.  Callers that want to apply a plan
use :func:`dataclasses.replace` or the helpers here, which return new objects, so a half-applied
decision can never leak back into the caller's view.

Units: bytes for memory, seconds for time, "requests in flight" for load (the paper's load is
the number of concurrent requests, §2.2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

GiB = 1024**3
PAGE_BYTES = 2 * 1024**2  # CUDA VMM granularity on current NVIDIA GPUs (2 MiB)


class PolicyInputError(ValueError):
    """A snapshot or argument the policy cannot decide on; the message names the field."""


class WorkerState(StrEnum):
    """State of one GPU worker (paper Figure 5)."""

    IDLE = "idle"  # no weights resident
    UNIVERSAL = "universal"  # one or more prewarm slots, not serving
    DEDICATED = "dedicated"  # serving one instance
    GRACE = "grace"  # dedicated but draining; may lend free KV memory (paper §4.1)


class ReplicaKind(StrEnum):
    """Prewarm replica category (paper §5.2): basic covers average load, burst covers the peak."""

    BASIC = "basic"
    BURST = "burst"


class InstancePhase(StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    GRACE = "grace"


GpuSet = tuple[int, ...]


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise PolicyInputError(message)


def as_gpu_set(gpus: Iterable[int]) -> GpuSet:
    """Normalise a GPU group to a sorted tuple of distinct indices (raises on duplicates)."""
    if type(gpus) is tuple and gpus:
        # the common case, already normalised: a tuple of strictly increasing ints >= 0
        # (checked without building the error messages: every snapshot makes thousands)
        prev = -1
        for g in gpus:
            if type(g) is not int or g <= prev:
                break
            prev = g
        else:
            return gpus
    out = tuple(sorted(int(g) for g in gpus))
    _require(len(out) > 0, "a GPU group must name at least one GPU")
    _require(len(set(out)) == len(out), f"GPU group {list(out)} names a GPU twice")
    _require(out[0] >= 0, f"GPU group {list(out)} has a negative index")
    return out


@dataclass(frozen=True, slots=True)
class GPU:
    """One GPU of a node.

    ``free_bytes`` is memory available for new prewarm slots *now*: on an idle or universal
    worker, capacity minus resident slots; on a grace worker, the memory its instance may lend
    (Eq. 1); on a dedicated worker, 0 by convention (a serving instance owns the GPU).
    """

    index: int
    memory_bytes: int
    free_bytes: int
    state: WorkerState = WorkerState.IDLE

    def __post_init__(self) -> None:
        if self.index >= 0 and self.memory_bytes > 0 and 0 <= self.free_bytes <= self.memory_bytes:
            return  # valid (the messages below are built only for an invalid GPU)
        _require(self.index >= 0, f"gpu index must be >= 0, got {self.index}")
        _require(self.memory_bytes > 0, f"gpu {self.index}: memory_bytes must be > 0")
        _require(
            0 <= self.free_bytes <= self.memory_bytes,
            f"gpu {self.index}: free_bytes must be within [0, memory_bytes], got {self.free_bytes}",
        )


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpus: tuple[GPU, ...]
    # gpu() by index (derived from ``gpus``; not part of the value)
    _by_index: dict[int, GPU] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _require(bool(self.name), "a node needs a name")
        by_index = {g.index: g for g in self.gpus}
        if len(by_index) != len(self.gpus):
            raise PolicyInputError(f"node {self.name}: duplicate gpu index")
        object.__setattr__(self, "_by_index", by_index)

    def gpu(self, index: int) -> GPU:
        g = self._by_index.get(index)
        if g is None:
            raise PolicyInputError(f"node {self.name} has no gpu {index}")
        return g


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model as the policy sees it.

    ``cold_start_s`` is T_c of Eq. 7-8: the time to load the whole weights into GPUs, from
    offline profiling.  ``prewarm_layers`` is how many leading layers a prewarm replica keeps
    resident (``None``: all), the paper's "first several layers" (§4; chosen by
    :mod:`warmserve.policy.prewarm_depth`).  ``engine_overhead_bytes`` is what a prewarm
    replica's prepared engine occupies per GPU beside the weights (host memory of the engine's
    process, on a GPU its CUDA context and graphs): every replica is charged it, so Algorithm 1
    places it only where the weights *and* the engine fit (docs/policy.md, "Prepared engines'
    cost").
    """

    name: str
    weight_bytes: int
    tp: int = 1
    max_batch: int = 32
    cold_start_s: float = 1.0
    num_layers: int = 32
    prewarm_layers: int | None = None
    engine_overhead_bytes: int = 0

    def __post_init__(self) -> None:
        _require(bool(self.name), "a model needs a name")
        _require(self.weight_bytes > 0, f"model {self.name}: weight_bytes must be > 0")
        _require(self.tp >= 1, f"model {self.name}: tp must be >= 1, got {self.tp}")
        _require(self.max_batch >= 1, f"model {self.name}: max_batch must be >= 1")
        _require(self.cold_start_s >= 0, f"model {self.name}: cold_start_s must be >= 0")
        _require(self.num_layers >= 1, f"model {self.name}: num_layers must be >= 1")
        _require(
            self.engine_overhead_bytes >= 0,
            f"model {self.name}: engine_overhead_bytes must be >= 0",
        )
        if self.prewarm_layers is not None:
            _require(
                0 < self.prewarm_layers <= self.num_layers,
                f"model {self.name}: prewarm_layers must be in [1, num_layers]",
            )

    @property
    def bytes_per_gpu(self) -> int:
        """S/D: weight bytes each of the D GPUs holds (rounded up)."""
        return math.ceil(self.weight_bytes / self.tp)

    @property
    def resident_layers(self) -> int:
        return self.num_layers if self.prewarm_layers is None else self.prewarm_layers

    @property
    def prewarm_bytes_per_gpu(self) -> int:
        """Bytes per GPU a prewarm replica occupies: its resident layers' weights (all or the
        first N) plus its prepared engine's ``engine_overhead_bytes``."""
        weights = math.ceil(self.bytes_per_gpu * self.resident_layers / self.num_layers)
        return weights + self.engine_overhead_bytes


@dataclass(frozen=True, slots=True)
class Replica:
    """A prewarm replica: model weights (all or first layers) resident on a GPU group."""

    model: str
    kind: ReplicaKind
    rank: int
    score: float
    node: str
    gpus: GpuSet
    bytes_per_gpu: int = 0
    layers_resident: int | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise PolicyInputError(f"replica of {self.model}: rank must be >= 0")
        _require(self.score >= 0 and math.isfinite(self.score), "replica score must be finite >= 0")
        object.__setattr__(self, "gpus", as_gpu_set(self.gpus))


@dataclass(frozen=True, slots=True)
class Instance:
    """A serving instance.

    ``running`` is R (requests in flight), ``kv_capacity_bytes`` is M and ``kv_used_bytes`` is
    K of Eq. 1, per instance (summed over its GPUs).
    """

    model: str
    node: str
    gpus: GpuSet
    running: int = 0
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    phase: InstancePhase = InstancePhase.SERVING
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", as_gpu_set(self.gpus))
        if self.running < 0:
            raise PolicyInputError(f"instance of {self.model}: running must be >= 0")
        _require(self.kv_capacity_bytes >= 0, "kv_capacity_bytes must be >= 0")
        _require(self.kv_used_bytes >= 0, "kv_used_bytes must be >= 0")


@dataclass(frozen=True, slots=True)
class LoadForecast:
    """Predicted load of one model for the next window (requests in flight)."""

    avg: float
    peak: float

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.avg) and math.isfinite(self.peak), "forecast must be finite"
        )
        _require(self.avg >= 0 and self.peak >= 0, "forecast must be >= 0")


@dataclass(frozen=True, slots=True)
class ClusterState:
    """A snapshot: nodes, models, what is placed, and the forecast per model."""

    nodes: tuple[Node, ...]
    models: Mapping[str, ModelSpec]
    replicas: tuple[Replica, ...] = ()
    instances: tuple[Instance, ...] = ()
    forecasts: Mapping[str, LoadForecast] = field(default_factory=dict)
    # active_instances per model, counted on first use (a snapshot never changes)
    _active: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)
    _by_name: dict[str, Node] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        _require(len(set(names)) == len(names), "duplicate node name")
        for key, spec in self.models.items():
            if key != spec.name:
                raise PolicyInputError(f"models key {key!r} != model name {spec.name!r}")
        # node() by name (a scan per call cost O(nodes): 128 per replica at 1,024 GPUs)
        by_name = {n.name: n for n in self.nodes}
        object.__setattr__(self, "_by_name", by_name)
        models = self.models
        for r in (*self.replicas, *self.instances):
            if r.model not in models:
                raise PolicyInputError(f"unknown model {r.model!r}")
            node = by_name.get(r.node) or self.node(r.node)  # raises for an unknown node
            known = node._by_index
            for g in r.gpus:
                if g not in known:
                    node.gpu(g)  # raises
        for m in self.forecasts:
            _require(m in self.models, f"forecast for unknown model {m!r}")

    def node(self, name: str) -> Node:
        n = self._by_name.get(name)
        if n is None:
            raise PolicyInputError(f"unknown node {name!r}")
        return n

    def active_instances(self, model: str) -> int:
        """K of Eq. 5-6: instances of ``model`` that serve (grace instances do not count)."""
        counts = self._active
        if counts is None:
            counts = {}
            for i in self.instances:
                if i.phase != InstancePhase.GRACE:
                    counts[i.model] = counts.get(i.model, 0) + 1
            object.__setattr__(self, "_active", counts)
        return counts.get(model, 0)

    def with_replicas(self, replicas: Iterable[Replica]) -> ClusterState:
        return replace(self, replicas=tuple(replicas))

    def with_instances(self, instances: Iterable[Instance]) -> ClusterState:
        return replace(self, instances=tuple(instances))

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)
