"""The deployments the loop serves: parsed from kopf's index, their policy specs, load
histories (read once, written as windows close) and what status reports need of them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from warmserve.api import history as history_io
from warmserve.api.crd import ModelDeploymentSpec, SpecError
from warmserve.control.controller import Controller, ModelEntry
from warmserve.control.decisions import Decisions

from .engine import admit_model_deployment
from .metrics import Metrics
from .model_spec import merged_catalog, resolve, tp_refusal
from .ports import KubePort
from .report import REPORT_CONCURRENCY, Deployment, Reporter
from .snapshot import NodeSnapshot
from .sources import SourceCatalog
from .status import Condition

log = logging.getLogger("warmserve.operator")

HISTORY_WRITES = REPORT_CONCURRENCY  # histories written at once when a window closes


class DeploymentBook:
    """ModelDeployments by UID, and which of them are being torn down."""

    def __init__(
        self,
        kube: KubePort,
        reporter: Reporter,
        controller: Controller,
        metrics: Metrics,
        cfg: Any,
        clock: Callable[[], float],
    ) -> None:
        self.kube = kube
        self.reporter = reporter
        self.controller = controller
        self.metrics = metrics
        self.cfg = cfg
        self.clock = clock
        self.items: dict[str, Deployment] = {}
        self.sources = SourceCatalog(clock)  # sizes of models only at their spec.model.source
        # UIDs being (or just) torn down -> when teardown finished (inf while it runs); nothing
        # is started or prewarmed for them until a later listing drops them.
        self.deleting: dict[str, float] = {}
        self.live_uids: frozenset[str] = frozenset()

    async def sync(self) -> tuple[list[ModelDeploymentSpec], bool]:
        listed_at = self.clock()
        mds: list[ModelDeploymentSpec] = []
        invalid = False
        for body in await self.kube.list_model_deployments():
            meta = body.get("metadata", {})
            try:
                # admission: the tenant allowlist applies before anything starts
                md = admit_model_deployment(body, self.cfg.engine_policy)
            except SpecError as exc:
                invalid = True  # do not treat its model's slots as orphans
                await self.reporter.problem(
                    meta.get("namespace", ""),
                    meta.get("name", ""),
                    meta.get("uid", ""),
                    "InvalidSpec",
                    str(exc),
                )
                continue
            refused = self._source_refusal(md)
            if refused:
                # Left out as if absent: it owns no model name, nothing is fetched, inspected or
                # started for it, and what already runs for it ends as an orphan (a source the
                # admin revoked).  Not `invalid`: that would stop orphan clean-up cluster-wide.
                await self.reporter.problem(
                    md.namespace, md.name, md.uid, "SourceNotAllowed", refused, md.generation
                )
                continue
            mds.append(md)
            d = self.items.get(md.uid)
            if d is None:
                d = self.items[md.uid] = Deployment(md, raw_status=body.get("status") or {})
                self.metrics.model_seen(md.model)
                observed = (body.get("status") or {}).get("observedGeneration")
                d.seen_generation = int(observed) if observed is not None else None
            d.md = md
            self._lifecycle_event(d)
            if not d.counters_loaded:
                d.counters_loaded = True
                pre = (body.get("status") or {}).get("prewarm") or {}
                d.hits, d.misses = int(pre.get("hits", 0)), int(pre.get("misses", 0))
        self.live_uids = frozenset(md.uid for md in mds if md.uid)
        for uid in list(self.items):
            if uid not in self.live_uids:
                del self.items[uid]
        for uid, done in list(self.deleting.items()):
            if listed_at > done:
                self.deleting.pop(uid)
        return mds, invalid

    def _source_refusal(self, md: ModelDeploymentSpec) -> str:
        return str(self.cfg.model_sources.refusal(md.namespace, md.source))

    def _lifecycle_event(self, d: Deployment) -> None:
        """``Accepted`` for a deployment no operator reported on yet (no
        ``status.observedGeneration``), ``SpecChanged`` when its generation is newer than the one
        last seen or reported: once per generation, also across restarts, without kopf's
        create/update handlers and their diff-base write per object."""
        md, seen = d.md, d.seen_generation
        if seen is not None and md.generation <= seen:
            return
        d.seen_generation = md.generation
        self.reporter.later(
            d.ref,
            "Normal",
            "Accepted" if seen is None else "SpecChanged",
            f"model {md.model}, tensorParallel {md.tp}, maxBatchSize {md.max_batch}, "
            f"instances {md.min_instances}..{md.max_instances}, prewarm "
            f"{'on' if md.prewarm else 'off'}",
        )

    async def resolve(
        self,
        owners: Mapping[str, ModelDeploymentSpec],
        dups: list[ModelDeploymentSpec],
        snaps: Mapping[str, NodeSnapshot],
        now: float,
    ) -> dict[str, Condition]:
        """Each owner's policy spec (from its spec and the agents' catalogs), the controller's
        managed models, and why a deployment cannot be acted on."""
        catalog: dict[str, Any] = dict(self.sources.entries())  # only at their sources yet
        catalog.update(merged_catalog(snap.models for snap in snaps.values()))
        problems: dict[str, Condition] = {}
        for md in dups:
            msg = f"model {md.model!r} is already served by another ModelDeployment"
            problems[md.uid] = Condition("Degraded", True, "DuplicateModel", msg)
        entries: dict[str, ModelEntry] = {}
        for model, md in owners.items():
            d = self.items[md.uid]
            try:
                d.spec, d.depth = resolve(md, catalog, self.cfg.load_bandwidth)
            except SpecError as exc:
                d.spec, d.depth = None, None
                why = self.sources.error(md)
                if why:
                    problems[md.uid] = Condition(
                        "Degraded", True, "SourceUnavailable", f"{md.source}: {why}"
                    )
                elif snaps:
                    problems[md.uid] = Condition("Degraded", True, "ModelNotFound", str(exc))
                # With no agent heard from yet (the first poll after a fresh start) no weight
                # cache is known: "not found" would be a guess, and the gateway answers a
                # permanent reason with 503 at once.  The status says NoAgents instead (report),
                # which the gateway holds through.
                continue
            why_tp = tp_refusal(md, catalog.get(model))
            if why_tp:  # before any prewarm or Activate: the engine cannot run this split
                problems[md.uid] = Condition("Degraded", True, "Unplaceable", why_tp)
                continue
            if snaps and md.model not in catalog and not md.source:
                # Sized by its spec but in no reachable agent's weight store: every prewarm or
                # start would be refused, so the controller does not manage it.
                problems[md.uid] = Condition(
                    "Degraded",
                    True,
                    "ModelNotInStore",
                    f"model {md.model!r} is in the weight store of none of the {len(snaps)} "
                    "reachable node agents; copy its weights to the nodes",
                )
                continue
            stored = (s.models[model].source for s in snaps.values() if model in s.models)
            why = self.cfg.model_sources.store_refusal(md.namespace, model, stored)
            if why:
                problems[md.uid] = Condition("Degraded", True, "SourceNotAllowed", why)
                continue
            if md.uid not in self.deleting:
                entries[model] = ModelEntry(
                    d.spec, md.min_instances, md.max_instances, md.prewarm, md.namespace
                )
        self.controller.set_models(entries, now)
        return problems

    async def load_histories(self, managed: Mapping[str, ModelDeploymentSpec], now: float) -> None:
        """Seed each new deployment's stored history, read in one call however many.  A history
        absent at first sight is looked for once more a poll later: one written right after
        its deployment (restored, or by a bench) is not missed for a whole window."""
        todo = {}
        for model, md in managed.items():
            d = self.items[md.uid]
            first = d.history_missed_at
            if not d.history_loaded and (first is None or now - first >= self.cfg.poll_s):
                todo[md.uid] = model
        if not todo:
            return
        stored = await self.kube.read_histories(list(todo))
        for uid, model in todo.items():
            d = self.items[uid]
            data = stored.get(uid)
            if not data and d.history_missed_at is None:
                d.history_missed_at = now
                continue
            d.history_loaded = True
            if not data:
                continue
            try:
                hist = history_io.from_data(data, self.cfg.window_s)
            except history_io.HistoryError as exc:
                log.warning("event=history_unreadable model=%s error=%r", model, str(exc))
                continue
            self.controller.seed_history(model, hist, now)

    def note_demand(
        self,
        managed: Mapping[str, ModelDeploymentSpec],
        loads: Mapping[str, float],
        held: Mapping[str, int],
        gateway_replicas: int | None,
        demand: object | None,
    ) -> None:
        """What status reports of demand: at the instances and held at the gateways."""
        for model, md in managed.items():
            d = self.items[md.uid]
            h = float(held.get(model, 0))
            d.inflight = loads.get(model, 0.0) - h
            d.held = h if demand is not None else None
            d.gateway_replicas = gateway_replicas

    def count_start(self, uid: str, hit: bool) -> None:
        """An instance of deployment ``uid`` started (a prewarm hit or a cold start)."""
        d = self.items.get(uid)
        if d is None:
            return
        if hit:
            d.hits += 1
        else:
            d.misses += 1
        self.metrics.hit_ratio.labels(d.md.model).set(d.hits / max(d.hits + d.misses, 1))

    def record(self, out: Decisions, managed: Mapping[str, ModelDeploymentSpec]) -> None:
        for model, md in managed.items():
            d = self.items[md.uid]
            d.no_capacity = out.no_capacity.get(model, "")
            if model in out.scale:
                d.desired = out.scale[model].desired
            if out.plan is not None:
                d.replicas = tuple(r for r in out.plan.replicas if r.model == model)
                un = [u for u in out.plan.unplaced if u.model == model]
                d.unplaced, d.unplaced_reason = len(un), (un[0].reason if un else "")
                self.metrics.unplaced.labels(model).set(len(un))
        for model, fc in ((m, self.controller.forecast_of(m)) for m in managed):
            if fc is not None:
                self.metrics.predicted.labels(model, "avg").set(fc.avg)
                self.metrics.predicted.labels(model, "peak").set(fc.peak)

    async def persist(self) -> None:
        """Write the windows the controller closed (best effort; retried next window)."""
        closed = self.controller.take_closed()
        if closed:
            self.metrics.windows.inc()
        owners: dict[str, Deployment] = {}
        for d in self.items.values():
            owners.setdefault(d.md.model, d)
        gate = asyncio.Semaphore(HISTORY_WRITES)

        async def write(model: str, owner: Deployment) -> None:
            hist = self.controller.history(model)
            last = self.controller.last_window(model)
            if last is not None:
                self.metrics.observed.labels(model, "avg").set(last[1])
                self.metrics.observed.labels(model, "peak").set(last[2])
            async with gate:
                try:
                    await self.kube.write_history(
                        owner.md.uid, history_io.to_data(hist, model), owner.md.key
                    )
                except Exception as exc:
                    log.warning("event=history_write_failed model=%s error=%r", model, str(exc))

        # Together, not one after the other: 1,000 histories written in a row held the loop
        # ~10 s at every window boundary at scale.
        await asyncio.gather(*(write(m, owners[m]) for m in closed if m in owners))
        if closed:
            await self.collect_histories()

    async def collect_histories(self) -> None:
        """Delete stored histories whose deployment is gone (its finalizer was bypassed)."""
        try:
            for uid in await self.kube.list_history_uids():
                if uid not in self.live_uids and uid not in self.deleting:
                    log.info("event=history_orphan_deleted uid=%s", uid)
                    await self.kube.delete_history(uid)
        except Exception as exc:  # best effort; the next window retries
            log.warning("event=history_gc_failed error=%r", str(exc))
