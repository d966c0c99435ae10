"""Activation: starting a serving instance on a GPU group (WarmServe §4.2, Fig. 5-6).

Activate moves workers to dedicated, from universal (a **prewarm hit**: a slot already holds the
model's first layers) or idle (a cold start).  Every other slot touching the group is evicted
(retired: its pages are unmapped in the background), the chosen slot's weight range is mapped in
full (the rest of a partial prewarm keeps loading while it serves) and every page left is
promised to the instance's KV range, which the KV pager maps **in the background** while the
engine starts; the engine's capacity grows as chunks land
(:class:`~warmserve_agent.kv_pager.KvMapping`; §4.2, "for the KV cache, mappings are performed
in the background").  The engine gets a typed
:class:`~warmserve_agent.engines.spec.EngineSpec` of the slot — the engine prepared for the slot
while it waited if there is one (:mod:`~warmserve_agent.prepared_engines`: then no engine is
built here; its KV follows the background mapping like any other's) —; if it fails, the instance
is torn down along Figure 5's crash edges (:meth:`Activator.abort_instance`).  Each activation's
stages are timed (:mod:`~warmserve_agent.activation_stages`); its KV stage is when the KV range
is mapped in full and the engine's KV cache grown over it, which with background mapping may
come after the endpoint is up.

:class:`Activator` works on the node's records (:class:`~warmserve_agent.node_state.NodeState`)
with this node's :class:`EngineSettings`, asks the
:class:`~warmserve_agent.prewarm_slots.Prewarmer` to load what the slot still lacks and the
:class:`~warmserve_agent.prepared_engines.EnginePreparer` for the slot's prepared engine.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence

from warmserve.api.agent.wire import SlotState
from warmserve.engine_args import EngineArgsError, validate_engine_args
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.activation_stages import Stage, StageHistograms, StartKind
from warmserve_agent.engine import WeightsError
from warmserve_agent.engines import ENGINES
from warmserve_agent.engines.spec import EngineStats
from warmserve_agent.kv_pager import KvMapping, KvPager
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.node_records import EventKind, InstanceRec, Refusal, SlotRec
from warmserve_agent.node_state import NodeState
from warmserve_agent.prepared_engines import EnginePreparer, EngineSettings, slot_engine_spec
from warmserve_agent.prewarm_slots import Prewarmer
from warmserve_agent.store import SlotLayout

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core

__all__ = ["Activator", "EngineSettings"]


class Activator:
    """Activate and the engine it starts (see module docstring)."""

    def __init__(
        self,
        state: NodeState,
        prewarmer: Prewarmer,
        engines: EngineSettings,
        preparer: EnginePreparer,
        kv: KvMapping | None = None,
    ) -> None:
        self._state = state
        self._prewarmer = prewarmer
        self._engines = engines
        self._preparer = preparer
        self._kv = kv or KvMapping(KvPager(state.mm))
        self.activation_log: list[tuple[bool, float]] = []  # (hit, seconds) for metrics
        self.stage_histograms = StageHistograms()
        self._observe_lock = threading.Lock()
        prewarmer.on_all_resident = self._weights_resident

    # ---- activate --------------------------------------------------------------------------
    def check_engine(self, engine: str, args: Sequence[str]) -> str:
        """The engine an Activate names (default: the node's), refused unless it is hosted here
        and ``args`` pass the engine-args schema and this node's allowlist (the same the
        operator admits deployments with: a call that bypasses the operator, or an operator
        with a wider list, still cannot start an engine with them); no state is changed."""
        hosted = self._engines
        name = engine or hosted.default_engine
        if name not in ENGINES:
            raise Refusal(
                "INVALID_ARGUMENT", f"unknown engine {name!r}; engines: {', '.join(ENGINES)}"
            )
        if name not in hosted.engines:
            raise Refusal(
                "FAILED_PRECONDITION",
                f"engine {name!r} is not enabled on node {self._state.node_name} (it hosts "
                f"{', '.join(hosted.engines)}; start the agent with --engines including {name})",
            )
        try:
            validate_engine_args(list(args), hosted.policy)
        except EngineArgsError as exc:
            raise Refusal("INVALID_ARGUMENT", str(exc)) from None
        return name

    def check_tp(self, engine: str, layout: SlotLayout) -> None:
        """Refuse a tensor-parallel group the engine cannot split this model over (before any
        state changes): an engine whose ranks load tensors as vLLM's layers do needs every
        tensor split by rows/columns (``store.SlotLayout.tp_layers_problem``) and a worker
        process per GPU to host ranks >= 1 (with engines in the agent process, rank 0 would
        wait for ranks that never come and fail a minute later)."""
        if not ENGINES[engine].tp_layers or layout.tp == 1:
            return
        why = layout.tp_layers_problem()
        if why:
            raise Refusal(
                "FAILED_PRECONDITION",
                f"engine {engine!r} cannot serve tensorParallel={layout.tp}: {why}",
            )
        if not self._engines.rank_workers:
            raise Refusal(
                "FAILED_PRECONDITION",
                f"engine {engine!r} cannot serve tensorParallel={layout.tp} on node "
                f"{self._state.node_name}: its engines run in the agent process, with no "
                "worker process per GPU to host the other ranks",
            )

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
        state: NodeState = self._state
        page = state.page
        mm: MemoryManager = state.mm
        with state.lock:
            state.check_owner(owner)
            group = state.check_gpus(gpus)
            layout = state.model_layout(model, len(group))
            engine_name = self.check_engine(engine, engine_args)
            self.check_tp(engine_name, layout)
            for g in group:
                rec = state.gpus[g]
                if rec.state in (WorkerState.DEDICATED, WorkerState.GRACE):
                    what = "serving" if rec.state == WorkerState.DEDICATED else "draining (grace)"
                    raise Refusal(
                        "FAILED_PRECONDITION",
                        f"GPU {g} is {what} instance {rec.instance_id}; end it before activating "
                        "another instance on this GPU",
                    )
            chosen: SlotRec | None = None
            if slot_id:
                chosen = state.check_slot_id(slot_id)
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
                        for s in state.slots.values()
                        if s.model == model and s.gpus == group and s.state != SlotState.FAILED
                    ),
                    None,
                )
            if chosen is not None and chosen.state == SlotState.FAILED:
                raise Refusal(
                    "FAILED_PRECONDITION",
                    f"slot {chosen.slot_id} failed ({chosen.message}); evict it and retry",
                )
            weight_pages = pages_for(layout.total_bytes, page)
            pages = min(mm.num_pages(g) for g in group)
            if weight_pages + 1 > pages:
                raise Refusal(
                    "RESOURCE_EXHAUSTED",
                    f"{model} needs {weight_pages} pages ({weight_pages * page} bytes) per "
                    f"GPU for weights plus KV cache on a group of {len(group)}, but a GPU has "
                    f"{pages} pages; use a larger tensor-parallel group",
                )
            # Validated: apply.
            evict = [
                s for s in state.slots.values() if s is not chosen and set(s.gpus) & set(group)
            ]
            for s in evict:
                state.destroy_slot(s)
            for s in evict:  # GPUs outside the group that lost their last slot
                for g in s.gpus:
                    if g not in group and state.gpus[g].state == WorkerState.UNIVERSAL:
                        state.transition([g], state.rest_state(g))
            hit = chosen is not None
            resident_before = hit and chosen.layers_resident >= chosen.layers_total  # type: ignore[union-attr]
            if chosen is None:
                sid = f"slot-{uuid.uuid4().hex[:12]}"
                mm.create_slot(sid, group)
                chosen = SlotRec(sid, model, group, layout, layout.model.num_layers)
                state.slots[sid] = chosen
            with chosen.lock:
                chosen.layers_target = layout.model.num_layers
                chosen.state = SlotState.ACTIVE
                chosen.owner = owner  # the slot now belongs to the instance's owner
            mm.promise(chosen.slot_id, weight_pages - mm.mapped_prefix(chosen.slot_id, group[0]))
            mm.ensure_mapped(chosen.slot_id, weight_pages)
            mm.release_promise(chosen.slot_id)
            iid = f"inst-{uuid.uuid4().hex[:12]}"
            engine_host = self._preparer.claim(chosen, engine_name, engine_args)
            if engine_host is None:
                engine_host = self._engines.factory(group)
            inst = InstanceRec(
                iid,
                model,
                group,
                chosen.slot_id,
                engine_host,
                layout.model.profile.max_batch,
                weight_pages,
                0,
                0,
                prewarm_hit=hit,
                engine_name=engine_name,
                owner=owner,
                engine_args=tuple(engine_args),
                activated_at=t0,
            )
            if resident_before:
                inst.stages.weights_resident = 0.0
            kv = self._kv.reserve(inst)  # KV pages mapped in the background from now on
            if kv.granted < kv.geometry.num_blocks:  # the engine's start gets the range if mapped
                inst.stages.kv_in_background = True
                kv.on_full = lambda: self._kv_mapped(inst)
            state.instances[iid] = inst
            for g in group:
                state.gpus[g].instance_id = iid
            state.transition(group, WorkerState.DEDICATED)
            state.emit(EventKind.INSTANCE, iid, "starting")
            self._prewarmer.start_loader(chosen)  # cold start, or the rest of a partial prewarm
            try:
                spec = slot_engine_spec(
                    state,
                    self._engines,
                    chosen,
                    engine=engine_name,
                    engine_args=engine_args,
                    instance_id=iid,
                    kv_pages=kv.num_pages,
                    kv_capacity_bytes=kv.capacity_bytes(kv.granted),
                    events_addr=self._kv.events_addr,
                )
                taken = getattr(engine_host, "process_taken_at", t0)
                inst.stages.process_taken = max(0.0, taken - t0)
                inst.stages.engine_call_s = time.perf_counter() - t0
                inst.endpoint = engine_host.start(spec)
                inst.stages.process_taken = max(
                    0.0, getattr(engine_host, "process_taken_at", taken) - t0
                )
                stats = self.refresh_stats(inst)
                inst.max_batch = stats.max_batch or inst.max_batch  # C of Eq. 1
                self._kv.engine_started(inst, stats)
                inst.phase = InstancePhase.SERVING
                if chosen.layers_resident > 0:
                    engine_host.layers_ready(chosen.layers_resident)
            except Refusal:
                self.abort_instance(inst, "engine cannot be hosted")
                raise
            except Exception as exc:
                self.abort_instance(inst, f"engine failed to start: {exc}")
                if isinstance(exc, WeightsError):  # the slot's bytes are bad: keep it out
                    with chosen.lock:  # of service until evicted
                        chosen.state = SlotState.FAILED
                        chosen.message = f"weights failed verification: {exc}"
                    state.emit(EventKind.SLOT, chosen.slot_id, chosen.message)
                raise Refusal(
                    "UNAVAILABLE", f"instance of {model} on GPUs {list(group)} failed: {exc}"
                ) from None
            inst.activation_seconds = time.perf_counter() - t0
            self.activation_log.append((hit, inst.activation_seconds))
            for stage in inst.stages.known():
                self._observe(inst, stage)
            state.emit(EventKind.INSTANCE, iid, "serving")
            log.info(
                "event=activated instance=%s model=%s gpus=%s hit=%s prepared=%s seconds=%.4f "
                "evicted=%d stages=%s",
                iid,
                model,
                list(group),
                hit,
                inst.stages.engine_prepared,
                inst.activation_seconds,
                len(evict),
                ",".join(f"{k.value}:{v:.3f}" for k, v in inst.stages.known().items()),
            )
            return inst, [s.slot_id for s in evict]

    # ---- stages ----------------------------------------------------------------------------
    def refresh_stats(self, inst: InstanceRec) -> EngineStats:
        """Ask the engine for its stats (``last_stats``) and note the stages it reached."""
        stats = inst.engine.stats()
        inst.last_stats = stats
        for stage in inst.stages.from_engine(stats):
            self._observe(inst, stage)
        return stats

    def _weights_resident(self, slot: SlotRec) -> None:
        """The slot's last layer landed (loader thread): a stage of the instance it serves."""
        inst = self._state.instance_of_slot(slot.slot_id)
        if inst is not None and inst.stages.weights_resident is None:
            inst.stages.weights_resident = time.perf_counter() - inst.activated_at
            self._observe(inst, Stage.WEIGHTS_RESIDENT)

    def _kv_mapped(self, inst: InstanceRec) -> None:
        """The instance's KV range is mapped in full and granted to its engine (the pager's
        thread): the KV stage, now that it happens in the background."""
        if inst.stages.kv_mapped is None:
            inst.stages.kv_mapped = time.perf_counter() - inst.activated_at
            self._observe(inst, Stage.KV_MAPPED)

    def _observe(self, inst: InstanceRec, stage: Stage) -> None:
        """Count a stage of ``inst`` in the histograms, once."""
        with self._observe_lock:
            if stage in inst.stages.observed or inst.phase == InstancePhase.STARTING:
                return  # a stage reached while starting is counted when the start is done
            inst.stages.observed.add(stage)
        value = getattr(inst.stages, stage.value)
        if not inst.prewarm_hit:
            kind = StartKind.COLD
        elif inst.stages.engine_prepared:
            kind = StartKind.HIT_PREPARED
        else:
            kind = StartKind.HIT
        self.stage_histograms.observe(stage, kind, value)

    def abort_instance(self, inst: InstanceRec, why: str) -> None:
        """Tear an instance down after its engine failed or died (crash transition); the
        caller holds the state's lock."""
        state: NodeState = self._state
        mm: MemoryManager = state.mm
        state.instances.pop(inst.instance_id, None)  # first: loaders stop notifying it
        with contextlib.suppress(Exception):
            inst.engine.stop()
        slot = state.slots.get(inst.slot_id)
        if slot is not None and mm.has_slot(slot.slot_id):
            if inst.kv is not None:  # the engine is gone: its KV pages unmap in the background
                inst.kv.release_all()
                self._kv.pager.kick()
            with slot.lock:
                slot.state = SlotState.LOADING if slot.loader_active else SlotState.READY
        for g in inst.gpus:
            state.gpus[g].instance_id = ""
        for g in inst.gpus:
            state.transition([g], state.rest_state(g), crash=True)
        state.emit(EventKind.INSTANCE_REMOVED, inst.instance_id, why)
        log.warning("event=instance_aborted instance=%s why=%s", inst.instance_id, why)
