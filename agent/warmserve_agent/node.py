"""The node agent's core: GPU worker states, prewarm slots, instances (WarmServe §4, Fig. 5-6).

:class:`NodeCore` is the synchronous, thread-safe state machine behind the gRPC service.  It owns
the page tables (:class:`~warmserve_agent.memory.MemoryManager`), the weight store and one
:class:`InstanceEngine` per serving instance, and enforces the worker lifecycle of Figure 5::

    idle ──prewarm──▶ universal ──activate──▶ dedicated ──grace──▶ grace ──end──▶ universal | idle
      └──────────────── activate (cold start) ──────▶┘               └─prewarm (lent memory)─┘

Every call validates everything before it changes anything, so a refused call leaves the node as
it was; refusals raise :class:`Refusal` with a gRPC status name and a message a person can act
on.  Long work (copying weights) runs in loader threads outside the state lock; the loader only
touches its own slot's progress fields and the event bus.

Memory rules (§4.2):
* prewarm: a slot on a GPU group gets its weights (first N layers) at the start of its virtual
  range; pages come from the free pool (idle/universal GPUs) or from KV pages a grace instance
  gave back (Eq. 1, via :func:`warmserve.policy.proactive.reservation_target`).
* activate: every other slot touching the group is evicted, the chosen slot's weight range is
  mapped in full (the rest of a partial prewarm keeps loading while it serves) and every page
  left is mapped after the weights as KV cache.
* grace: the instance keeps its Eq. 1 reservation target; surplus KV pages are unmapped from the
  tail of its slot and returned to the pool, where prewarms can take them (Fig. 6b).
* end: KV pages are unmapped; the instance's weights stay as a ready slot (unless evicted), so
  the GPU becomes universal holding the old model and any model prewarmed during grace.
* Slot groups must nest (evict-aware placement, §5.2): a new slot's GPU set must contain or be
  contained in the set of every slot it overlaps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmserve.engine_args import EngineArgsError, validate_engine_args
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve.policy.proactive import reservation_target
from warmserve_agent.engine import Engine, WeightsMismatch
from warmserve_agent.engines import DEFAULT_ENGINE, ENGINES
from warmserve_agent.engines.spec import (
    EngineProfile,
    EngineSpec,
    EngineStats,
    SlotRegion,
    TensorPlacement,
)
from warmserve_agent.loader import LoadCancelled, load_layers
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.safe_text import shown
from warmserve_agent.store import SlotLayout, StoreError, UnknownModel, WeightStore

log = logging.getLogger("warmserve.agent.node")

ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SLOT_ID_RE = re.compile(r"^slot-[0-9a-f]{12}$")
INSTANCE_ID_RE = re.compile(r"^inst-[0-9a-f]{12}$")

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


class Refusal(Exception):
    """A request the node cannot honour; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class IllegalTransition(RuntimeError):
    """A bug: the core tried a transition Figure 5 does not have (never half-applied)."""


InstanceEngine = Engine  # the one engine protocol (warmserve_agent.engine)
EngineFactory = Callable[[Sequence[int]], Engine]


@dataclass
class SlotRec:
    slot_id: str
    model: str
    gpus: tuple[int, ...]
    layout: SlotLayout
    layers_target: int
    layers_resident: int = 0
    state: str = "loading"  # loading | ready | active | failed
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


@dataclass
class GpuRec:
    index: int
    memory_bytes: int
    state: WorkerState = WorkerState.IDLE
    instance_id: str = ""
    available: bool = True  # False while a memory-owning worker is being replaced


@dataclass(frozen=True)
class Event:
    kind: str  # gpu | slot | slot_removed | instance | instance_removed | worker_replaced
    generation: int
    subject: str
    message: str = ""


class NodeCore:
    """State machine of one node's GPUs (see module docstring)."""

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
    ) -> None:
        unknown = [e for e in engines if e not in ENGINES]
        if unknown or not engines:
            raise ValueError(f"unknown engine(s) {unknown}; engines: {sorted(ENGINES)}")
        self.engines = tuple(engines)  # what this node's workers can host
        self.default_engine = default_engine or self.engines[0]
        if self.default_engine not in self.engines:
            raise ValueError(f"default engine {self.default_engine!r} is not in {self.engines}")
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

    # ---- grace lending (Eq. 1) -------------------------------------------------------------
    def _refresh_grace(self, inst: InstanceRec) -> None:
        """Shrink (or regrow) a grace instance's KV cache to its Eq. 1 reservation target.

        Called on a timer (the paper checks when each request completes), before prewarming
        into a grace GPU and when lendable memory is queried.  The engine has the last word on
        how far it can shrink (admitted requests keep their KV); only pages beyond what it
        accepted are unmapped.
        """
        if inst.phase != InstancePhase.GRACE:
            return
        st = inst.engine.stats()
        inst.last_stats = st
        tp = len(inst.gpus)
        m_gpu = inst.kv_pages_initial * self.page
        k_gpu = min(math.ceil(st.kv_used_bytes / tp), m_gpu)
        target = reservation_target(st.running, inst.max_batch, m_gpu, k_gpu)
        inst.reservation_target = target
        want = pages_for(target, self.page)
        cur = inst.kv_pages
        if want < cur:
            accepted = inst.engine.set_kv_capacity(want * self.page * tp)
            keep = max(want, pages_for(math.ceil(accepted / tp), self.page))
            if keep < cur:
                self.mm.unmap_range(inst.slot_id, inst.weight_pages + keep, cur - keep)
                inst.kv_pages = keep
                self._emit("instance", inst.instance_id, f"lent {cur - keep} KV pages")
        elif want > cur:
            grow = min(want - cur, min(self.mm.available_pages(g) for g in inst.gpus))
            if grow > 0:
                self.mm.map_range(inst.slot_id, inst.weight_pages + cur, grow)
                inst.kv_pages = cur + grow
                inst.engine.set_kv_capacity(inst.kv_pages * self.page * tp)
                self._emit("instance", inst.instance_id, f"took back {grow} KV pages")

    def refresh_grace_all(self) -> None:
        with self._lock:
            for inst in list(self.instances.values()):
                try:
                    self._refresh_grace(inst)
                except Exception as exc:  # engine gone: worker_died handles it
                    log.warning(
                        "event=grace_refresh_failed instance=%s err=%s", inst.instance_id, exc
                    )

    def lendable(self, instance_ids: Sequence[str] = ()) -> list[dict[str, Any]]:
        with self._lock:
            ids = list(instance_ids) or [
                i.instance_id for i in self.instances.values() if i.phase == InstancePhase.GRACE
            ]
            out = []
            for iid in ids:
                inst = self._check_instance_id(iid)
                if inst.phase != InstancePhase.GRACE:
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"instance {iid} is {inst.phase.value}, not in a grace period; only grace "
                        "instances lend memory (call BeginGrace first)",
                    )
                self._refresh_grace(inst)
                st = inst.last_stats
                tp = len(inst.gpus)
                out.append(
                    {
                        "instance_id": iid,
                        "model": inst.model,
                        "gpus": inst.gpus,
                        "running": st.running,
                        "max_batch": inst.max_batch,
                        "kv_capacity_bytes": inst.kv_pages_initial * self.page,
                        "kv_used_bytes": math.ceil(st.kv_used_bytes / tp),
                        "reservation_target_bytes": inst.reservation_target,
                        "lendable_bytes": min(self.mm.available_pages(g) for g in inst.gpus)
                        * self.page,
                        "lent_bytes": (inst.kv_pages_initial - inst.kv_pages) * self.page,
                    }
                )
            return out

    # ---- prewarm ---------------------------------------------------------------------------
    def prewarm(self, model: str, gpus: Iterable[int], layers: int = 0, owner: str = "") -> SlotRec:
        """Admit a prewarm and start its loader; returns the (loading) slot."""
        with self._lock:
            self._check_owner(owner)
            group = self._check_gpus(gpus)
            layout = self._model_layout(model, len(group))
            n = layout.model.num_layers
            if layers < 0 or layers > n:
                raise Refusal(
                    "INVALID_ARGUMENT",
                    f"layers must be 0 (all) or 1..{n} for {model}, which has {n} layers; "
                    f"got {layers}",
                )
            target = layers or n
            for g in group:
                rec = self.gpus[g]
                if rec.state == WorkerState.DEDICATED:
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"GPU {g} is dedicated to instance {rec.instance_id}; a serving GPU "
                        "cannot prewarm until its instance enters a grace period (BeginGrace)",
                    )
            self._check_nesting(group)
            for s in self.slots.values():
                if s.model == model and set(s.gpus) & set(group):
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"{model} is already resident in slot {s.slot_id} on GPUs "
                        f"{list(s.gpus)}; activate that slot or evict it first",
                    )
            need = pages_for(layout.bytes_for_layers(target), self.page)
            for g in group:
                inst = self.instances.get(self.gpus[g].instance_id)
                if inst is not None:
                    self._refresh_grace(inst)
            short = [
                (g, self.mm.available_pages(g)) for g in group if self.mm.available_pages(g) < need
            ]
            if short:
                g, have = short[0]
                raise Refusal(
                    "RESOURCE_EXHAUSTED",
                    f"{model} ({target} of {n} layers) needs {need} pages "
                    f"({need * self.page} bytes) per GPU; GPU {g} has {have} free "
                    f"({have * self.page} bytes). Evict slots on it, prewarm fewer layers, "
                    "or use a larger GPU group",
                )
            slot_id = f"slot-{uuid.uuid4().hex[:12]}"
            self.mm.create_slot(slot_id, group)
            self.mm.promise(slot_id, need)
            slot = SlotRec(slot_id, model, group, layout, target, owner=owner)
            self.slots[slot_id] = slot
            self._transition(
                [g for g in group if self.gpus[g].state == WorkerState.IDLE],
                WorkerState.UNIVERSAL,
            )
            self._emit("slot", slot_id, "prewarm admitted")
            self._start_loader(slot)
            return slot

    def _start_loader(self, slot: SlotRec) -> None:
        """Start the slot's loader unless one is running; a running loader picks up a raised
        target itself (it re-checks the target under ``slot.lock`` before it exits)."""
        with slot.lock:
            if slot.loader_active or slot.layers_resident >= slot.layers_target:
                return
            slot.loader_active = True
            t = threading.Thread(target=self._load, args=(slot,), daemon=True, name=slot.slot_id)
            slot.loader = t
            t.start()

    def _load(self, slot: SlotRec) -> None:
        """Loader thread: copy layers until the target is resident (target may grow)."""
        base_bytes = slot.bytes_loaded
        base_s = slot.load_seconds

        def on_layer(n: int, nbytes: int, secs: float) -> None:
            slot.layers_resident = n
            slot.bytes_loaded = base_bytes + nbytes
            slot.load_seconds = base_s + secs
            inst = self._instance_of_slot(slot.slot_id)
            if inst is not None and inst.phase != InstancePhase.STARTING:
                try:
                    inst.engine.layers_ready(n)
                except WeightsMismatch:
                    raise  # the slot's bytes are wrong: fail the slot
                except Exception as exc:  # engine ended or died meanwhile; the bytes are fine
                    log.warning("event=layers_ready_failed slot=%s err=%s", slot.slot_id, exc)
            self._emit("slot", slot.slot_id, f"{n}/{slot.layers_total} layers")

        try:
            while True:
                with slot.lock:
                    if slot.cancel.is_set() or slot.layers_resident >= slot.layers_target:
                        slot.loader_active = False
                        if slot.state == "loading" and not slot.cancel.is_set():
                            slot.state = "ready"
                            if self.mm.has_slot(slot.slot_id):
                                self.mm.release_promise(slot.slot_id)
                            ready = True
                        else:
                            ready = False
                        break
                    start, end = slot.layers_resident, slot.layers_target
                load_layers(
                    self.mm,
                    self.store,
                    slot.slot_id,
                    slot.layout,
                    slot.gpus,
                    start,
                    end,
                    cancel=slot.cancel,
                    on_layer=on_layer,
                )
                base_bytes, base_s = slot.bytes_loaded, slot.load_seconds
        except Exception as exc:
            with slot.lock:
                slot.loader_active = False
                if isinstance(exc, LoadCancelled) or slot.cancel.is_set():
                    return
                slot.state = "failed"
                slot.message = f"loading failed: {exc}"
            log.error("event=load_failed slot=%s err=%s", slot.slot_id, exc)
            self._emit("slot", slot.slot_id, slot.message)
            return
        if ready:
            self._emit("slot", slot.slot_id, "ready")

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

    # ---- evict -----------------------------------------------------------------------------
    def evict(self, slot_id: str) -> tuple[SlotRec, int]:
        with self._lock:
            slot = self._check_slot_id(slot_id)
            inst = self._instance_of_slot(slot_id)
            if inst is not None:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"slot {slot_id} is serving instance {inst.instance_id}; end the instance "
                    "first (BeginGrace, then EndInstance with evict_weights)",
                )
            freed = self.mm.mapped_count(slot_id, slot.gpus[0])
            self._destroy_slot(slot)
            for g in slot.gpus:
                if self.gpus[g].state == WorkerState.UNIVERSAL:
                    self._transition([g], self._rest_state(g))
            return slot, freed

    # ---- activate --------------------------------------------------------------------------
    def check_engine(self, engine: str, args: Sequence[str]) -> str:
        """The engine an Activate names (default: the node's), refused unless it is hosted here
        and ``args`` pass the engine-args schema; no state is read or changed."""
        name = engine or self.default_engine
        if name not in ENGINES:
            raise Refusal(
                "INVALID_ARGUMENT", f"unknown engine {name!r}; engines: {', '.join(ENGINES)}"
            )
        if name not in self.engines:
            raise Refusal(
                "FAILED_PRECONDITION",
                f"engine {name!r} is not enabled on node {self.node_name} (it hosts "
                f"{', '.join(self.engines)}; start the agent with --engines including {name})",
            )
        try:
            validate_engine_args(list(args))
        except EngineArgsError as exc:
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None
        return name

    def activate(
        self,
        model: str,
        gpus: Iterable[int],
        slot_id: str = "",
        engine: str = "",
        engine_args: Sequence[str] = (),
        owner: str = "",
    ) -> tuple[InstanceRec, list[str]]:
        """Start an instance of ``model`` on ``gpus`` (prewarm hit if a slot holds it) with
        ``engine`` (default: the node's) and vLLM-style ``engine_args``."""
        t0 = time.perf_counter()
        with self._lock:
            self._check_owner(owner)
            group = self._check_gpus(gpus)
            layout = self._model_layout(model, len(group))
            engine_name = self.check_engine(engine, engine_args)
            for g in group:
                rec = self.gpus[g]
                if rec.state in (WorkerState.DEDICATED, WorkerState.GRACE):
                    what = "serving" if rec.state == WorkerState.DEDICATED else "draining (grace)"
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"GPU {g} is {what} instance {rec.instance_id}; end it before activating "
                        "another instance on this GPU",
                    )
            chosen: SlotRec | None = None
            if slot_id:
                chosen = self._check_slot_id(slot_id)
                if chosen.model != model or chosen.gpus != group:
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"slot {slot_id} holds {chosen.model} on GPUs {list(chosen.gpus)}, not "
                        f"{model} on {list(group)}; omit slot_id to let the agent choose",
                    )
            else:
                chosen = next(
                    (
                        s
                        for s in self.slots.values()
                        if s.model == model and s.gpus == group and s.state != "failed"
                    ),
                    None,
                )
            if chosen is not None and chosen.state == "failed":
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"slot {chosen.slot_id} failed ({chosen.message}); evict it and retry",
                )
            weight_pages = pages_for(layout.total_bytes, self.page)
            pages = min(self.mm.num_pages(g) for g in group)
            if weight_pages + 1 > pages:
                raise Refusal(
                    "RESOURCE_EXHAUSTED",
                    f"{model} needs {weight_pages} pages ({weight_pages * self.page} bytes) per "
                    f"GPU for weights plus KV cache on a group of {len(group)}, but a GPU has "
                    f"{pages} pages; use a larger tensor-parallel group",
                )
            # Validated: apply.
            evict = [s for s in self.slots.values() if s is not chosen and set(s.gpus) & set(group)]
            for s in evict:
                self._destroy_slot(s)
            for s in evict:  # GPUs outside the group that lost their last slot
                for g in s.gpus:
                    if g not in group and self.gpus[g].state == WorkerState.UNIVERSAL:
                        self._transition([g], self._rest_state(g))
            hit = chosen is not None
            if chosen is None:
                sid = f"slot-{uuid.uuid4().hex[:12]}"
                self.mm.create_slot(sid, group)
                chosen = SlotRec(sid, model, group, layout, layout.model.num_layers)
                self.slots[sid] = chosen
            with chosen.lock:
                chosen.layers_target = layout.model.num_layers
                chosen.state = "active"
                chosen.owner = owner  # the slot now belongs to the instance's owner
            self.mm.promise(
                chosen.slot_id, weight_pages - self.mm.mapped_prefix(chosen.slot_id, group[0])
            )
            self.mm.ensure_mapped(chosen.slot_id, weight_pages)
            self.mm.release_promise(chosen.slot_id)
            kv_pages = self.mm.map_all_free(chosen.slot_id, weight_pages)
            iid = f"inst-{uuid.uuid4().hex[:12]}"
            engine = self.engine_factory(group)
            inst = InstanceRec(
                iid,
                model,
                group,
                chosen.slot_id,
                engine,
                layout.model.profile.max_batch,
                weight_pages,
                kv_pages,
                kv_pages,
                prewarm_hit=hit,
                engine_name=engine_name,
                owner=owner,
            )
            self.instances[iid] = inst
            for g in group:
                self.gpus[g].instance_id = iid
            self._transition(group, WorkerState.DEDICATED)
            self._emit("instance", iid, "starting")
            self._start_loader(chosen)  # cold start, or the rest of a partial prewarm
            try:
                inst.endpoint = engine.start(self._engine_spec(inst, chosen, tuple(engine_args)))
                inst.max_batch = engine.stats().max_batch or inst.max_batch  # C of Eq. 1
                inst.phase = InstancePhase.SERVING
                if chosen.layers_resident > 0:
                    engine.layers_ready(chosen.layers_resident)
            except Refusal:
                self._abort_instance(inst, "engine cannot be hosted")
                raise
            except Exception as exc:
                self._abort_instance(inst, f"engine failed to start: {exc}")
                if "differ from the store" in str(exc):  # the slot's bytes are bad: keep it
                    with chosen.lock:  # out of service until evicted
                        chosen.state = "failed"
                        chosen.message = f"weights failed verification: {exc}"
                    self._emit("slot", chosen.slot_id, chosen.message)
                raise Refusal(
                    "UNAVAILABLE", f"instance of {model} on GPUs {list(group)} failed: {exc}"
                ) from None
            inst.activation_seconds = time.perf_counter() - t0
            self.activation_log.append((hit, inst.activation_seconds))
            self._emit("instance", iid, "serving")
            log.info(
                "event=activated instance=%s model=%s gpus=%s hit=%s seconds=%.4f evicted=%d",
                iid,
                model,
                list(group),
                hit,
                inst.activation_seconds,
                len(evict),
            )
            return inst, [s.slot_id for s in evict]

    def _engine_spec(
        self, inst: InstanceRec, slot: SlotRec, engine_args: tuple[str, ...]
    ) -> EngineSpec:
        """What the engine needs to serve from the slot (typed; see engines/spec.py)."""
        backend = self.mm.backend
        path = getattr(backend, "path", None)
        in_workers = getattr(backend, "in_workers", False)
        if not in_workers and path is None:
            raise Refusal(
                "UNIMPLEMENTED",
                f"the {backend.name} backend in the agent process cannot host engines: its "
                "mappings belong to the agent; run with memory owned by the workers",
            )
        layout = slot.layout
        tp = len(inst.gpus)
        digests = [self.store.digests(layout, r) for r in range(tp)]
        prof = layout.model.profile
        mapped = inst.weight_pages + inst.kv_pages
        regions = tuple(
            SlotRegion(
                gpu=g,
                va=self.mm.va_base(slot.slot_id, g),
                page_bytes=self.page,
                weight_bytes=layout.total_bytes,
                kv_bytes=mapped * self.page - layout.total_bytes,
                local=r == 0,
                # The shared simulated file, readable by physical page from any process, when
                # the agent owns the memory; with memory in workers only the owner reads it.
                host_file="" if in_workers else str(path(g)),
                ppages=()
                if in_workers
                else tuple(self.mm.physical_pages(slot.slot_id, g, 0, mapped)),
            )
            for r, g in enumerate(inst.gpus)
        )
        return EngineSpec(
            engine=inst.engine_name,
            model=inst.model,
            instance_id=inst.instance_id,
            model_dir=str(layout.model.path),
            layers_total=layout.model.num_layers,
            layers_resident=slot.layers_resident,
            kv_capacity_bytes=inst.kv_pages * self.page * tp,
            regions=regions,
            tensors=tuple(
                TensorPlacement(
                    name=p.tensor.name,
                    layer=p.tensor.layer,
                    offset=p.slot_offset,
                    nbytes=p.tensor.nbytes,
                    dtype=p.tensor.dtype,
                    shape=p.tensor.shape,
                    shard_len=tuple(p.shard(r)[1] for r in range(tp)),
                )
                for p in layout.placements
            ),
            digests=tuple(tuple(d.hex() for d in ds) for ds in digests),
            profile=EngineProfile(
                max_batch=prof.max_batch,
                prefill_tok_s=prof.prefill_tok_s,
                decode_tok_s=prof.decode_tok_s,
                kv_bytes_per_token=prof.kv_bytes_per_token,
            ),
            engine_args=engine_args,
            host=self.engine_host,
            advertise_host=self.advertise_host,
        )

    def _abort_instance(self, inst: InstanceRec, why: str) -> None:
        """Tear an instance down after its engine failed or died (crash transition)."""
        self.instances.pop(inst.instance_id, None)  # first: loaders stop notifying it
        with contextlib.suppress(Exception):
            inst.engine.stop()
        slot = self.slots.get(inst.slot_id)
        if slot is not None and self.mm.has_slot(slot.slot_id):
            self.mm.unmap_range(slot.slot_id, inst.weight_pages, self.mm.num_pages(inst.gpus[0]))
            with slot.lock:
                slot.state = "ready" if not slot.loader_active else "loading"
        for g in inst.gpus:
            self.gpus[g].instance_id = ""
        for g in inst.gpus:
            self._transition([g], self._rest_state(g), crash=True)
        self._emit("instance_removed", inst.instance_id, why)
        log.warning("event=instance_aborted instance=%s why=%s", inst.instance_id, why)

    # ---- grace / end -----------------------------------------------------------------------
    def begin_grace(self, instance_id: str) -> InstanceRec:
        with self._lock:
            inst = self._check_instance_id(instance_id)
            if inst.phase != InstancePhase.SERVING:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"instance {instance_id} is {inst.phase.value}; only a serving instance "
                    "can begin a grace period",
                )
            self._transition(inst.gpus, WorkerState.GRACE)
            inst.phase = InstancePhase.GRACE
            inst.grace_started_unix = time.time()
            self._emit("instance", instance_id, "grace")
            self._refresh_grace(inst)
            return inst

    def end_instance(self, instance_id: str, evict_weights: bool = False) -> InstanceRec:
        with self._lock:
            inst = self._check_instance_id(instance_id)
            if inst.phase != InstancePhase.GRACE:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"instance {instance_id} is {inst.phase.value}; begin its grace period "
                    "first (BeginGrace) so in-flight requests drain",
                )
            del self.instances[instance_id]  # first: loaders stop notifying it
            try:
                inst.engine.stop()
            except Exception as exc:  # its worker died meanwhile: nothing left to stop
                log.warning("event=engine_stop_failed instance=%s err=%s", instance_id, exc)
            slot = self.slots[inst.slot_id]
            self.mm.unmap_range(slot.slot_id, inst.weight_pages, self.mm.num_pages(inst.gpus[0]))
            for g in inst.gpus:
                self.gpus[g].instance_id = ""
            if evict_weights:
                self._destroy_slot(slot)
            else:
                with slot.lock:
                    slot.state = "ready" if not slot.loader_active else "loading"
                self._emit("slot", slot.slot_id, "kept after instance ended")
            for g in inst.gpus:
                self._transition([g], self._rest_state(g))
            self._emit("instance_removed", instance_id, "ended")
            if self.on_instance_ended is not None:
                self.on_instance_ended(inst.gpus)
            return inst

    # ---- failures --------------------------------------------------------------------------
    def worker_died(self, gpu: int) -> str | None:
        """The worker process of ``gpu`` died: drop the instance it hosted (if any)."""
        with self._lock:
            iid = self.gpus[gpu].instance_id
            inst = self.instances.get(iid)
            if inst is None:
                return None
            self._abort_instance(inst, f"worker process of GPU {gpu} died")
            return iid

    def gpu_lost(self, gpu: int) -> tuple[list[str], list[str]]:
        """The memory of ``gpu`` died with its worker (memory owned by workers): drop every
        instance and slot touching it.  Returns (instance ids, slot ids) dropped.  The GPU
        refuses requests (UNAVAILABLE) until :meth:`gpu_restored`."""
        with self._lock:
            self.gpus[gpu].available = False
            lost_insts = []
            for inst in list(self.instances.values()):
                if gpu not in inst.gpus:
                    continue
                self.instances.pop(inst.instance_id)
                for g in inst.gpus:
                    self.gpus[g].instance_id = ""
                with contextlib.suppress(Exception):  # its engine may live on the dead worker
                    inst.engine.stop()
                lost_insts.append(inst.instance_id)
                self._emit("instance_removed", inst.instance_id, f"GPU {gpu}'s worker died")
            touched = [s for s in self.slots.values() if gpu in s.gpus]
            for s in touched:
                s.cancel.set()
            for s in touched:
                if s.loader is not None:
                    s.loader.join()
            dropped = self.mm.drop_gpu(gpu)
            affected = {gpu}
            for sid in dropped:
                slot = self.slots.pop(sid)
                affected.update(slot.gpus)
                self._emit("slot_removed", sid, f"GPU {gpu}'s memory was lost with its worker")
            # A lost instance's slot touched ``gpu``, so its GPUs are all in ``affected``.
            for g in sorted(affected):
                if not self.gpus[g].instance_id:  # GPUs still serving keep their state
                    self._transition([g], self._rest_state(g), crash=True)
            log.warning(
                "event=gpu_memory_lost gpu=%d instances=%s slots=%s", gpu, lost_insts, dropped
            )
            return lost_insts, dropped

    def gpu_restored(self, gpu: int) -> None:
        """A new worker owns ``gpu``: open an empty page pool and accept requests again."""
        with self._lock:
            self.mm.reopen_gpu(gpu)
            self.gpus[gpu].memory_bytes = self.mm.num_pages(gpu) * self.page
            self.gpus[gpu].available = True
            self._emit("gpu", str(gpu), "worker replaced; memory reset")

    # ---- introspection ---------------------------------------------------------------------
    def check(self) -> None:
        """Invariants beyond the page tables (tests call this after every step)."""
        with self._lock:
            self.mm.check()
            for g, rec in self.gpus.items():
                slots = [s for s in self.slots.values() if g in s.gpus]
                inst = self.instances.get(rec.instance_id)
                if rec.state == WorkerState.IDLE:
                    assert not slots and inst is None, f"gpu {g} idle but holds something"
                elif rec.state == WorkerState.UNIVERSAL:
                    assert slots and inst is None, f"gpu {g} universal without slots"
                elif rec.state == WorkerState.DEDICATED:
                    assert inst is not None and inst.phase != InstancePhase.GRACE
                    assert [s.slot_id for s in slots] == [inst.slot_id], f"gpu {g}: extra slots"
                else:
                    assert inst is not None and inst.phase == InstancePhase.GRACE
            for inst in self.instances.values():
                slot = self.slots[inst.slot_id]
                for g in inst.gpus:
                    assert (
                        self.mm.mapped_prefix(slot.slot_id, g) >= inst.weight_pages + inst.kv_pages
                    )
                    assert (
                        self.mm.mapped_count(slot.slot_id, g) == inst.weight_pages + inst.kv_pages
                    )

    def shutdown(self) -> None:
        with self._lock:
            for inst in list(self.instances.values()):
                with contextlib.suppress(Exception):
                    inst.engine.stop()
            for slot in self.slots.values():
                slot.cancel.set()
            for slot in self.slots.values():
                if slot.loader is not None:
                    slot.loader.join(10)
