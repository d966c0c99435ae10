"""The node core's state machine base: GPU worker states and their Figure 5 edges (WarmServe §4).

:class:`NodeState` holds what every part of the node core shares: the GPU worker records, the
prewarm slots and instances, the event bus, the validation helpers that turn bad requests into
:class:`~warmserve_agent.node_records.Refusal` before anything changes, and the only way a
worker changes state (:meth:`NodeState._transition`, along Figure 5's edges in :data:`ALLOWED`)::

    idle ──prewarm──▶ universal ──activate──▶ dedicated ──grace──▶ grace ──end──▶ universal | idle
      └──────────────── activate (cold start) ──────▶┘               └─prewarm (lent memory)─┘

Slot groups must nest (evict-aware placement, §5.2, Algorithm 1): a new slot's GPU set must
contain or be contained in the set of every slot it overlaps (:meth:`NodeState._check_nesting`).

The operations build on it in layers (one module per concept): grace lending (Eq. 1,
:mod:`~warmserve_agent.grace_lending`), prewarm slots (:mod:`~warmserve_agent.prewarm_slots`),
activation (:mod:`~warmserve_agent.activation`) and :class:`~warmserve_agent.node.NodeCore`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from warmserve.engine_args import DEFAULT_POLICY, EngineArgPolicy
from warmserve.policy.cluster import WorkerState
from warmserve_agent.engines import DEFAULT_ENGINE, ENGINES
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node_records import (
    ID_RE,
    INSTANCE_ID_RE,
    SLOT_ID_RE,
    EngineFactory,
    Event,
    GpuRec,
    InstanceRec,
    Refusal,
    SlotRec,
)
from warmserve_agent.safe_text import shown
from warmserve_agent.store import SlotLayout, StoreError, UnknownModel, WeightStore

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core

# Figure 5 transitions.  "crash" transitions (dedicated/grace -> universal/idle when the worker
# hosting the engine dies) are applied only by ``worker_died``.
ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.IDLE: frozenset({WorkerState.UNIVERSAL, WorkerState.DEDICATED}),
    WorkerState.UNIVERSAL: frozenset(
        {WorkerState.UNIVERSAL, WorkerState.IDLE, WorkerState.DEDICATED}
    ),
    WorkerState.DEDICATED: frozenset({WorkerState.GRACE}),
    WorkerState.GRACE: frozenset({WorkerState.GRACE, WorkerState.UNIVERSAL, WorkerState.IDLE}),
}
CRASH_ALLOWED = frozenset({WorkerState.UNIVERSAL, WorkerState.IDLE})


class IllegalTransition(RuntimeError):
    """A bug: the core tried a transition Figure 5 does not have (never half-applied)."""


class NodeState:
    """Shared state, events, validation and Figure 5 transitions of one node's GPUs."""

    def __init__(
        self,
        mm: MemoryManager,
        store: WeightStore,
        gpu_memory: dict[int, int],
        engine_factory: EngineFactory,
        *,
        node_name: str = "node",
        engine_host: str = "127.0.0.1",
        advertise_host: str = "",
        engines: Sequence[str] = (DEFAULT_ENGINE,),
        default_engine: str = "",
        engine_policy: EngineArgPolicy = DEFAULT_POLICY,
    ) -> None:
        unknown = [e for e in engines if e not in ENGINES]
        if unknown or not engines:
            raise ValueError(f"unknown engine(s) {unknown}; engines: {sorted(ENGINES)}")
        self.engines = tuple(engines)  # what this node's workers can host
        self.default_engine = default_engine or self.engines[0]
        if self.default_engine not in self.engines:
            raise ValueError(f"default engine {self.default_engine!r} is not in {self.engines}")
        self.engine_policy = engine_policy  # what an Activate's engine_args may contain
        self.engine_host = engine_host  # where engines bind their HTTP endpoint
        self.advertise_host = advertise_host or engine_host  # what Activate returns
        self.mm = mm
        self.store = store
        self.node_name = node_name
        self.engine_factory = engine_factory
        self.page = mm.page_bytes
        self.gpus: dict[int, GpuRec] = {}
        mm.add_gpus(dict(sorted(gpu_memory.items())))  # in parallel (GPU nodes: seconds each)
        for g in sorted(gpu_memory):
            self.gpus[g] = GpuRec(g, mm.num_pages(g) * self.page)
        self.slots: dict[str, SlotRec] = {}
        self.instances: dict[str, InstanceRec] = {}
        self.generation = 0
        self._lock = threading.RLock()
        self._listeners: list[Callable[[Event], None]] = []
        self._emit_lock = threading.Lock()
        self.activation_log: list[tuple[bool, float]] = []  # (hit, seconds) for metrics
        # Called with the GPUs of an instance that ended normally (the server recycles their
        # worker processes here when configured to).
        self.on_instance_ended: Callable[[tuple[int, ...]], None] | None = None

    # ---- events ----------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def emit(self, kind: str, subject: str, message: str = "") -> None:
        """Publish an event that happened outside the core (e.g. a worker was replaced)."""
        self._emit(kind, subject, message)

    def _emit(self, kind: str, subject: str, message: str = "") -> None:
        with self._emit_lock:  # loader threads emit too
            self.generation += 1
            ev = Event(kind, self.generation, subject, message)
        for fn in list(self._listeners):
            try:
                fn(ev)
            except Exception:  # a listener must never break the state machine
                log.exception("event=listener_failed kind=%s", kind)

    # ---- validation helpers ----------------------------------------------------------------
    def _model_layout(self, model: str, tp: int) -> SlotLayout:
        try:
            return self.store.layout(model, tp)
        except UnknownModel as exc:
            raise Refusal("NOT_FOUND", str(exc)) from None
        except StoreError as exc:
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None

    @staticmethod
    def _check_owner(owner: str) -> None:
        if owner and not ID_RE.match(owner):
            raise Refusal(
                "INVALID_ARGUMENT",
                "owner must be empty or 1-128 characters of [A-Za-z0-9._:-] "
                f"(got {len(owner)} characters)",
            )

    def _check_gpus(self, gpus: Iterable[int]) -> tuple[int, ...]:
        gl = list(gpus)
        if not gl:
            raise Refusal("INVALID_ARGUMENT", "name at least one GPU (gpus is empty)")
        if len(set(gl)) != len(gl):
            raise Refusal("INVALID_ARGUMENT", f"GPU group {shown(gl)} names a GPU twice")
        missing = [g for g in gl if g not in self.gpus]
        if missing:
            raise Refusal(
                "INVALID_ARGUMENT",
                f"GPU(s) {shown(missing)} are not on node {self.node_name}, which has GPUs "
                f"{sorted(self.gpus)}; send the request to the node that owns them",
            )
        down = [g for g in gl if not self.gpus[g].available]
        if down:
            raise Refusal(
                "UNAVAILABLE",
                f"GPU(s) {down} lost their worker process and are being reset; retry shortly",
            )
        return tuple(sorted(gl))

    def _check_slot_id(self, slot_id: str) -> SlotRec:
        if not SLOT_ID_RE.match(slot_id or ""):
            raise Refusal(
                "INVALID_ARGUMENT",
                f"malformed slot id {shown(slot_id)}: slot ids look like slot-0123456789ab "
                "(take them from Describe or Prewarm)",
            )
        slot = self.slots.get(slot_id)
        if slot is None:
            raise Refusal("NOT_FOUND", f"no slot {slot_id} on node {self.node_name}")
        return slot

    def _check_instance_id(self, instance_id: str) -> InstanceRec:
        if not INSTANCE_ID_RE.match(instance_id or ""):
            raise Refusal(
                "INVALID_ARGUMENT",
                f"malformed instance id {shown(instance_id)}: instance ids look like "
                "inst-0123456789ab (take them from Activate or Describe)",
            )
        inst = self.instances.get(instance_id)
        if inst is None:
            raise Refusal("NOT_FOUND", f"no instance {instance_id} on node {self.node_name}")
        return inst

    def _transition(self, gpus: Iterable[int], new: WorkerState, *, crash: bool = False) -> None:
        """Move GPUs to ``new``; all-or-nothing, and only along Figure 5's edges."""
        recs = [self.gpus[g] for g in gpus]
        for r in recs:
            ok = new in (CRASH_ALLOWED if crash else ALLOWED[r.state])
            if not ok and r.state != new:
                raise IllegalTransition(f"gpu {r.index}: {r.state.value} -> {new.value}")
        for r in recs:
            if r.state != new:
                r.state = new
                self._emit("gpu", str(r.index), new.value)

    def _rest_state(self, g: int) -> WorkerState:
        """Universal if any slot touches the GPU, else idle (after an instance or eviction)."""
        return (
            WorkerState.UNIVERSAL
            if any(g in s.gpus for s in self.slots.values())
            else WorkerState.IDLE
        )

    def _check_nesting(self, gpus: tuple[int, ...], ignore: Iterable[str] = ()) -> None:
        new = set(gpus)
        skip = set(ignore)
        for s in self.slots.values():
            if s.slot_id in skip:
                continue
            other = set(s.gpus)
            if new & other and not (new <= other or other <= new):
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"GPU group {list(gpus)} overlaps slot {s.slot_id} ({s.model} on GPUs "
                    f"{list(s.gpus)}) without containing it or being contained in it; groups "
                    "on a node must nest (evict-aware placement) — evict that slot or choose "
                    "a nested group",
                )

    # ---- slot bookkeeping ------------------------------------------------------------------
    def _instance_of_slot(self, slot_id: str) -> InstanceRec | None:
        for inst in self.instances.values():
            if inst.slot_id == slot_id:
                return inst
        return None

    def _destroy_slot(self, slot: SlotRec) -> None:
        slot.cancel.set()
        if slot.loader is not None and slot.loader is not threading.current_thread():
            slot.loader.join()
        self.mm.destroy_slot(slot.slot_id)
        del self.slots[slot.slot_id]
        self._emit("slot_removed", slot.slot_id)
