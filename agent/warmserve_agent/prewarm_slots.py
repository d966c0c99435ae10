"""Prewarm slots: admitting a prewarm, loading its layers, evicting it (WarmServe §4, §4.2).

A prewarm puts a model's first N layers into a **prewarm slot** on a GPU group: a virtual range
whose weights sit at its start, so activation later maps the rest in place (zero-copy switch).
Pages come from the free pool (idle/universal workers) or from KV pages a grace instance lent
(Eq. 1 proactive prewarming; the grace instance is refreshed first, see
:mod:`~warmserve_agent.grace_lending`).  The copy runs in a loader thread per slot, outside the
state lock; the loader only touches its own slot's progress fields and the event bus, and picks
up a raised layer target (a partial prewarm that gets activated keeps loading while it serves).

:class:`Prewarmer` works on the node's records (:class:`~warmserve_agent.node_state.NodeState`)
and asks the :class:`~warmserve_agent.grace_lending.GraceLender` to shrink a grace instance
before it counts the pages that instance lends; the activator asks it to start a slot's loader.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable

from warmserve.api.agent.wire import SlotState
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.engine import WeightsMismatch
from warmserve_agent.grace_lending import GraceLender
from warmserve_agent.loader import LoadCancelled, load_layers
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.node_records import EventKind, Refusal, SlotRec
from warmserve_agent.node_state import NodeState

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


class Prewarmer:
    """Prewarm admission, slot loaders and eviction (see module docstring)."""

    def __init__(self, state: NodeState, lender: GraceLender) -> None:
        self._state = state
        self._lender = lender
        # Called (loader thread) when a slot's last layer landed: an activation stage.
        self.on_all_resident: Callable[[SlotRec], None] = lambda slot: None

    # ---- prewarm ---------------------------------------------------------------------------
    def prewarm(self, model: str, gpus: Iterable[int], layers: int = 0, owner: str = "") -> SlotRec:
        """Admit a prewarm and start its loader; returns the (loading) slot."""
        state: NodeState = self._state
        page = state.page
        mm: MemoryManager = state.mm
        with state.lock:
            state.check_owner(owner)
            group = state.check_gpus(gpus)
            layout = state.model_layout(model, len(group))
            n = layout.model.num_layers
            if layers < 0 or layers > n:
                raise Refusal(
                    "INVALID_ARGUMENT",
                    f"layers must be 0 (all) or 1..{n} for {model}, which has {n} layers; "
                    f"got {layers}",
                )
            target = layers or n
            for g in group:
                rec = state.gpus[g]
                if rec.state == WorkerState.DEDICATED:
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"GPU {g} is dedicated to instance {rec.instance_id}; a serving GPU "
                        "cannot prewarm until its instance enters a grace period (BeginGrace)",
                    )
            state.check_nesting(group)
            for s in state.slots.values():
                if s.model == model and set(s.gpus) & set(group):
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"{model} is already resident in slot {s.slot_id} on GPUs "
                        f"{list(s.gpus)}; activate that slot or evict it first",
                    )
            need = pages_for(layout.bytes_for_layers(target), page)
            for g in group:
                inst = state.instances.get(state.gpus[g].instance_id)
                if inst is not None:
                    self._lender.refresh(inst)
            short = [(g, mm.available_pages(g)) for g in group if mm.available_pages(g) < need]
            if short:
                g, have = short[0]
                raise Refusal(
                    "RESOURCE_EXHAUSTED",
                    f"{model} ({target} of {n} layers) needs {need} pages "
                    f"({need * page} bytes) per GPU; GPU {g} has {have} free "
                    f"({have * page} bytes). Evict slots on it, prewarm fewer layers, "
                    "or use a larger GPU group",
                )
            slot_id = f"slot-{uuid.uuid4().hex[:12]}"
            mm.create_slot(slot_id, group)
            mm.promise(slot_id, need)
            slot = SlotRec(slot_id, model, group, layout, target, owner=owner)
            state.slots[slot_id] = slot
            state.transition(
                [g for g in group if state.gpus[g].state == WorkerState.IDLE],
                WorkerState.UNIVERSAL,
            )
            state.emit(EventKind.SLOT, slot_id, "prewarm admitted")
            self.start_loader(slot)
            return slot

    def start_loader(self, slot: SlotRec) -> None:
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
        state: NodeState = self._state
        base_bytes = slot.bytes_loaded
        base_s = slot.load_seconds

        def on_layer(n: int, nbytes: int, secs: float) -> None:
            slot.layers_resident = n
            slot.bytes_loaded = base_bytes + nbytes
            slot.load_seconds = base_s + secs
            if n >= slot.layers_total:  # resident now, before the engine hears of it
                self.on_all_resident(slot)
            inst = state.instance_of_slot(slot.slot_id)
            if inst is not None and inst.phase != InstancePhase.STARTING:
                try:
                    inst.engine.layers_ready(n)
                except WeightsMismatch:
                    raise  # the slot's bytes are wrong: fail the slot
                except Exception as exc:  # engine ended or died meanwhile; the bytes are fine
                    log.warning("event=layers_ready_failed slot=%s err=%s", slot.slot_id, exc)
            state.emit(EventKind.SLOT, slot.slot_id, f"{n}/{slot.layers_total} layers")

        try:
            while True:
                with slot.lock:
                    if slot.cancel.is_set() or slot.layers_resident >= slot.layers_target:
                        slot.loader_active = False
                        if slot.state == SlotState.LOADING and not slot.cancel.is_set():
                            slot.state = SlotState.READY
                            if state.mm.has_slot(slot.slot_id):
                                state.mm.release_promise(slot.slot_id)
                            ready = True
                        else:
                            ready = False
                        break
                    start, end = slot.layers_resident, slot.layers_target
                load_layers(
                    state.mm,
                    state.store,
                    slot.slot_id,
                    slot.layout,
                    slot.gpus,
                    start,
                    end,
                    cancel=slot.cancel,
                    on_layer=on_layer,
                )
                # the loader's timing of these layers, as the slot reports it (its bandwidth)
                state.profiles.record_load(
                    slot.model, slot.bytes_loaded - base_bytes, slot.load_seconds - base_s
                )
                base_bytes, base_s = slot.bytes_loaded, slot.load_seconds
        except Exception as exc:
            with slot.lock:
                slot.loader_active = False
                if isinstance(exc, LoadCancelled) or slot.cancel.is_set():
                    return
                slot.state = SlotState.FAILED
                slot.message = f"loading failed: {exc}"
            log.error("event=load_failed slot=%s err=%s", slot.slot_id, exc)
            state.emit(EventKind.SLOT, slot.slot_id, slot.message)
            return
        if ready:
            state.emit(EventKind.SLOT, slot.slot_id, "ready")

    # ---- evict -----------------------------------------------------------------------------
    def evict(self, slot_id: str) -> tuple[SlotRec, int]:
        state: NodeState = self._state
        with state.lock:
            slot = state.check_slot_id(slot_id)
            inst = state.instance_of_slot(slot_id)
            if inst is not None:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"slot {slot_id} is serving instance {inst.instance_id}; end the instance "
                    "first (BeginGrace, then EndInstance with evict_weights)",
                )
            freed = state.mm.mapped_count(slot_id, slot.gpus[0])
            state.destroy_slot(slot)
            for g in slot.gpus:
                if state.gpus[g].state == WorkerState.UNIVERSAL:
                    state.transition([g], state.rest_state(g))
            return slot, freed
