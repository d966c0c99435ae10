"""Prepared engines: a prewarm slot's engine built in its worker while the slot waits (§4).

WarmServe's hit is fast because the process, the engine and the weights are all ready when the
request comes (Figure 8).  The pooled worker gives the process, the slot the weights; this module
gives the engine: after a ``Prewarm`` (which names the engine and its arguments, else the node's
default), the worker of the slot's first GPU builds that engine over the slot
(``Engine.prepare``: parameters as views of the slot, a KV cache sized for the pages the slot will
get at activation but none of its blocks usable, the HTTP app not listening).  ``Activate`` of the
slot with the same engine and arguments then only maps the rest of the weights, takes the KV the
agent mapped already and opens the endpoint (``Engine.start``); its KV range is mapped in the
background as for any activation and its KV cache grows as the pages land.  Other arguments, or
a slot without one, build at activation as before.

Rules (mechanics, not policy; the cost each prepared engine holds is reported so the placement
policy can account for it):

* at most one prepared engine per worker process (the GPU that hosts it is the slot's first), for
  the slot prewarmed first among those waiting on that GPU; none while the worker hosts a serving
  or grace instance (its engine);
* its lifetime is its slot's: evicting the slot (or destroying it for another activation) tears it
  down; a worker that dies takes it along and the agent forgets it; the next slot waiting on a
  GPU gets one when the GPU's worker is free again (:meth:`EnginePreparer.kick`, after prewarms,
  evictions, instance ends and worker replacement);
* a preparation that fails (an engine that cannot be built ahead, e.g. vLLM compiled on CPU, or
  anything on a GPU for now) is reported with its reason, and the activation builds the engine.

:func:`slot_engine_spec` is the one place an :class:`~warmserve_agent.engines.spec.EngineSpec` is
made, for a preparation (no instance yet, KV pages not mapped) and an activation alike.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from warmserve.api.agent.wire import SlotState
from warmserve.engine_args import DEFAULT_POLICY, EngineArgPolicy
from warmserve.policy.cluster import WorkerState
from warmserve_agent.engine import EngineHost
from warmserve_agent.engines import DEFAULT_ENGINE, ENGINES
from warmserve_agent.engines.slotmem import UNMAPPED
from warmserve_agent.engines.spec import (
    EngineProfile,
    EngineSpec,
    PreparedReport,
    PreparedState,
    SlotRegion,
    TensorPlacement,
)
from warmserve_agent.memory import pages_for
from warmserve_agent.node_records import EngineFactory, EventKind, Refusal, SlotRec
from warmserve_agent.node_state import NodeState

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
    # Each GPU has a worker process that can host a tensor-parallel rank (False: engines in the
    # agent process, tests and debugging, where no rank >= 1 of a vLLM TP group can live).
    rank_workers: bool = True

    def __post_init__(self) -> None:
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines:
            raise ValueError(f"unknown engine(s) {unknown}; engines: {sorted(ENGINES)}")
        object.__setattr__(self, "engines", tuple(self.engines))
        object.__setattr__(self, "default_engine", self.default_engine or self.engines[0])
        if self.default_engine not in self.engines:
            raise ValueError(f"default engine {self.default_engine!r} is not in {self.engines}")
        object.__setattr__(self, "advertise_host", self.advertise_host or self.host)


PREPARE_TIMEOUT_S = 900.0  # a vLLM build on a loaded CPU takes seconds; a stuck one is reported


def slot_engine_spec(
    state: NodeState,
    settings: EngineSettings,
    slot: SlotRec,
    *,
    engine: str,
    engine_args: Sequence[str],
    instance_id: str,
    kv_pages: int,
    kv_capacity_bytes: int,
    events_addr: str = "",
) -> EngineSpec:
    """What an engine needs to serve ``slot`` with a KV range of ``kv_pages`` pages per GPU
    after its weights, of which it may use ``kv_capacity_bytes`` at start (typed; see
    engines/spec.py).  Weight pages the slot has not mapped yet (a preparation) and every KV
    page are :data:`~warmserve_agent.engines.slotmem.UNMAPPED` in the shared-file page lists: KV
    pages are mapped in the background and found through the shared page table once granted."""
    page = state.page
    mm = state.mm
    backend = mm.backend
    path = getattr(backend, "path", None)
    in_workers = getattr(backend, "in_workers", False)
    if not in_workers and path is None:
        raise Refusal(
            "UNIMPLEMENTED",
            f"the {backend.name} backend in the agent process cannot host engines: its "
            "mappings belong to the agent; run with memory owned by the workers",
        )
    layout = slot.layout
    tp = len(slot.gpus)
    digests = [state.store.digests(layout, r) for r in range(tp)]
    prof = layout.model.profile
    weight_pages = pages_for(layout.total_bytes, page)
    mapped = weight_pages + kv_pages
    pt_path = getattr(mm.backend, "page_table_path", None)

    def ppages(g: int) -> tuple[int, ...]:
        if in_workers:  # only the owner reads it (by address)
            return ()
        have = min(weight_pages, mm.mapped_prefix(slot.slot_id, g))
        known = mm.physical_pages(slot.slot_id, g, 0, have)
        return tuple(known) + (UNMAPPED,) * (mapped - have)

    regions = tuple(
        SlotRegion(
            gpu=g,
            va=mm.va_base(slot.slot_id, g),
            page_bytes=page,
            weight_bytes=layout.total_bytes,
            kv_bytes=mapped * page - layout.total_bytes,
            local=r == 0,
            # The shared simulated file, readable by physical page from any process, when the
            # agent owns the memory; with memory in workers only the owner reads it.
            host_file="" if in_workers else str(path(g)),  # type: ignore[misc]
            ppages=ppages(g),
            page_table="" if pt_path is None else str(pt_path(g, mm.va_base(slot.slot_id, g))),
        )
        for r, g in enumerate(slot.gpus)
    )
    return EngineSpec(
        engine=engine,
        model=slot.model,
        instance_id=instance_id,
        model_dir=str(layout.model.path),
        layers_total=layout.model.num_layers,
        layers_resident=slot.layers_resident,
        kv_capacity_bytes=kv_capacity_bytes,
        regions=regions,
        tensors=tuple(
            TensorPlacement(
                name=p.tensor.name,
                layer=p.tensor.layer,
                offset=p.slot_offset,
                nbytes=p.tensor.nbytes,
                dtype=p.tensor.dtype,
                shape=p.tensor.shape,
                shard_len=tuple(p.shard_len(r) for r in range(tp)),
                split=p.split.value,
                slot_bytes=p.shard_bytes,
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
        engine_args=tuple(engine_args),
        host=settings.host,
        advertise_host=settings.advertise_host,
        traces_endpoint=settings.traces[0],
        trace_sample_ratio=settings.traces[1],
        slot_id=slot.slot_id,
        events_addr=events_addr,
        **_tp_rendezvous(slot, engine),
    )


_TP_SECRET = secrets.token_bytes(32)
_TP_DIR: list[str] = []


def _tp_rendezvous(slot: SlotRec, engine: str) -> dict[str, Any]:
    """Where a tensor-parallel engine's ranks meet (``EngineSpec.tp_*``): each rank >= 1 listens
    on a Unix socket in a private directory (mode 0700, created once per agent process) with a
    per-slot key, and their process group's file store lies beside them.  The same for the
    slot's preparation and its activation (a prepared engine's group is reused)."""
    tp = len(slot.gpus)
    if tp == 1 or not ENGINES[engine].tp_layers:
        return {}
    if not _TP_DIR:
        _TP_DIR.append(tempfile.mkdtemp(prefix="warmserve-tp-"))
    d = _TP_DIR[0]
    key = hmac.new(_TP_SECRET, slot.slot_id.encode(), hashlib.sha256).hexdigest()
    return {
        "tp_peers": tuple(os.path.join(d, f"{slot.slot_id}-{r}.sock") for r in range(1, tp)),
        "tp_init": f"file://{os.path.join(d, slot.slot_id + '.store')}",
        "tp_authkey": key,
    }


@dataclass
class PreparedRec:
    """A slot's prepared engine as the agent knows it.  ``lock`` orders the preparation
    thread's request to the host against the slot going away (``asked``/``over``), so an
    engine is never prepared for a slot that is gone."""

    host: EngineHost | None  # where it lives (engine_host); None: it could not be asked
    engine: str
    engine_args: tuple[str, ...]
    gpu: int  # the GPU whose worker process holds it
    report: PreparedReport
    lock: threading.Lock = field(default_factory=threading.Lock)
    asked: bool = False  # the host was asked to prepare
    over: bool = False  # claimed by an activation, or its slot is gone


class EnginePreparer:
    """Prepares, hands over and tears down slots' engines (see module docstring)."""

    def __init__(self, state: NodeState, settings: EngineSettings) -> None:
        self._state = state
        self._settings = settings
        self.wanted: dict[str, tuple[str, tuple[str, ...]]] = {}  # slot -> (engine, args)
        self.prepared: dict[str, PreparedRec] = {}
        self._threads: list[threading.Thread] = []

    def want(self, slot: SlotRec, engine: str, engine_args: Sequence[str]) -> None:
        """``slot`` will serve with ``engine`` and ``engine_args``: prepare it when its GPU's
        worker is free."""
        with self._state.lock:
            self.wanted[slot.slot_id] = (engine, tuple(engine_args))
            self.kick()

    def kick(self) -> None:
        """Start preparing the first waiting slot of every GPU whose worker is free."""
        state = self._state
        with state.lock:
            live = (PreparedState.PREPARING, PreparedState.READY)
            busy = {rec.gpu for rec in self.prepared.values() if rec.report.state in live}
            for slot in list(state.slots.values()):  # in prewarm order
                g = slot.gpus[0]
                if slot.slot_id in self.prepared or slot.slot_id not in self.wanted or g in busy:
                    continue
                recs = [state.gpus[x] for x in slot.gpus]
                if slot.state in (SlotState.FAILED, SlotState.ACTIVE) or any(
                    r.state in (WorkerState.DEDICATED, WorkerState.GRACE) or not r.available
                    for r in recs
                ):
                    continue
                self._begin(slot)
                busy.add(g)

    def _begin(self, slot: SlotRec) -> None:
        state = self._state
        engine, args = self.wanted[slot.slot_id]
        kv_pages = min(state.mm.num_pages(g) for g in slot.gpus) - pages_for(
            slot.layout.total_bytes, state.page
        )
        try:
            spec = slot_engine_spec(
                state,
                self._settings,
                slot,
                engine=engine,
                engine_args=args,
                instance_id="",
                kv_pages=kv_pages,
                kv_capacity_bytes=0,  # none of its KV is mapped before the activation
            )
            host = self._settings.factory(slot.gpus)
        except Exception as exc:  # an agent-owned backend, a worker gone: no engine ahead
            self.prepared[slot.slot_id] = PreparedRec(
                None,
                engine,
                args,
                slot.gpus[0],
                PreparedReport(PreparedState.FAILED, 0, 0, str(exc)),
            )
            return
        rec = PreparedRec(host, engine, args, slot.gpus[0], PreparedReport(PreparedState.PREPARING))
        self.prepared[slot.slot_id] = rec
        t = threading.Thread(target=self._prepare, args=(slot.slot_id, rec, spec), daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _prepare(self, slot_id: str, rec: PreparedRec, spec: EngineSpec) -> None:
        """Preparation thread: ask the host, wait for the build (outside the state lock)."""
        assert rec.host is not None
        try:
            with rec.lock:
                if rec.over:
                    return
                rec.host.prepare(spec)  # returns at once; the build runs in the host
                rec.asked = True
            rec.report = rec.host.prepared(wait_s=PREPARE_TIMEOUT_S)
        except Exception as exc:
            rec.report = PreparedReport(PreparedState.FAILED, 0, 0, f"{type(exc).__name__}: {exc}")
        if rec.over:
            return  # the slot went (or was activated) meanwhile
        r = rec.report
        msg = (
            f"engine {rec.engine} prepared in {r.seconds:.2f}s ({r.host_bytes} host bytes)"
            if r.state == PreparedState.READY
            else f"engine {rec.engine} not prepared: {r.message}"
        )
        self._state.emit(EventKind.SLOT, slot_id, msg)

    def claim(self, slot: SlotRec, engine: str, engine_args: Sequence[str]) -> EngineHost | None:
        """Activation of ``slot`` with ``engine``/``engine_args``: the host holding its prepared
        engine (being built or ready: its ``start`` waits for the build), or None (none, failed,
        or prepared for others, which is torn down).  The caller holds the state's lock."""
        self.wanted.pop(slot.slot_id, None)
        rec = self.prepared.pop(slot.slot_id, None)
        if rec is None or rec.host is None:
            return None
        with rec.lock:
            rec.over = True
            usable = rec.asked and rec.report.state in (
                PreparedState.PREPARING,
                PreparedState.READY,
            )
            if usable and (rec.engine, rec.engine_args) == (engine, tuple(engine_args)):
                return rec.host
            if rec.asked:
                rec.host.drop_prepared()
        return None

    def forget(self, slot_id: str) -> None:
        """The slot is gone: tear its engine down (in its worker, in the background)."""
        self.wanted.pop(slot_id, None)
        rec = self.prepared.pop(slot_id, None)
        if rec is not None and rec.host is not None:
            with rec.lock:
                rec.over = True
                if rec.asked:
                    rec.host.drop_prepared()

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the preparations in flight to finish (tests, benchmarks)."""
        for t in list(self._threads):
            t.join(timeout_s)

    def worker_lost(self, gpu: int) -> None:
        """``gpu``'s worker died: the engine it held is gone with it."""
        with self._state.lock:
            for sid, rec in list(self.prepared.items()):
                if rec.gpu == gpu:
                    rec.over = True
                    del self.prepared[sid]

    def of_gpu(self, gpu: int) -> tuple[str, PreparedRec] | None:
        """The slot whose engine ``gpu``'s worker holds, if any."""
        for sid, rec in list(self.prepared.items()):
            if rec.gpu == gpu and rec.report.state in (
                PreparedState.PREPARING,
                PreparedState.READY,
            ):
                return sid, rec
        return None
