"""What one node agent reports, as plain frozen dataclasses: its GPUs, prewarm slots, instances and
fetches (``NodeSnapshot``), translated once from the agent's protobuf ``Describe`` answer.

Everything in the operator past :mod:`.agents` (the gRPC port) reads these types only, so the
control loop's decision-to-action translation is tested with in-memory fakes, without gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from warmserve.api.agent.errors import FENCED_PREFIX
from warmserve.api.agent.wire import SlotState, instance_phase, slot_state, worker_state
from warmserve.policy.cluster import InstancePhase, WorkerState

from .model_spec import CatalogEntry, profile_from_pb


class AgentCallError(Exception):
    """An agent refused or failed a call; ``code`` is the gRPC status name (e.g. NOT_FOUND)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def fenced(self) -> bool:
        """The agent refused the call's fencing token: a newer leader reached it."""
        return self.code == "FAILED_PRECONDITION" and self.message.startswith(FENCED_PREFIX)


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    memory_bytes: int
    free_bytes: int
    state: WorkerState
    slot_ids: tuple[str, ...] = ()
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class SlotView:
    slot_id: str
    model: str
    gpus: tuple[int, ...]
    layers_resident: int
    layers_total: int
    layers_target: int
    resident_bytes_per_gpu: int
    weight_bytes_per_gpu: int
    state: SlotState
    owner: str = ""  # the owning ModelDeployment's UID ("" : set by no operator / older agent)

    @property
    def target_bytes_per_gpu(self) -> int:
        """Bytes per GPU the slot holds once loaded (what placement must account for)."""
        if self.layers_total <= 0:
            return self.resident_bytes_per_gpu
        target = self.layers_target or self.layers_total
        return max(
            self.resident_bytes_per_gpu, self.weight_bytes_per_gpu * target // self.layers_total
        )


@dataclass(frozen=True, slots=True)
class InstanceView:
    instance_id: str
    model: str
    gpus: tuple[int, ...]
    endpoint: str
    phase: InstancePhase
    running: int = 0
    waiting: int = 0
    max_batch: int = 0
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    lendable_bytes: int = 0
    lent_bytes: int = 0
    prewarm_hit: bool = False
    slot_id: str = ""
    started_unix: float = 0.0
    engine: str = ""
    ttft_p95_s: float = 0.0  # the engine's p95 TTFT over its window (ttft_samples requests)
    ttft_samples: int = 0
    ttft_window_s: float = 0.0
    owner: str = ""  # the owning ModelDeployment's UID (see SlotView.owner)
    grace_started_unix: float = 0.0  # agent clock; 0 when not in grace or unknown

    @property
    def load(self) -> int:
        """Requests in flight at this instance (running + queued), the paper's load (§2.2)."""
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class ActivateResult:
    """What an ``Activate`` answered: the instance it started, and how."""

    instance: InstanceView
    hit: bool
    activation_s: float
    evicted_slot_ids: tuple[str, ...] = ()
    # When each stage completed (seconds since the agent got Activate; the agent's
    # ActivationStages, in order), and whether the engine was prepared at prewarm time.
    stages: tuple[tuple[str, float], ...] = ()
    engine_prepared: bool = False

    def stages_text(self) -> str:
        """One short list for the PrewarmHit/ColdStart Event."""
        if not self.stages:
            return ""
        made = "prepared at prewarm" if self.engine_prepared else "built at activation"
        listed = ", ".join(f"{name} {s:.3f}s" for name, s in self.stages)
        return f"stages: {listed} (engine {made})"


@dataclass(frozen=True, slots=True)
class FetchView:
    """A model being fetched into a node's store from its source (agent's FetchInfo)."""

    model: str
    source: str
    state: str  # listing | downloading | verifying | done | failed
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0
    eta_s: float = 0.0
    attempt: int = 0
    message: str = ""
    started_unix: float = 0.0


_FETCH = {1: "listing", 2: "downloading", 3: "verifying", 4: "done", 5: "failed"}


def fetch_from_pb(f: Any) -> FetchView:
    return FetchView(
        model=f.model,
        source=f.source,
        state=_FETCH.get(int(f.state), "listing"),
        bytes_done=int(f.bytes_done),
        bytes_total=int(f.bytes_total),
        bytes_per_s=float(f.bytes_per_second),
        eta_s=float(f.eta_seconds),
        attempt=int(f.attempt),
        message=f.message,
        started_unix=float(f.started_unix),
    )


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What one agent reported in one Describe call."""

    node: str  # the GPUNode name
    agent_id: str
    generation: int
    gpus: tuple[GpuView, ...]
    slots: tuple[SlotView, ...] = ()
    instances: tuple[InstanceView, ...] = ()
    models: Mapping[str, CatalogEntry] = field(default_factory=dict)
    backend: str = ""
    version: str = ""
    fetches: tuple[FetchView, ...] = ()
    store: tuple[int, int, int] = (0, 0, 0)  # used bytes, budget bytes (0: none), evictions

    def slot(self, slot_id: str) -> SlotView | None:
        return next((s for s in self.slots if s.slot_id == slot_id), None)


def gpu_from_pb(g: Any) -> GpuView:
    """A ``GpuInfo`` (free memory capped at the GPU's size)."""
    return GpuView(
        index=int(g.index),
        memory_bytes=int(g.memory_bytes),
        free_bytes=min(int(g.free_bytes), int(g.memory_bytes)),
        state=worker_state(int(g.state)),
        slot_ids=tuple(g.slot_ids),
        instance_id=g.instance_id,
    )


def slot_from_pb(s: Any) -> SlotView:
    """A ``SlotInfo``: in ``Describe`` and in the last message of a ``Prewarm`` stream."""
    return SlotView(
        slot_id=s.slot_id,
        model=s.model,
        gpus=tuple(sorted(int(x) for x in s.gpus)),
        layers_resident=int(s.layers_resident),
        layers_total=int(s.layers_total),
        layers_target=int(s.layers_target),
        resident_bytes_per_gpu=int(s.resident_bytes_per_gpu),
        weight_bytes_per_gpu=int(s.weight_bytes_per_gpu),
        state=slot_state(int(s.state)),
        owner=s.owner,
    )


def instance_from_pb(i: Any) -> InstanceView:
    """An ``InstanceInfo``: in ``Describe`` and in an ``Activate`` answer."""
    return InstanceView(
        instance_id=i.instance_id,
        model=i.model,
        gpus=tuple(sorted(int(x) for x in i.gpus)),
        endpoint=i.endpoint,
        phase=instance_phase(int(i.phase)),
        running=int(i.running),
        waiting=int(i.waiting),
        max_batch=int(i.max_batch),
        kv_capacity_bytes=int(i.kv_capacity_bytes),
        kv_used_bytes=int(i.kv_used_bytes),
        lendable_bytes=int(i.lendable_bytes),
        lent_bytes=int(i.lent_bytes),
        prewarm_hit=bool(i.prewarm_hit),
        slot_id=i.slot_id,
        started_unix=float(i.started_unix),
        engine=i.engine,
        ttft_p95_s=float(i.ttft_p95_seconds),
        ttft_samples=int(i.ttft_samples),
        ttft_window_s=float(i.ttft_window_seconds),
        owner=i.owner,
        grace_started_unix=float(i.grace_started_unix),
    )


_STAGES = (
    ("process_taken", "process"),
    ("engine_ready", "engine"),
    ("weights_resident", "weights"),
    ("kv_mapped", "KV"),
    ("endpoint_up", "endpoint"),
    ("first_token", "first token"),
)


def activation_from_pb(resp: Any) -> ActivateResult:
    """An ``ActivateResponse``."""
    st = resp.instance.stages
    return ActivateResult(
        instance_from_pb(resp.instance),
        bool(resp.prewarm_hit),
        float(resp.activation_seconds),
        tuple(resp.evicted_slot_ids),
        tuple(
            (short, float(getattr(st, f"{name}_seconds")))
            for name, short in _STAGES
            if st.HasField(f"{name}_seconds")
        ),
        bool(st.engine_prepared),
    )


def snapshot_from_pb(node: str, desc: Any) -> NodeSnapshot:
    """Convert a ``warmserve.agent.v1.NodeDescription`` into a :class:`NodeSnapshot`."""
    models = {
        m.name: CatalogEntry(
            m.name, int(m.weight_bytes), int(m.num_layers), m.source, int(m.disk_bytes),
            profile_from_pb(m.profile) if m.HasField("profile") else None,
            int(m.attention_heads), int(m.kv_heads),
        )
        for m in desc.models
    }
    store = desc.store
    return NodeSnapshot(
        node=node,
        agent_id=desc.agent_id,
        generation=int(desc.generation),
        gpus=tuple(gpu_from_pb(g) for g in desc.gpus),
        slots=tuple(slot_from_pb(s) for s in desc.slots),
        instances=tuple(instance_from_pb(i) for i in desc.instances),
        models=models,
        backend=desc.backend,
        version=desc.agent_version,
        fetches=tuple(fetch_from_pb(f) for f in desc.fetches),
        store=(int(store.used_bytes), int(store.budget_bytes), int(store.evictions)),
    )
