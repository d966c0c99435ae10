"""The node's records and the only way they change state (WarmServe §4, Figure 5).

:class:`NodeState` holds what every collaborator of the node core works on: the GPU worker
records, the prewarm slots and instances, the lock that orders every change, the event bus, the
checks that turn bad requests into :class:`~warmserve_agent.node_records.Refusal` before
anything changes, and the only way a worker changes state (:meth:`NodeState.transition`, along
Figure 5's edges in :data:`ALLOWED`)::

    idle ──prewarm──▶ universal ──activate──▶ dedicated ──grace──▶ grace ──end──▶ universal | idle
      └──────────────── activate (cold start) ──────▶┘               └─prewarm (lent memory)─┘

Slot groups must nest (evict-aware placement, §5.2, Algorithm 1): a new slot's GPU set must
contain or be contained in the set of every slot it overlaps (:meth:`NodeState.check_nesting`).

It decides nothing itself: the grace lender (:mod:`~warmserve_agent.grace_lending`), the
prewarmer (:mod:`~warmserve_agent.prewarm_slots`) and the activator
(:mod:`~warmserve_agent.activation`) are handed this one object and change the records through
it, under :attr:`NodeState.lock`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from warmserve.policy.cluster import WorkerState
from warmserve_agent.memory import MemoryManager
from warmserve_agent.model_profile import ModelProfiles
from warmserve_agent.node_records import (
    ID_RE,
    INSTANCE_ID_RE,
    SLOT_ID_RE,
    Event,
    EventKind,
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
    """Records, lock, events, checks and Figure 5 transitions of one node's GPUs."""

    def __init__(
        self,
        mm: MemoryManager,
        store: WeightStore,
        gpu_memory: dict[int, int],
        *,
        node_name: str = "node",
    ) -> None:
        self.mm = mm
        self.store = store
        self.node_name = node_name
        self.page = mm.page_bytes
        self.gpus: dict[int, GpuRec] = {}
        mm.add_gpus(dict(sorted(gpu_memory.items())))  # in parallel (GPU nodes: seconds each)
        for g in sorted(gpu_memory):
            self.gpus[g] = GpuRec(g, mm.num_pages(g) * self.page)
        self.slots: dict[str, SlotRec] = {}
        self.instances: dict[str, InstanceRec] = {}
        self.generation = 0
        self.lock = threading.RLock()  # every change of the records, by every collaborator
        self.profiles = ModelProfiles()  # measured per model, reported in Describe
        # Wakes the KV pager to unmap what was given up (NodeCore sets it)
        self.kick_unmap: Callable[[], None] = lambda: None
        self._listeners: list[Callable[[Event], None]] = []
        self._emit_lock = threading.Lock()
        # Called with a slot's id when it is gone (its prepared engine goes with it).
        self.on_slot_gone: Callable[[str], None] = lambda slot_id: None

    # ---- events ----------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def emit(self, kind: EventKind, subject: str, message: str = "") -> None:
        with self._emit_lock:  # loader threads emit too
            self.generation += 1
            ev = Event(kind, self.generation, subject, message)
        for fn in list(self._listeners):
            try:
                fn(ev)
            except Exception:  # a listener must never break the state machine
                log.exception("event=listener_failed kind=%s", kind)

    # ---- checks: a refusal before anything changes -----------------------------------------
    def model_layout(self, model: str, tp: int) -> SlotLayout:
        try:
            return self.store.layout(model, tp)
        except UnknownModel as exc:
            raise Refusal("NOT_FOUND", str(exc)) from None
        except StoreError as exc:
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None

    @staticmethod
    def check_owner(owner: str) -> None:
        if owner and not ID_RE.match(owner):
            raise Refusal(
                "INVALID_ARGUMENT",
                "owner must be empty or 1-128 characters of [A-Za-z0-9._:-] "
                f"(got {len(owner)} characters)",
            )

    def check_gpus(self, gpus: Iterable[int]) -> tuple[int, ...]:
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

    def check_slot_id(self, slot_id: str) -> SlotRec:
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

    def check_instance_id(self, instance_id: str) -> InstanceRec:
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

    def check_nesting(self, gpus: tuple[int, ...], ignore: Iterable[str] = ()) -> None:
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

    # ---- Figure 5 --------------------------------------------------------------------------
    def transition(self, gpus: Iterable[int], new: WorkerState, *, crash: bool = False) -> None:
        """Move GPUs to ``new``; all-or-nothing, and only along Figure 5's edges."""
        recs = [self.gpus[g] for g in gpus]
        for r in recs:
            ok = new in (CRASH_ALLOWED if crash else ALLOWED[r.state])
            if not ok and r.state != new:
                raise IllegalTransition(f"gpu {r.index}: {r.state.value} -> {new.value}")
        for r in recs:
            if r.state != new:
                r.state = new
                self.emit(EventKind.GPU, str(r.index), new.value)

    def rest_state(self, g: int) -> WorkerState:
        """Universal if any slot touches the GPU, else idle (after an instance or eviction)."""
        return (
            WorkerState.UNIVERSAL
            if any(g in s.gpus for s in self.slots.values())
            else WorkerState.IDLE
        )

    # ---- slot bookkeeping ------------------------------------------------------------------
    def instance_of_slot(self, slot_id: str) -> InstanceRec | None:
        for inst in self.instances.values():
            if inst.slot_id == slot_id:
                return inst
        return None

    def destroy_slot(self, slot: SlotRec) -> None:
        """Drop a slot; its pages are unmapped in the background (§4.2: unmapping does not
        block what follows) and count as available meanwhile."""
        slot.cancel.set()
        if slot.loader is not None and slot.loader is not threading.current_thread():
            slot.loader.join()
        # its prepared engine first: a build of it is cancelled before the slot's pages (and
        # page table) can go, so it never fails over a slot that is gone
        self.on_slot_gone(slot.slot_id)
        self.mm.retire_slot(slot.slot_id)
        del self.slots[slot.slot_id]
        self.emit(EventKind.SLOT_REMOVED, slot.slot_id)
        self.kick_unmap()

    def models_in_use(self) -> set[str]:
        """Models a slot or an instance holds (the fetcher never evicts or replaces them)."""
        with self.lock:
            return {s.model for s in self.slots.values()} | {
                i.model for i in self.instances.values()
            }
