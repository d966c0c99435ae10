"""Typed records of the node core: GPU workers, prewarm slots, instances, events and refusals.

WarmServe §4 (Fig. 5): a GPU worker is idle, universal (holding the first layers of one or more
models in **prewarm slots**), dedicated (serving one instance) or in a **grace** period (draining,
lending KV pages for proactive prewarming, Eq. 1).  :class:`GpuRec` is one worker, :class:`SlotRec`
one prewarm slot (a CUDA VMM virtual range on a GPU group, filled layer by layer),
:class:`InstanceRec` one serving instance with its KV pages and Eq. 1 reservation target.
:class:`Refusal` is how every call of the node core says no (a gRPC status name and an actionable
message); the id patterns are the wire forms the gRPC service validates too.  States are enums
here (:class:`~warmserve.policy.cluster.WorkerState`, :class:`~warmserve.api.agent.wire.SlotState`,
:class:`~warmserve.policy.cluster.InstancePhase`, :class:`EventKind`); they become protobuf values
only in :mod:`~warmserve.api.agent.wire`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from warmserve.api.agent.wire import SlotState
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.activation_stages import ActivationStages
from warmserve_agent.engine import EngineHost
from warmserve_agent.engines import DEFAULT_ENGINE
from warmserve_agent.engines.spec import EngineStats
from warmserve_agent.store import SlotLayout

if TYPE_CHECKING:
    from warmserve_agent.kv_range import KvRange

ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SLOT_ID_RE = re.compile(r"^slot-[0-9a-f]{12}$")
INSTANCE_ID_RE = re.compile(r"^inst-[0-9a-f]{12}$")


class Refusal(Exception):
    """A request the node cannot honour; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


InstanceEngine = EngineHost  # the one engine protocol (warmserve_agent.engine), as hosted
EngineFactory = Callable[[Sequence[int]], EngineHost]


@dataclass
class SlotRec:
    slot_id: str
    model: str
    gpus: tuple[int, ...]
    layout: SlotLayout
    layers_target: int
    layers_resident: int = 0
    state: SlotState = SlotState.LOADING
    message: str = ""
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    cancel: threading.Event = field(default_factory=threading.Event)
    loader: threading.Thread | None = None
    loader_active: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # state/target vs the loader
    owner: str = ""  # opaque, set by the client (the operator: the ModelDeployment's UID)

    @property
    def layers_total(self) -> int:
        return self.layout.model.num_layers

    @property
    def resident_bytes(self) -> int:
        return self.layout.bytes_for_layers(self.layers_resident)

    @property
    def bandwidth(self) -> float:
        return self.bytes_loaded * len(self.gpus) / self.load_seconds if self.load_seconds else 0.0


@dataclass
class InstanceRec:
    instance_id: str
    model: str
    gpus: tuple[int, ...]
    slot_id: str
    engine: InstanceEngine
    max_batch: int
    weight_pages: int
    kv_pages_initial: int
    kv_pages: int
    phase: InstancePhase = InstancePhase.STARTING
    endpoint: str = ""
    prewarm_hit: bool = False
    started_unix: float = field(default_factory=time.time)
    activation_seconds: float = 0.0
    last_stats: EngineStats = field(default_factory=EngineStats)
    engine_name: str = DEFAULT_ENGINE
    reservation_target: int = 0  # per GPU, bytes (grace only)
    owner: str = ""  # as SlotRec.owner
    grace_started_unix: float = 0.0  # when BeginGrace took effect
    engine_args: tuple[str, ...] = ()
    stages: ActivationStages = field(default_factory=ActivationStages)
    activated_at: float = 0.0  # time.perf_counter() when Activate began (stages count from it)
    # the KV range: pages mapped in the background, capacity granted (kv_range.py); kv_pages
    # above is how many of its pages are mapped now
    kv: KvRange | None = None


@dataclass
class GpuRec:
    index: int
    memory_bytes: int
    state: WorkerState = WorkerState.IDLE
    instance_id: str = ""
    available: bool = True  # False while a memory-owning worker is being replaced


class EventKind(StrEnum):
    """What an :class:`Event` is about (the Watch stream's kinds)."""

    GPU = "gpu"
    SLOT = "slot"
    SLOT_REMOVED = "slot_removed"
    INSTANCE = "instance"
    INSTANCE_REMOVED = "instance_removed"
    WORKER_REPLACED = "worker_replaced"
    FETCH = "fetch"


@dataclass(frozen=True)
class Event:
    kind: EventKind
    generation: int
    subject: str
    message: str = ""
