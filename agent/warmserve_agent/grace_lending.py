"""Grace workers and proactive prewarming: lending a draining instance's KV pages (WarmServe §4.1).

When an instance begins its grace period (Fig. 5: dedicated → grace) it keeps only its Eq. 1
reservation target of KV cache (:func:`warmserve.policy.proactive.reservation_target`); surplus
KV pages are unmapped from the tail of its slot and returned to the pool, where prewarms can take
them (Fig. 6b), and taken back if its load grows.  Ending the instance (grace → universal | idle)
unmaps its KV pages; its weights stay as a ready prewarm slot unless evicted, so the GPU becomes
universal holding the old model and any model prewarmed during grace.

:class:`GraceLender` works on the node's records (:class:`~warmserve_agent.node_state.NodeState`)
and nothing else; the prewarmer asks it to refresh a grace instance before it takes lent pages.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve.policy.proactive import reservation_target
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.node_records import EventKind, InstanceRec, Refusal
from warmserve_agent.node_state import NodeState
from warmserve_agent.wire import SlotState

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


class GraceLender:
    """Grace periods and Eq. 1 lending (see module docstring)."""

    def __init__(self, state: NodeState) -> None:
        self._state = state
        # Called with the GPUs of an instance that ended normally (the server recycles their
        # worker processes here when configured to).
        self.on_instance_ended: Callable[[tuple[int, ...]], None] | None = None

    # ---- grace lending (Eq. 1) -------------------------------------------------------------
    def refresh(self, inst: InstanceRec) -> None:
        """Shrink (or regrow) a grace instance's KV cache to its Eq. 1 reservation target.

        Called on a timer (the paper checks when each request completes), before prewarming
        into a grace GPU and when lendable memory is queried.  The engine has the last word on
        how far it can shrink (admitted requests keep their KV); only pages beyond what it
        accepted are unmapped.
        """
        if inst.phase != InstancePhase.GRACE:
            return
        state: NodeState = self._state
        page = state.page
        mm: MemoryManager = state.mm
        st = inst.engine.stats()
        inst.last_stats = st
        tp = len(inst.gpus)
        m_gpu = inst.kv_pages_initial * page
        k_gpu = min(math.ceil(st.kv_used_bytes / tp), m_gpu)
        target = reservation_target(st.running, inst.max_batch, m_gpu, k_gpu)
        inst.reservation_target = target
        want = pages_for(target, page)
        cur = inst.kv_pages
        if want < cur:
            accepted = inst.engine.set_kv_capacity(want * page * tp)
            keep = max(want, pages_for(math.ceil(accepted / tp), page))
            if keep < cur:
                mm.unmap_range(inst.slot_id, inst.weight_pages + keep, cur - keep)
                inst.kv_pages = keep
                state.emit(EventKind.INSTANCE, inst.instance_id, f"lent {cur - keep} KV pages")
        elif want > cur:
            grow = min(want - cur, min(mm.available_pages(g) for g in inst.gpus))
            if grow > 0:
                mm.map_range(inst.slot_id, inst.weight_pages + cur, grow)
                inst.kv_pages = cur + grow
                inst.engine.set_kv_capacity(inst.kv_pages * page * tp)
                state.emit(EventKind.INSTANCE, inst.instance_id, f"took back {grow} KV pages")

    def refresh_all(self) -> None:
        state: NodeState = self._state
        with state.lock:
            for inst in list(state.instances.values()):
                try:
                    self.refresh(inst)
                except Exception as exc:  # engine gone: worker_died handles it
                    log.warning(
                        "event=grace_refresh_failed instance=%s err=%s", inst.instance_id, exc
                    )

    def lendable(self, instance_ids: Sequence[str] = ()) -> list[dict[str, Any]]:
        state: NodeState = self._state
        page = state.page
        with state.lock:
            ids = list(instance_ids) or [
                i.instance_id for i in state.instances.values() if i.phase == InstancePhase.GRACE
            ]
            out = []
            for iid in ids:
                inst = state.check_instance_id(iid)
                if inst.phase != InstancePhase.GRACE:
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"instance {iid} is {inst.phase.value}, not in a grace period; only grace "
                        "instances lend memory (call BeginGrace first)",
                    )
                self.refresh(inst)
                st = inst.last_stats
                tp = len(inst.gpus)
                out.append(
                    {
                        "instance_id": iid,
                        "model": inst.model,
                        "gpus": inst.gpus,
                        "running": st.running,
                        "max_batch": inst.max_batch,
                        "kv_capacity_bytes": inst.kv_pages_initial * page,
                        "kv_used_bytes": math.ceil(st.kv_used_bytes / tp),
                        "reservation_target_bytes": inst.reservation_target,
                        "lendable_bytes": min(state.mm.available_pages(g) for g in inst.gpus)
                        * page,
                        "lent_bytes": (inst.kv_pages_initial - inst.kv_pages) * page,
                    }
                )
            return out

    # ---- grace / end -----------------------------------------------------------------------
    def begin_grace(self, instance_id: str) -> InstanceRec:
        state: NodeState = self._state
        with state.lock:
            inst = state.check_instance_id(instance_id)
            if inst.phase != InstancePhase.SERVING:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"instance {instance_id} is {inst.phase.value}; only a serving instance "
                    "can begin a grace period",
                )
            state.transition(inst.gpus, WorkerState.GRACE)
            inst.phase = InstancePhase.GRACE
            inst.grace_started_unix = time.time()
            state.emit(EventKind.INSTANCE, instance_id, "grace")
            self.refresh(inst)
            return inst

    def end_instance(self, instance_id: str, evict_weights: bool = False) -> InstanceRec:
        state: NodeState = self._state
        mm: MemoryManager = state.mm
        with state.lock:
            inst = state.check_instance_id(instance_id)
            if inst.phase != InstancePhase.GRACE:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"instance {instance_id} is {inst.phase.value}; begin its grace period "
                    "first (BeginGrace) so in-flight requests drain",
                )
            del state.instances[instance_id]  # first: loaders stop notifying it
            try:
                inst.engine.stop()
            except Exception as exc:  # its worker died meanwhile: nothing left to stop
                log.warning("event=engine_stop_failed instance=%s err=%s", instance_id, exc)
            slot = state.slots[inst.slot_id]
            mm.unmap_range(slot.slot_id, inst.weight_pages, mm.num_pages(inst.gpus[0]))
            for g in inst.gpus:
                state.gpus[g].instance_id = ""
            if evict_weights:
                state.destroy_slot(slot)
            else:
                with slot.lock:
                    slot.state = SlotState.LOADING if slot.loader_active else SlotState.READY
                state.emit(EventKind.SLOT, slot.slot_id, "kept after instance ended")
            for g in inst.gpus:
                state.transition([g], state.rest_state(g))
            state.emit(EventKind.INSTANCE_REMOVED, instance_id, "ended")
            if self.on_instance_ended is not None:
                self.on_instance_ended(inst.gpus)
            return inst
