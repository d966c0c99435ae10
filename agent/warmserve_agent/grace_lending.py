"""Grace workers and proactive prewarming: lending a draining instance's KV pages (WarmServe §4.1).

When an instance begins its grace period (Fig. 5: dedicated → grace) it keeps only its Eq. 1
reservation target of KV cache (:func:`warmserve.policy.proactive.grace_reservation`); the KV
pages no kept block touches are withdrawn from it and unmapped in the background, and prewarms
take them (Fig. 6b).  The check runs **when a request of the instance completes** ("upon the
completion of each request for a grace-period instance"): the engine reports completions on the
node's engine-event socket (:mod:`~warmserve_agent.engine_events`, :meth:`GraceLender.on_events`);
also before a prewarm into a grace GPU and on ``GetLendable``; the server's slow timer is only a
safety net for a lost event.

**Growing back**: when a request needs more KV than the instance kept (the engine reports the
bytes it waits for) or Eq. 1's target rises, the range's target rises again; if the pool lacks
the pages, the prewarms that borrowed them lose their most recently loaded layers
(:func:`warmserve.policy.proactive.reclaim_layers`) and the KV pager maps the pages back, the
engine's capacity following.  Ending the instance (grace → universal | idle) stops the engine
first, then its KV pages are unmapped in the background; its weights stay as a ready prewarm slot
unless evicted, so the GPU becomes universal holding the old model and any model prewarmed
during grace.

:class:`GraceLender` works on the node's records (:class:`~warmserve_agent.node_state.NodeState`)
and the KV pager; the prewarmer asks it to refresh a grace instance before it takes lent pages.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from warmserve.api.agent.wire import SlotState
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve.policy.proactive import Borrower, grace_reservation, reclaim_layers
from warmserve_agent.engine_events import EngineEventKind
from warmserve_agent.kv_pager import KvPager
from warmserve_agent.memory import MemoryManager, OutOfPages, pages_for
from warmserve_agent.node_records import EventKind, InstanceRec, Refusal, SlotRec
from warmserve_agent.node_state import NodeState

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


class GraceLender:
    """Grace periods and Eq. 1 lending (see module docstring)."""

    def __init__(self, state: NodeState, pager: KvPager | None = None) -> None:
        self._state = state
        self._pager = pager or KvPager(state.mm)
        # Called with the GPUs of an instance that ended normally (the server recycles their
        # worker processes here when configured to).
        self.on_instance_ended: Callable[[tuple[int, ...]], None] | None = None
        # Restarts a slot's loader after reclaiming cut its layers short (the prewarmer's).
        self.restart_loader: Callable[[SlotRec], None] = lambda slot: None
        self.event_refreshes = 0  # Eq. 1 checks an engine event triggered

    # ---- grace lending (Eq. 1) -------------------------------------------------------------
    def refresh(self, inst: InstanceRec) -> None:
        """Shrink (or grow back) a grace instance's KV cache to its reservation target.

        The engine has the last word on how far it can shrink (blocks in use stay); only pages
        no kept block touches are withdrawn.  Growing back reclaims borrowed pages first if the
        pool lacks them; the pager maps them and raises the engine's capacity."""
        if inst.phase != InstancePhase.GRACE or inst.kv is None:
            return
        state: NodeState = self._state
        kv = inst.kv
        st = inst.engine.stats()
        inst.last_stats = st
        tp = len(inst.gpus)
        geo = kv.geometry
        m_gpu = geo.num_blocks * geo.block_bytes
        k_gpu = min(math.ceil(st.kv_used_bytes / tp), m_gpu)
        wanted = math.ceil(st.kv_wanted_bytes / tp)
        kept = kv.granted * geo.block_bytes
        target = grace_reservation(st.running, inst.max_batch, m_gpu, k_gpu, wanted, kept)
        inst.reservation_target = target
        blocks = min(geo.num_blocks, -(-target // geo.block_bytes))
        with kv.lock:
            if blocks < kv.granted:
                lent = kv.shrink(blocks)
                if lent:
                    self._pager.kick()
                    state.emit(EventKind.INSTANCE, inst.instance_id, f"lent {lent} KV pages")
            elif blocks > kv.target:
                back = self._grow_back(inst, blocks)
                if back:
                    state.emit(
                        EventKind.INSTANCE, inst.instance_id, f"taking back {back} KV pages"
                    )
            elif kv.granted < blocks:  # still growing to its target: the pager is on it
                self._pager.track(kv)

    def _grow_back(self, inst: InstanceRec, blocks: int) -> int:
        """Raise the range's target to ``blocks``: promise the pages (reclaiming borrowed ones
        if the pool lacks them) and let the pager map them.  Returns the pages taken back."""
        kv = inst.kv
        assert kv is not None
        mm: MemoryManager = self._state.mm
        need = len(kv.missing(blocks))
        own = mm.promised(inst.slot_id)
        short = {g: need - own - mm.available_pages(g) for g in inst.gpus}
        if any(n > 0 for n in short.values()):
            self._reclaim(inst, short)
        try:
            kv.set_target(blocks)
        except OutOfPages:  # borrowers hold less than Eq. 1 wants back: take what there is
            have = min(mm.available_pages(g) for g in inst.gpus) + own
            kv.set_target(max(kv.granted, min(blocks, kv.reachable(have))))
        self._pager.track(kv)
        return need

    def _reclaim(self, inst: InstanceRec, short: dict[int, int]) -> None:
        """Evict borrowed layers (policy: newest prewarm first, last layers first) until every
        GPU of the instance has ``short[g]`` more pages available."""
        state: NodeState = self._state
        page = state.page
        mine = set(inst.gpus)
        borrowers = [
            s for s in state.slots.values() if s.slot_id != inst.slot_id and mine & set(s.gpus)
        ]  # admission order: slots are recorded as they are admitted
        plan = reclaim_layers(
            short,
            [
                Borrower(
                    s.slot_id,
                    frozenset(s.gpus),
                    tuple(
                        pages_for(s.layout.bytes_for_layers(n), page)
                        for n in range(s.layers_target + 1)
                    ),
                )
                for s in borrowers
            ],
        )
        for slot_id, keep in plan:
            self.truncate(state.slots[slot_id], keep, inst.instance_id)

    def truncate(self, slot: SlotRec, keep: int, why: str) -> None:
        """Cut a prewarm slot down to its first ``keep`` layers (evict it if 0), freeing the
        pages of the others now: the loader stops first, and resumes if ``keep`` is not yet
        resident."""
        state: NodeState = self._state
        mm: MemoryManager = state.mm
        total = slot.layers_target
        if slot.loader is not None and slot.loader_active:
            slot.cancel.set()
            slot.loader.join()
        if keep <= 0:
            state.destroy_slot(slot)
            for g in slot.gpus:
                if state.gpus[g].state == WorkerState.UNIVERSAL:
                    state.transition([g], state.rest_state(g))
            log.info("event=prewarm_reclaimed slot=%s kept=0 for=%s", slot.slot_id, why)
            return
        keep_pages = pages_for(slot.layout.bytes_for_layers(keep), state.page)
        with slot.lock:
            slot.cancel = threading.Event()
            slot.layers_target = keep
            slot.layers_resident = min(slot.layers_resident, keep)
            slot.state = SlotState.READY if slot.layers_resident >= keep else SlotState.LOADING
        mm.unmap_range(slot.slot_id, keep_pages, mm.num_pages(slot.gpus[0]))
        mm.promise(slot.slot_id, max(0, keep_pages - mm.mapped_prefix(slot.slot_id, slot.gpus[0])))
        state.emit(
            EventKind.SLOT,
            slot.slot_id,
            f"kept {keep} of {total} layers: KV lent to {why} grows back",
        )
        log.info(
            "event=prewarm_reclaimed slot=%s kept=%d of=%d for=%s", slot.slot_id, keep, total, why
        )
        self.restart_loader(slot)

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

    def on_events(self, batch: dict[str, set[EngineEventKind]]) -> None:
        """Engine events (a request finished, or waits for KV): re-check Eq. 1 for each grace
        instance named, now.  Events carry no numbers: the engine's stats decide."""
        state: NodeState = self._state
        with state.lock:
            for iid in batch:
                inst = state.instances.get(iid)
                if inst is None or inst.phase != InstancePhase.GRACE:
                    continue
                self.event_refreshes += 1
                try:
                    self.refresh(inst)
                except Exception as exc:  # engine gone: worker_died handles it
                    log.warning("event=grace_refresh_failed instance=%s err=%s", iid, exc)

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
        with state.lock:
            inst = state.check_instance_id(instance_id)
            if inst.phase != InstancePhase.GRACE:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"instance {instance_id} is {inst.phase.value}; begin its grace period "
                    "first (BeginGrace) so in-flight requests drain",
                )
            del state.instances[instance_id]  # first: loaders stop notifying it
            try:  # the engine stops before its pages go: nothing touches them any more
                inst.engine.stop()
            except Exception as exc:  # its worker died meanwhile: nothing left to stop
                log.warning("event=engine_stop_failed instance=%s err=%s", instance_id, exc)
            slot = state.slots[inst.slot_id]
            if inst.kv is not None:  # unmapped in the background
                inst.kv.release_all()
                self._pager.kick()
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
