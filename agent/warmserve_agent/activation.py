"""Activation: starting a serving instance on a GPU group (WarmServe §4.2, Fig. 5-6).

Activate moves workers to dedicated, from universal (a **prewarm hit**: a slot already holds the
model's first layers) or idle (a cold start).  Every other slot touching the group is evicted,
the chosen slot's weight range is mapped in full (the rest of a partial prewarm keeps loading
while it serves) and every page left is mapped after the weights as KV cache.  The engine gets a
typed :class:`~warmserve_agent.engines.spec.EngineSpec` of the slot; if it fails, the instance is
torn down along Figure 5's crash edges (:meth:`Activator.abort_instance`).

:class:`Activator` works on the node's records (:class:`~warmserve_agent.node_state.NodeState`)
with this node's :class:`EngineSettings`, and asks the
:class:`~warmserve_agent.prewarm_slots.Prewarmer` to load what the slot still lacks.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from warmserve.engine_args import (
    DEFAULT_POLICY,
    EngineArgPolicy,
    EngineArgsError,
    validate_engine_args,
)
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.engine import WeightsError
from warmserve_agent.engines import DEFAULT_ENGINE, ENGINES
from warmserve_agent.engines.spec import EngineProfile, EngineSpec, SlotRegion, TensorPlacement
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.node_records import EngineFactory, EventKind, InstanceRec, Refusal, SlotRec
from warmserve_agent.node_state import NodeState
from warmserve_agent.prewarm_slots import Prewarmer
from warmserve_agent.wire import SlotState

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


@dataclass(frozen=True)
class EngineSettings:
    """The engines this node hosts and where they bind (checked once, at start)."""

    factory: EngineFactory  # an engine host for a GPU group (a worker's, or in-process)
    engines: tuple[str, ...] = (DEFAULT_ENGINE,)  # what this node's workers can host
    default_engine: str = ""  # "": the first of ``engines``
    policy: EngineArgPolicy = DEFAULT_POLICY  # what an Activate's engine_args may contain
    host: str = "127.0.0.1"  # where engines bind their HTTP endpoint
    advertise_host: str = ""  # what Activate returns ("": ``host``)
    traces: tuple[str, float] = ("", 1.0)  # engines' OTLP endpoint and sample ratio (EngineSpec)

    def __post_init__(self) -> None:
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines:
            raise ValueError(f"unknown engine(s) {unknown}; engines: {sorted(ENGINES)}")
        object.__setattr__(self, "engines", tuple(self.engines))
        object.__setattr__(self, "default_engine", self.default_engine or self.engines[0])
        if self.default_engine not in self.engines:
            raise ValueError(f"default engine {self.default_engine!r} is not in {self.engines}")
        object.__setattr__(self, "advertise_host", self.advertise_host or self.host)


class Activator:
    """Activate and the engine it starts (see module docstring)."""

    def __init__(self, state: NodeState, prewarmer: Prewarmer, engines: EngineSettings) -> None:
        self._state = state
        self._prewarmer = prewarmer
        self._engines = engines
        self.activation_log: list[tuple[bool, float]] = []  # (hit, seconds) for metrics

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
            kv_pages = mm.map_all_free(chosen.slot_id, weight_pages)
            iid = f"inst-{uuid.uuid4().hex[:12]}"
            engine_host = self._engines.factory(group)
            inst = InstanceRec(
                iid,
                model,
                group,
                chosen.slot_id,
                engine_host,
                layout.model.profile.max_batch,
                weight_pages,
                kv_pages,
                kv_pages,
                prewarm_hit=hit,
                engine_name=engine_name,
                owner=owner,
            )
            state.instances[iid] = inst
            for g in group:
                state.gpus[g].instance_id = iid
            state.transition(group, WorkerState.DEDICATED)
            state.emit(EventKind.INSTANCE, iid, "starting")
            self._prewarmer.start_loader(chosen)  # cold start, or the rest of a partial prewarm
            try:
                spec = self._engine_spec(inst, chosen, tuple(engine_args))
                inst.endpoint = engine_host.start(spec)
                inst.max_batch = engine_host.stats().max_batch or inst.max_batch  # C of Eq. 1
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
            state.emit(EventKind.INSTANCE, iid, "serving")
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
        state: NodeState = self._state
        page = state.page
        backend = state.mm.backend
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
        digests = [state.store.digests(layout, r) for r in range(tp)]
        prof = layout.model.profile
        mapped = inst.weight_pages + inst.kv_pages
        regions = tuple(
            SlotRegion(
                gpu=g,
                va=state.mm.va_base(slot.slot_id, g),
                page_bytes=page,
                weight_bytes=layout.total_bytes,
                kv_bytes=mapped * page - layout.total_bytes,
                local=r == 0,
                # The shared simulated file, readable by physical page from any process, when
                # the agent owns the memory; with memory in workers only the owner reads it.
                host_file="" if in_workers else str(path(g)),
                ppages=()
                if in_workers
                else tuple(state.mm.physical_pages(slot.slot_id, g, 0, mapped)),
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
            kv_capacity_bytes=inst.kv_pages * page * tp,
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
            host=self._engines.host,
            advertise_host=self._engines.advertise_host,
            traces_endpoint=self._engines.traces[0],
            trace_sample_ratio=self._engines.traces[1],
        )

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
            mm.unmap_range(slot.slot_id, inst.weight_pages, mm.num_pages(inst.gpus[0]))
            with slot.lock:
                slot.state = SlotState.LOADING if slot.loader_active else SlotState.READY
        for g in inst.gpus:
            state.gpus[g].instance_id = ""
        for g in inst.gpus:
            state.transition([g], state.rest_state(g), crash=True)
        state.emit(EventKind.INSTANCE_REMOVED, inst.instance_id, why)
        log.warning("event=instance_aborted instance=%s why=%s", inst.instance_id, why)
