"""Activation: starting a serving instance on a GPU group (WarmServe §4.2, Fig. 5-6).

Activate moves workers to dedicated, from universal (a **prewarm hit**: a slot already holds the
model's first layers) or idle (a cold start).  Every other slot touching the group is evicted,
the chosen slot's weight range is mapped in full (the rest of a partial prewarm keeps loading
while it serves) and every page left is mapped after the weights as KV cache.  The engine gets a
typed :class:`~warmserve_agent.engines.spec.EngineSpec` of the slot; if it fails, the instance is
torn down along Figure 5's crash edges (:meth:`Activation._abort_instance`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence

from warmserve.engine_args import EngineArgsError, validate_engine_args
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.engines import ENGINES
from warmserve_agent.engines.spec import EngineProfile, EngineSpec, SlotRegion, TensorPlacement
from warmserve_agent.memory import pages_for
from warmserve_agent.node_records import InstanceRec, Refusal, SlotRec
from warmserve_agent.prewarm_slots import PrewarmSlots

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


class Activation(PrewarmSlots):
    """Activate and the engine it starts (see module docstring)."""

    # ---- activate --------------------------------------------------------------------------
    def check_engine(self, engine: str, args: Sequence[str]) -> str:
        """The engine an Activate names (default: the node's), refused unless it is hosted here
        and ``args`` pass the engine-args schema and this node's allowlist (the same the
        operator admits deployments with: a call that bypasses the operator, or an operator
        with a wider list, still cannot start an engine with them); no state is changed."""
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
            validate_engine_args(list(args), self.engine_policy)
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
