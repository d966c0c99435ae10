"""Describe: the node's state as ``warmserve.agent.v1`` messages, and the cached model catalogue.

The conversions of GPU workers (their Figure 5 state, §4), prewarm slots (§4.1) and instances
(with their lendable grace memory, Eq. 1) to protobuf live here, once, for ``Describe``, the
``Watch`` stream's objects and every RPC's answer.  The weight store's catalogue is re-scanned
only when the store changed (a model added or removed) and at most every ``CATALOG_TTL_S``
otherwise: with 1,000 models a scan per Describe made every operator poll slow.

:class:`Describer` is held by the servicer (:class:`~warmserve_agent.service.AgentService`)
and handed to the handlers and the Watch hub, which answer with its messages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.api.agent.wire import PHASE_TO_PB, SLOT_TO_PB, WORKER_TO_PB
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent import __version__
from warmserve_agent.activation_stages import ActivationStages
from warmserve_agent.engines.spec import PreparedReport, PreparedState
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import InstanceRec, SlotRec
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.sources.wire import fetch_pb, store_pb

log = logging.getLogger("warmserve.agent.service")  # one logger for the whole service

CATALOG_TTL_S = 10.0  # see Describer._catalog

_WS = WORKER_TO_PB
_SS = SLOT_TO_PB
_IP = PHASE_TO_PB
# The prepared engine's state and the stage timings are encoded here, not in
# warmserve.api.agent.wire: their values are the agent's own types, which the API may not import.
PREPARED_TO_PB = {
    PreparedState.NONE: pb.PREPARED_ENGINE_STATE_UNSPECIFIED,
    PreparedState.PREPARING: pb.PREPARED_ENGINE_STATE_PREPARING,
    PreparedState.READY: pb.PREPARED_ENGINE_STATE_READY,
    PreparedState.FAILED: pb.PREPARED_ENGINE_STATE_FAILED,
}


def prepared_pb(engine: str, gpu: int, r: PreparedReport) -> pb.PreparedEngine:
    return pb.PreparedEngine(
        state=PREPARED_TO_PB[r.state],
        engine=engine,
        worker_gpu=gpu,
        host_bytes=r.host_bytes,
        build_seconds=r.seconds,
        message=r.message[:1000],
    )


def stages_pb(st: ActivationStages) -> pb.ActivationStages:
    out = pb.ActivationStages(engine_prepared=st.engine_prepared)
    for stage, seconds in st.known().items():
        setattr(out, f"{stage.value}_seconds", seconds)
    return out


@dataclass
class ServiceInfo:
    agent_id: str
    started_unix: float = field(default_factory=time.time)
    spare_workers: Callable[[], int] = lambda: 0
    worker_pid: Callable[[int], int] = lambda g: 0
    worker_restarts: Callable[[int], int] = lambda g: 0


class Describer:
    """``Describe`` and the conversions every RPC answers with (see module docstring)."""

    def __init__(self, core: NodeCore, info: ServiceInfo, fetcher: ModelFetcher | None) -> None:
        self.core = core
        self.info = info
        self.fetcher = fetcher
        self._usage: tuple[int, float, pb.StoreInfo] | None = None
        self._catalog_cache: tuple[tuple[int, ...], float, list[pb.ModelInfo]] | None = None

    # ---- conversions -----------------------------------------------------------------------
    def gpu_pb(self, g: int) -> pb.GpuInfo:
        rec = self.core.gpus[g]
        mm = self.core.mm
        page = self.core.page
        held = self.core.preparer.of_gpu(g)
        return pb.GpuInfo(
            index=g,
            memory_bytes=rec.memory_bytes,
            page_bytes=page,
            pages_total=mm.num_pages(g),
            pages_free=mm.free_pages(g),
            free_bytes=0 if rec.state == WorkerState.DEDICATED else mm.available_pages(g) * page,
            state=_WS[rec.state],
            worker_pid=self.info.worker_pid(g),
            worker_restarts=self.info.worker_restarts(g),
            slot_ids=[s.slot_id for s in self.core.slots.values() if g in s.gpus],
            instance_id=rec.instance_id,
            prepared_slot_id=held[0] if held else "",
            prepared_engine_host_bytes=held[1].report.host_bytes if held else 0,
        )

    def slot_pb(self, s: SlotRec) -> pb.SlotInfo:
        rec = self.core.preparer.prepared.get(s.slot_id)
        return pb.SlotInfo(
            slot_id=s.slot_id,
            model=s.model,
            gpus=list(s.gpus),
            layers_resident=s.layers_resident,
            layers_total=s.layers_total,
            layers_target=s.layers_target,
            resident_bytes_per_gpu=s.resident_bytes,
            weight_bytes_per_gpu=s.layout.total_bytes,
            state=_SS[s.state],
            message=s.message,
            owner=s.owner,
            prepared_engine=(
                prepared_pb(rec.engine, rec.gpu, rec.report) if rec is not None else None
            ),
        )

    def instance_pb(self, i: InstanceRec) -> pb.InstanceInfo:
        st = i.last_stats
        slot = self.core.slots.get(i.slot_id)
        page = self.core.page
        return pb.InstanceInfo(
            instance_id=i.instance_id,
            model=i.model,
            gpus=list(i.gpus),
            endpoint=i.endpoint,
            phase=_IP[i.phase],
            running=st.running,
            waiting=st.waiting,
            max_batch=i.max_batch,
            kv_capacity_bytes=i.kv_pages * page * len(i.gpus),
            kv_used_bytes=st.kv_used_bytes,
            lendable_bytes=(
                min(self.core.mm.available_pages(g) for g in i.gpus) * page
                if i.phase == InstancePhase.GRACE
                else 0
            ),
            lent_bytes=(i.kv_pages_initial - i.kv_pages) * page,
            prewarm_hit=i.prewarm_hit,
            slot_id=i.slot_id,
            layers_resident=slot.layers_resident if slot else 0,
            layers_total=slot.layers_total if slot else 0,
            started_unix=i.started_unix,
            engine=i.engine_name,
            ttft_p95_seconds=st.ttft_p95_s,
            ttft_samples=st.ttft_samples,
            ttft_window_seconds=st.ttft_window_s,
            dropped_requests=st.dropped,
            owner=i.owner,
            grace_started_unix=i.grace_started_unix,
            stages=stages_pb(i.stages),
        )

    def _refresh_stats(self) -> None:
        for i in list(self.core.instances.values()):
            if i.phase == InstancePhase.STARTING:
                continue
            try:
                self.core.engine_stats(i)  # last_stats, and the stages it reached
            except Exception as exc:  # worker died: the monitor will reconcile
                log.debug("event=stats_failed instance=%s err=%s", i.instance_id, exc)

    def _catalog_stamp(self) -> tuple[int, ...]:
        """What changes when a model is added or removed: the mtime of the store's root (every
        model, ``ORG/NAME`` too, is one entry there: ``warmserve.modelref.store_dirname``) and
        the fetcher's generation (fetch end, eviction)."""
        try:
            mtime = self.core.store.root.stat().st_mtime_ns
        except OSError:
            mtime = 0
        return (self.fetcher.generation if self.fetcher else 0, mtime)

    def _catalog(self) -> list[pb.ModelInfo]:
        """The weight store's models, re-scanned when the store changed (a model added or
        removed: see ``_catalog_stamp``) and at most every ``CATALOG_TTL_S`` otherwise: with
        1,000 models a scan per Describe made every poll slow."""
        store = self.core.store
        stamp = self._catalog_stamp()
        now = time.monotonic()
        cached = self._catalog_cache
        if cached is not None and cached[0] == stamp and now - cached[1] < CATALOG_TTL_S:
            return self._with_profiles(cached[2])
        models = []
        names = store.list_models()
        for name in names:
            try:
                m = store.model(name)
            except Exception:  # a malformed model dir is reported by Prewarm, not here
                continue
            source, disk, used = self.fetcher.model_info(name) if self.fetcher else ("", 0, 0)
            models.append(
                pb.ModelInfo(
                    name=name,
                    num_layers=m.num_layers,
                    weight_bytes=m.weight_bytes,
                    num_tensors=len(m.tensors),
                    max_batch=m.profile.max_batch,
                    source=source,
                    disk_bytes=disk,
                    last_used_unix=used,
                    attention_heads=m.tp_shape.heads if m.tp_shape else 0,
                    kv_heads=m.tp_shape.kv_heads if m.tp_shape else 0,
                )
            )
        self._catalog_cache = (stamp, now, models)
        return self._with_profiles(models)

    def _with_profiles(self, models: list[pb.ModelInfo]) -> list[pb.ModelInfo]:
        """The models with what the agent measured so far (not cached: it changes with every
        load and activation)."""
        profiles = self.core.state.profiles
        for m in models:
            p = profiles.pb(m.name)
            if p is None:
                m.ClearField("profile")
            else:
                m.profile.CopyFrom(p)
        return models

    def describe_pb(self, refresh: bool = True) -> pb.NodeDescription:
        core = self.core
        with core.lock:
            if refresh:
                self._refresh_stats()
            models = self._catalog()
            return pb.NodeDescription(
                node_name=core.node_name,
                agent_version=__version__,
                backend=core.mm.backend.name,
                page_bytes=core.page,
                gpus=[self.gpu_pb(g) for g in sorted(core.gpus)],
                slots=[self.slot_pb(s) for s in core.slots.values()],
                instances=[self.instance_pb(i) for i in core.instances.values()],
                models=models,
                generation=core.generation,
                agent_id=self.info.agent_id,
                agent_started_unix=self.info.started_unix,
                spare_workers=self.info.spare_workers(),
                fetches=[fetch_pb(f) for f in self.fetcher.statuses()] if self.fetcher else [],
                store=self._store_info(),
            )

    def _store_info(self) -> pb.StoreInfo:
        """The store's usage, recomputed after each fetch or eviction, else at most every 5 s (it
        walks pre-filled models)."""
        if self.fetcher is None:
            return pb.StoreInfo()
        now = time.monotonic()
        gen = self.fetcher.generation
        if self._usage is None or self._usage[0] != gen or now - self._usage[1] > 5.0:
            self._usage = (gen, now, store_pb(self.fetcher.usage()))
        return self._usage[2]
