"""The cluster-level loop: measure load, predict, place, scale, report (WarmServe §5).

Every poll interval (default 5 s) the active operator:

1. lists ModelDeployments and GPUNodes from the API and asks every agent to Describe itself —
   the agents are the source of truth for slots and instances, so a restarted operator rebuilds
   its whole view from them and never duplicates an instance (request ids are deterministic,
   see :mod:`.actions`);
2. feeds each model's in-flight count (requests running + queued at its instances) into a
   :class:`~warmserve.policy.load.WindowLoadTracker`;
3. at each window boundary (wall-clock aligned, default 300 s): closes the window, records its
   average and peak in the persisted history (:mod:`.history`), forecasts the next window with
   the policy predictor (§5.1) and runs Algorithm 1 (§5.2) to prewarm/evict replicas;
4. between windows, reacts to agent events: when free memory appears (an instance ended, a
   grace instance lent KV memory, §4.1) it re-plans with the current forecasts; a lost agent is
   dropped after ``agent_lost_after`` failed polls, and its instances are replaced elsewhere;
5. runs the autoscaler every poll and starts instances where the policy's start choice says
   (a prewarm hit when possible), drains scale-downs into grace periods and ends them;
6. writes statuses and Events.

Agent calls run as background tasks (a cold start can take a minute); until an agent reports
their result, in-flight prewarms and starts are added to the snapshot so the next poll does not
decide them again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from warmserve.policy.autoscaler import AutoscalerConfig, ScaleMemory
from warmserve.policy.cluster import LoadForecast, ModelSpec, PolicyInputError, Replica
from warmserve.policy.load import WindowLoadTracker
from warmserve.policy.placement import PrewarmPlan

from .actions import Action, Activate, BeginGrace, EndInstance, Evict, Prewarm, describe
from .agents import AgentCallError, AgentPool, NodeSnapshot
from .gateway_demand import GatewayDemand, GatewayHeld
from .history import HistoryError, LoadHistory
from .kube import KubePort, ObjRef, md_ref, node_ref
from .metrics import Metrics
from .planning import (
    Built,
    PendingPrewarm,
    PendingStart,
    build_state,
    orphan_actions,
    scaling_actions,
    teardown_actions,
    window_actions,
)
from .sources import SourceCatalog, fetch_event
from .spec import (
    DEFAULT_LOAD_BANDWIDTH,
    GPUNodeSpec,
    ModelDeploymentSpec,
    SpecError,
    dedupe_models,
    parse_gpu_node,
    parse_model_deployment,
    resolve_model,
)
from .status import Condition, ModelView, model_status, node_status, now_iso, strip_volatile

log = logging.getLogger("warmserve.operator")

MIN_TICK_S = 0.25
# Agent Watch events that may change a decision before the next poll: an instance ended or
# appeared (GPUs freed/taken), a slot removed or changed (memory freed, a load finished), a
# worker replaced (an instance may be lost).  GPU events cover lent KV memory (§4.1).
WAKE_EVENTS = frozenset(
    {
        "KIND_INSTANCE_REMOVED",
        "KIND_INSTANCE",
        "KIND_SLOT_REMOVED",
        "KIND_SLOT",
        "KIND_GPU",
        "KIND_WORKER_REPLACED",
    }
)


@dataclass(frozen=True)
class OperatorConfig:
    """Tunables of the loop (``warmserve operator`` flags / env)."""

    window_s: float = 300.0
    poll_s: float = 5.0
    predictor: str | None = None  # None: the policy core's default predictor
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH
    agent_lost_after: int = 3
    evict_aware: bool = True
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    node_status_refresh_s: float = 30.0
    # Consecutive polls this replica must see itself as leader before acting: a replica that
    # just started may not see a peer that registered a moment later (see docs/operator.md).
    leader_settle_polls: int = 2

    def __post_init__(self) -> None:
        from warmserve.policy.predictor import season_length

        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PolicyInputError(f"window must be > 0 seconds, got {self.window_s}")
        season_length(self.window_s)  # raises unless the window divides a day
        if not (math.isfinite(self.poll_s) and 0 < self.poll_s <= self.window_s):
            raise PolicyInputError(f"poll interval must be in (0, window], got {self.poll_s}")
        if self.agent_lost_after < 1:
            raise PolicyInputError("agent_lost_after must be >= 1")
        if self.load_bandwidth <= 0:
            raise PolicyInputError("load bandwidth must be > 0")


@dataclass
class ModelRuntime:
    """What the operator remembers about one model between polls (rebuilt after a restart)."""

    md: ModelDeploymentSpec
    tracker: WindowLoadTracker
    history: LoadHistory | None = None
    forecast: LoadForecast | None = None
    last_window: tuple[float, float, float] | None = None  # (start, avg, peak)
    hits: int = 0
    misses: int = 0
    counters_loaded: bool = False
    scale_memory: ScaleMemory | None = None
    replicas: tuple[Replica, ...] = ()
    unplaced: int = 0
    unplaced_reason: str = ""
    no_capacity: str = ""
    last_status: Any = None
    raw_status: Mapping[str, Any] | None = None
    spec: ModelSpec | None = None
    desired: int | None = None
    history_dirty: bool = False
    inflight: float = 0.0  # at its instances, last poll
    held: float = 0.0  # at the gateways, last poll


@dataclass
class NodeRuntime:
    spec: GPUNodeSpec
    snap: NodeSnapshot | None = None
    failures: int = 0
    lost: bool = False
    last_seen: float | None = None
    error: str = ""
    last_status: Any = None
    last_write: float = 0.0
    raw_status: Mapping[str, Any] | None = None


class Reconciler:
    """One instance per operator process; :meth:`run` is the loop, :meth:`tick` one poll."""

    def __init__(
        self,
        config: OperatorConfig,
        kube: KubePort,
        agents: AgentPool,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        demand: GatewayDemand | None = None,
    ) -> None:
        from warmserve.policy.predictor import make_predictor, season_length

        self.cfg = config
        # Requests held at the gateways (None: no gateway configured); see gateway_demand.py.
        self.demand = demand
        self.gateway_replicas: int | None = None
        self.kube = kube
        self.agents = agents
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.windows_per_day = season_length(config.window_s)
        make_predictor(config.predictor)  # fail fast on an unknown predictor name
        self.models: dict[str, ModelRuntime] = {}  # by model name (policy key)
        self.nodes: dict[str, NodeRuntime] = {}
        self.window_index: int | None = None
        self.leader = False
        self._leader_streak = 0
        self._wake = asyncio.Event()
        self._watching = False  # only inside run(): unit tests drive tick() directly
        self._watchers: dict[str, tuple[str, asyncio.Task[None]]] = {}
        # UIDs of deployments that are (or were just) torn down -> when teardown finished (inf
        # while it runs).  Nothing but evictions is issued for them until a listing of deployments
        # that started after the teardown finished, so a poll that listed the deployment just
        # before its deletion cannot prewarm it again.
        self.deleting: dict[str, float] = {}
        self.pending_prewarms: dict[tuple[str, str, tuple[int, ...]], PendingPrewarm] = {}
        self.pending_starts: dict[tuple[str, tuple[int, ...]], PendingStart] = {}
        self.grace_started: dict[str, float] = {}
        self.sources = SourceCatalog(clock)  # sizes of models only at their spec.model.source
        self._live_uids: frozenset[str] = frozenset()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.last_built: Built | None = None
        self.last_free: dict[tuple[str, int], int] = {}
        self._replan = False
        self._events_seen: dict[tuple[str, str, str], float] = {}
        self._known_instances: dict[str, tuple[str, str]] = {}  # id -> (node, model)
        self._ended_by_us: set[str] = set()
        self._raw_status: dict[str, Mapping[str, Any]] = {}
        self._invalid_seen: dict[
            str, str
        ] = {}  # uid -> message already reported  # last status read, by deployment uid

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set; errors of one poll are logged, never fatal."""
        self._watching = True
        if self.demand is not None:
            self.demand.watch(self._wake.set)  # held demand at a gateway wakes the loop
        try:
            while not stop.is_set():
                started = self.clock()
                self._wake.clear()
                try:
                    await self.tick()
                except Exception:  # keep the loop alive; the next poll starts from the API again
                    log.exception("event=tick_failed")
                await self._sleep(stop, started)
        finally:
            self._stop_watchers()
            if self.demand is not None:
                await self.demand.close()
            await self.drain_tasks(timeout=5.0)

    async def _sleep(self, stop: asyncio.Event, started: float) -> None:
        """Until the next poll, or earlier when an agent reports a change (not sooner than
        ``MIN_TICK_S`` after the last poll, so a burst of agent events costs one poll)."""
        await asyncio.sleep(max(MIN_TICK_S - (self.clock() - started), 0))
        delay = max(self.cfg.poll_s - (self.clock() - started), 0.0)
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def _sync_watchers(self) -> None:
        """One Watch stream per agent while this replica leads; agent events wake the loop."""
        if not self._watching:
            return
        want = {name: rt.spec.address for name, rt in self.nodes.items()} if self.leader else {}
        for name in list(self._watchers):
            addr, task = self._watchers[name]
            if want.get(name) != addr or task.done():
                task.cancel()
                del self._watchers[name]
        for name, addr in want.items():
            if name not in self._watchers:
                task = asyncio.get_running_loop().create_task(self._watch(name, addr))
                self._watchers[name] = (addr, task)

    def _stop_watchers(self) -> None:
        for _, task in self._watchers.values():
            task.cancel()
        self._watchers.clear()

    async def _watch(self, node: str, address: str) -> None:
        client = self.agents.get(node, address)
        watch = getattr(client, "watch", None)
        if watch is None:
            return
        while True:
            try:
                async for kind in watch():
                    if kind in WAKE_EVENTS:
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the poll still covers this agent; retry the stream
                log.debug("event=watch_failed node=%s error=%r", node, str(exc))
            await asyncio.sleep(self.cfg.poll_s)

    async def drain_tasks(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)

    async def tick(self) -> None:
        """One poll: observe, measure, (window) plan, scale, act, report."""
        now = self.clock()
        self._leader_streak = self._leader_streak + 1 if await self.kube.is_leader() else 0
        self.leader = self._leader_streak >= self.cfg.leader_settle_polls
        self.metrics.leader.set(1 if self.leader else 0)
        if not self.leader:
            self._sync_watchers()
            return
        self.metrics.polls.inc()
        mds, invalid = await self._observe(now)
        snaps = self._live_snaps()
        owners, dups = dedupe_models(mds)
        await self.sources.refresh(
            owners,
            {m: e for snap in snaps.values() for m, e in snap.models.items()},
            [self.agents.get(n, self.nodes[n].spec.address) for n in snaps],
        )
        self._live_uids = frozenset(md.uid for md in mds if md.uid)
        specs, problems = self._resolve(owners, dups, snaps, now)
        await self._load_history_and_counters(specs)
        held = await self._gateway_held()
        loads = self._measure(snaps, specs, now, held)
        if self._window_due(now):
            await self._close_windows(now, specs)
            self._replan = True
        if not self._replan and self._free_memory_grew(snaps):
            self._replan = True
        grace = self._grace_clock(snaps, now)
        built, actions = self._decide(specs, snaps, loads, now, grace)
        if not invalid:
            actions += orphan_actions(built, now, grace, self.cfg.autoscaler.max_grace_s)
        self.last_built = built
        self._track_instances(snaps, now)
        self._launch(actions)
        await self._write_statuses(built, owners, dups, problems, now)

    async def _observe(self, now: float) -> tuple[list[ModelDeploymentSpec], bool]:
        """Deployments and GPU nodes from the API, then every agent's Describe."""
        listed_at = self.clock()
        mds, invalid = await self._load_deployments()
        for uid, done in list(self.deleting.items()):
            if listed_at > done:
                self.deleting.pop(uid)
        try:
            await self.kube.sync_agent_nodes()
        except Exception as exc:  # discovery is best effort; registered GPUNodes still work
            log.warning("event=agent_discovery_failed error=%r", str(exc))
        await self._load_nodes()
        await self._describe_all(now)
        return mds, invalid

    def _resolve(
        self,
        owners: Mapping[str, ModelDeploymentSpec],
        dups: list[ModelDeploymentSpec],
        snaps: Mapping[str, NodeSnapshot],
        now: float,
    ) -> tuple[dict[str, ModelSpec], dict[str, Condition]]:
        """The policy's ModelSpec of every deployment it can act on, and why not for others."""
        catalog: dict[str, Any] = dict(self.sources.entries())  # only at their sources yet
        for snap in snaps.values():
            catalog.update(snap.models)
        specs: dict[str, ModelSpec] = {}
        problems: dict[str, Condition] = {}
        for md in dups:
            problems[md.key] = Condition(
                "Degraded",
                True,
                "DuplicateModel",
                f"model {md.model!r} is already served by another ModelDeployment",
            )
        for model, md in owners.items():
            rt = self._runtime(md, now)
            try:
                rt.spec = resolve_model(md, catalog, self.cfg.load_bandwidth)
                specs[model] = rt.spec
            except SpecError as exc:
                rt.spec = None
                why = self.sources.error(md)
                problems[md.key] = (
                    Condition("Degraded", True, "SourceUnavailable", f"{md.source}: {why}")
                    if why
                    else Condition("Degraded", True, "ModelNotFound", str(exc))
                )
        for model in list(self.models):
            if model not in owners:
                self.models.pop(model)
        return specs, problems

    def _decide(
        self,
        specs: Mapping[str, ModelSpec],
        snaps: Mapping[str, NodeSnapshot],
        loads: Mapping[str, float],
        now: float,
        grace: Mapping[str, float],
    ) -> tuple[Built, list[Action]]:
        """Autoscaler starts/drains first, then (when due) Algorithm 1 on the state after them."""
        active = {m: s for m, s in specs.items() if self.models[m].md.uid not in self.deleting}
        forecasts = {
            m: rt.forecast
            for m, rt in self.models.items()
            if m in active and rt.forecast is not None and rt.md.prewarm
        }
        built = build_state(
            active,
            snaps,
            forecasts,
            pending_prewarms=self.pending_prewarms.values(),
            pending_starts=self.pending_starts.values(),
            owners={m: self.models[m].md.uid for m in active},
            live=self._live_uids,
        )
        bounds = {
            m: (self.models[m].md.min_instances, self.models[m].md.max_instances) for m in specs
        }
        scaling = scaling_actions(
            built,
            loads,
            bounds,
            self.cfg.autoscaler,
            now,
            {m: rt.scale_memory for m, rt in self.models.items() if rt.scale_memory},
            grace,
        )
        for m, memory in scaling.memory.items():
            if m in self.models:
                self.models[m].scale_memory = memory
                self.models[m].desired = scaling.decisions[m].desired
        for m, rt in self.models.items():
            rt.no_capacity = scaling.no_capacity.get(m, "")
        actions: list[Action] = list(scaling.actions)
        if self._replan:
            t0 = time.perf_counter()
            after_starts = Built(
                scaling.state,
                built.slot_of,
                built.orphan_slots,
                built.orphan_instances,
                built.snaps,
                built.owners,
            )
            plan, prewarm_actions = window_actions(after_starts, evict_aware=self.cfg.evict_aware)
            self.metrics.plan_seconds.observe(time.perf_counter() - t0)
            self._record_plan(plan, specs)
            actions += prewarm_actions
            self._replan = False
            self.last_free = self._free_map(snaps)
        return built, actions

    # ------------------------------------------------------------------ observe

    async def _load_deployments(self) -> tuple[list[ModelDeploymentSpec], bool]:
        mds: list[ModelDeploymentSpec] = []
        invalid = False
        for body in await self.kube.list_model_deployments():
            uid = body.get("metadata", {}).get("uid", "")
            self._raw_status[uid] = body.get("status") or {}
            try:
                mds.append(parse_model_deployment(body))
            except SpecError as exc:
                invalid = True  # do not treat its model's slots as orphans
                meta = body.get("metadata", {})
                if self._invalid_seen.get(uid) == str(exc):
                    continue  # already reported
                self._invalid_seen[uid] = str(exc)
                stamp = now_iso()
                await self.kube.patch_md_status(
                    meta.get("namespace", ""),
                    meta.get("name", ""),
                    {
                        "conditions": [
                            {
                                "type": "Degraded",
                                "status": "True",
                                "reason": "InvalidSpec",
                                "message": str(exc),
                                "lastTransitionTime": stamp,
                            },
                            {
                                "type": "Ready",
                                "status": "False",
                                "reason": "InvalidSpec",
                                "message": str(exc),
                                "lastTransitionTime": stamp,
                            },
                        ]
                    },
                )
        return mds, invalid

    async def _load_nodes(self) -> None:
        seen: set[str] = set()
        for body in await self.kube.list_gpu_nodes():
            try:
                spec = parse_gpu_node(body)
            except SpecError as exc:
                log.warning("event=gpunode_invalid error=%r", str(exc))
                continue
            seen.add(spec.name)
            rt = self.nodes.get(spec.name)
            if rt is None:
                rt = self.nodes[spec.name] = NodeRuntime(spec, raw_status=body.get("status"))
            rt.spec = spec
        for name in list(self.nodes):
            if name not in seen:
                self.nodes.pop(name)
        self.agents.forget_except(seen)
        self._sync_watchers()

    async def _describe_one(self, rt: NodeRuntime, now: float) -> None:
        client = self.agents.get(rt.spec.name, rt.spec.address)
        try:
            snap = await asyncio.wait_for(client.describe(), timeout=max(self.cfg.poll_s * 2, 2.0))
        except (AgentCallError, TimeoutError, OSError) as exc:
            rt.failures += 1
            rt.error = str(exc) or type(exc).__name__
            if rt.failures >= self.cfg.agent_lost_after and not rt.lost:
                rt.lost = True
                rt.snap = None
                log.warning("event=agent_lost node=%s error=%r", rt.spec.name, rt.error)
                await self._event(
                    node_ref(rt.spec.name),
                    "Warning",
                    "AgentLost",
                    f"agent at {rt.spec.address} did not answer {rt.failures} polls: {rt.error}",
                )
            return
        if rt.lost:
            await self._event(
                node_ref(rt.spec.name),
                "Normal",
                "AgentBack",
                f"agent at {rt.spec.address} answers again (agent id {snap.agent_id})",
            )
        rt.snap, rt.failures, rt.lost, rt.last_seen, rt.error = snap, 0, False, now, ""

    async def _describe_all(self, now: float) -> None:
        await asyncio.gather(*(self._describe_one(rt, now) for rt in self.nodes.values()))
        self.metrics.agents_up.set(
            sum(1 for rt in self.nodes.values() if rt.failures == 0 and rt.snap)
        )

    def _live_snaps(self) -> dict[str, NodeSnapshot]:
        """Snapshots the policy sees: reachable (or not yet declared lost), not cordoned."""
        return {
            name: rt.snap
            for name, rt in self.nodes.items()
            if rt.snap is not None and not rt.lost and not rt.spec.cordoned
        }

    def _runtime(self, md: ModelDeploymentSpec, now: float) -> ModelRuntime:
        rt = self.models.get(md.model)
        if rt is None or rt.md.uid != md.uid:
            # Measured from now, not from the window's start: the first window is partial and
            # its average covers only the time observed (see _measure).
            rt = self.models[md.model] = ModelRuntime(
                md, WindowLoadTracker(self.cfg.window_s, start_s=now)
            )
            self.metrics.model_seen(md.model)
        rt.md = md
        return rt

    async def _load_history_and_counters(self, specs: Mapping[str, ModelSpec]) -> None:
        for model, rt in self.models.items():
            if rt.history is None:
                data = await self.kube.read_history(rt.md.uid)
                try:
                    rt.history = (
                        LoadHistory.from_data(data, self.cfg.window_s)
                        if data
                        else LoadHistory(self.cfg.window_s)
                    )
                except HistoryError as exc:
                    log.warning("event=history_unreadable model=%s error=%r", model, str(exc))
                    rt.history = LoadHistory(self.cfg.window_s)
                if model in specs and rt.md.prewarm:
                    rt.forecast = self._forecast(rt)
            if not rt.counters_loaded:
                rt.counters_loaded = True
                rt.raw_status = self._raw_status.get(rt.md.uid) or {}
                pre = rt.raw_status.get("prewarm") or {}
                rt.hits, rt.misses = int(pre.get("hits", 0)), int(pre.get("misses", 0))

    async def _gateway_held(self) -> Mapping[str, int]:
        """Requests held at every gateway replica, per model (empty without gateways)."""
        if self.demand is None:
            return {}
        try:
            got: GatewayHeld = await self.demand.poll()
        except Exception as exc:  # discovery failed: count no held demand this poll
            log.warning("event=gateway_demand_failed error=%r", str(exc))
            self.gateway_replicas = None
            return {}
        if got.failed:
            log.info("event=gateway_unreachable gateways=%r", list(got.failed))
        self.gateway_replicas = got.replicas
        self.metrics.gateway_replicas.set(got.replicas)
        return got.held

    def _measure(
        self,
        snaps: Mapping[str, NodeSnapshot],
        specs: Mapping[str, ModelSpec],
        now: float,
        held: Mapping[str, int] | None = None,
    ) -> dict[str, float]:
        """Demand per model: requests in flight at its instances + held at the gateways."""
        loads = {m: 0.0 for m in specs}
        for snap in snaps.values():
            for inst in snap.instances:
                if inst.model in loads:
                    loads[inst.model] += inst.load
        for m in loads:
            rt = self.models[m]
            rt.inflight, rt.held = loads[m], float((held or {}).get(m, 0))
            loads[m] += rt.held
            self.metrics.gateway_held.labels(m).set(rt.held)
        for m, load in loads.items():
            rt = self.models[m]
            # Close at wall-clock aligned boundaries (the first window may have started late).
            w_s = self.cfg.window_s
            boundary = (math.floor(rt.tracker.window_start / w_s) + 1) * w_s
            while boundary <= now:
                w = rt.tracker.close(boundary)
                self._record_window(rt, w.start_s, w.avg, w.peak)
                boundary += w_s
            rt.tracker.update(now, load)
            self.metrics.inflight.labels(m).set(rt.inflight)
        return loads

    # ------------------------------------------------------------------ windows

    def _window_due(self, now: float) -> bool:
        idx = math.floor(now / self.cfg.window_s)
        if self.window_index is None:
            self.window_index = idx
            return True  # plan right away after a (re)start with the persisted history
        if idx > self.window_index:
            self.window_index = idx
            return True
        return False

    def _record_window(self, rt: ModelRuntime, start: float, avg: float, peak: float) -> None:
        assert rt.history is not None
        index = math.floor(start / self.cfg.window_s + 1e-9)
        rt.history.record(index, avg, peak)
        rt.last_window = (start, avg, peak)
        rt.history_dirty = True
        self.metrics.observed.labels(rt.md.model, "avg").set(avg)
        self.metrics.observed.labels(rt.md.model, "peak").set(peak)

    def _forecast(self, rt: ModelRuntime) -> LoadForecast:
        from warmserve.policy.predictor import forecast

        assert rt.history is not None
        until = math.floor(self.clock() / self.cfg.window_s)
        avg, peak = rt.history.series(until, self.windows_per_day)
        fc = forecast(avg, peak, self.windows_per_day, self.cfg.predictor)
        self.metrics.predicted.labels(rt.md.model, "avg").set(fc.avg)
        self.metrics.predicted.labels(rt.md.model, "peak").set(fc.peak)
        return fc

    async def _close_windows(self, now: float, specs: Mapping[str, ModelSpec]) -> None:
        """Closed windows were recorded by :meth:`_measure`; persist them and forecast anew."""
        self.metrics.windows.inc()
        await self._collect_histories()
        for model, rt in self.models.items():
            if rt.history_dirty and rt.history is not None:
                rt.history_dirty = False
                try:
                    await self.kube.write_history(rt.md.uid, rt.history.to_data(model), rt.md.key)
                except Exception as exc:  # history is best effort; the next window retries
                    log.warning("event=history_write_failed model=%s error=%r", model, str(exc))
                    rt.history_dirty = True
            if model in specs and rt.md.prewarm:
                rt.forecast = self._forecast(rt)
                log.info(
                    "event=forecast model=%s avg=%.3f peak=%.3f history=%d",
                    model,
                    rt.forecast.avg,
                    rt.forecast.peak,
                    len(rt.history or []),
                )
            else:
                rt.forecast = None

    async def _collect_histories(self) -> None:
        """Delete stored histories whose deployment is gone (its finalizer was bypassed)."""
        try:
            stored = await self.kube.list_history_uids()
            for uid in stored:
                if uid not in self._live_uids and uid not in self.deleting:
                    log.info("event=history_orphan_deleted uid=%s", uid)
                    await self.kube.delete_history(uid)
        except Exception as exc:  # best effort; the next window retries
            log.warning("event=history_gc_failed error=%r", str(exc))

    def _free_map(self, snaps: Mapping[str, NodeSnapshot]) -> dict[tuple[str, int], int]:
        return {
            (n, g.index): g.free_bytes
            for n, s in snaps.items()
            for g in s.gpus
            if g.state.value != "dedicated"
        }

    def _free_memory_grew(self, snaps: Mapping[str, NodeSnapshot]) -> bool:
        """True when some GPU gained free memory since the last plan (ended instance, lent KV)."""
        cur = self._free_map(snaps)
        grew = any(v > self.last_free.get(k, 0) + 2**20 for k, v in cur.items())
        if not grew:
            self.last_free = {k: min(v, self.last_free.get(k, v)) for k, v in cur.items()}
        return grew

    def _record_plan(self, plan: PrewarmPlan, specs: Mapping[str, ModelSpec]) -> None:
        for model, rt in self.models.items():
            rt.replicas = tuple(r for r in plan.replicas if r.model == model)
            un = [u for u in plan.unplaced if u.model == model]
            rt.unplaced = len(un)
            rt.unplaced_reason = un[0].reason if un else ""
            self.metrics.unplaced.labels(model).set(len(un))

    def _grace_clock(self, snaps: Mapping[str, NodeSnapshot], now: float) -> dict[str, float]:
        """When each grace instance's grace began: the agent's record, else when this operator
        first saw it in grace (an older agent)."""
        seen = set()
        for snap in snaps.values():
            seen |= self._note_grace(snap, now)
        for name in list(self.grace_started):
            if name not in seen:
                self.grace_started.pop(name)
        return dict(self.grace_started)

    # ------------------------------------------------------------------ act

    def _launch(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Prewarm | Activate) and a.owner in self.deleting:
                continue
            if isinstance(a, Prewarm):
                key = (a.node, a.model, a.gpus)
                if key in self.pending_prewarms:
                    continue
                spec = self.models[a.model].spec if a.model in self.models else None
                self.pending_prewarms[key] = PendingPrewarm(
                    a.node, a.model, a.gpus, spec.prewarm_bytes_per_gpu if spec else 0, a.owner
                )
            elif isinstance(a, Activate):
                key2 = (a.node, a.gpus)
                if key2 in self.pending_starts:
                    continue
                self.pending_starts[key2] = PendingStart(a.node, a.model, a.gpus, a.owner)
            elif isinstance(a, EndInstance):
                self._ended_by_us.add(a.instance_id)
            task = asyncio.get_running_loop().create_task(self._execute(a))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _execute(self, a: Action) -> None:
        rt = self.nodes.get(a.node)
        if rt is None:
            return
        client = self.agents.get(a.node, rt.spec.address)
        verb = type(a).__name__.lower()
        ref = self._md_ref(a.model)
        log.info(
            "event=action verb=%s node=%s model=%s request_id=%s detail=%r",
            verb,
            a.node,
            a.model,
            a.request_id,
            describe(a),
        )
        try:
            src = self.models[a.model].md.source if a.model in self.models else ""
            fetch_kw: dict[str, Any] = {"source": src} if src else {}
            if isinstance(a, Prewarm):
                await self._event(ref, "Normal", "Prewarm", describe(a))
                if src:
                    fetch_kw["on_fetch"] = self._fetch_reporter(ref, a.node)
                await client.prewarm(a.model, a.gpus, a.layers, a.request_id, a.owner, **fetch_kw)
            elif isinstance(a, Evict):
                await client.evict(a.slot_id, a.request_id)
                await self._event(ref, "Normal", "Evicted", describe(a))
            elif isinstance(a, Activate):
                fetching = bool(src) and (rt.snap is None or a.model not in rt.snap.models)
                if fetching:  # a cold start on a node whose store lacks the model
                    await self._event(
                        ref,
                        "Normal",
                        "Fetching",
                        f"node {a.node} is fetching {a.model} from {src} to start it",
                    )
                spec_of = self.models.get(a.model)
                res = await client.activate(
                    a.model,
                    a.gpus,
                    a.slot_id,
                    a.request_id,
                    a.owner,
                    engine=spec_of.md.engine if spec_of else "",
                    engine_args=spec_of.md.engine_args if spec_of else (),
                    **fetch_kw,
                )
                if fetching:
                    await self._event(
                        ref, "Normal", "Fetched", f"node {a.node} fetched {a.model} from {src}"
                    )
                start = "hit" if res.hit else "cold"
                self.metrics.starts.labels(a.model, start).inc()
                self.metrics.activation_seconds.labels(start).observe(res.activation_s)
                m = self.models.get(a.model)
                if m is not None:
                    if res.hit:
                        m.hits += 1
                    else:
                        m.misses += 1
                    self.metrics.hit_ratio.labels(a.model).set(m.hits / max(m.hits + m.misses, 1))
                what = "PrewarmHit" if res.hit else "ColdStart"
                await self._event(
                    ref,
                    "Normal",
                    what,
                    f"started {a.model} instance {res.instance.instance_id} on {a.node} GPUs "
                    f"{list(a.gpus)} in {res.activation_s:.2f}s "
                    f"({'prewarm hit' if res.hit else 'cold start'}); "
                    f"endpoint {res.instance.endpoint}",
                )
            elif isinstance(a, BeginGrace):
                await client.begin_grace(a.instance_id, a.request_id)
                await self._event(ref, "Normal", "Draining", describe(a))
            elif isinstance(a, EndInstance):
                await client.end_instance(a.instance_id, a.evict_weights, a.request_id)
                await self._event(ref, "Normal", "InstanceEnded", describe(a))
            self.metrics.actions.labels(verb, "ok").inc()
        except AgentCallError as exc:
            self.metrics.actions.labels(verb, exc.code).inc()
            log.warning(
                "event=action_failed verb=%s node=%s model=%s code=%s message=%r",
                verb,
                a.node,
                a.model,
                exc.code,
                exc.message,
            )
            await self._event(ref, "Warning", "AgentRefused", f"{describe(a)}: {exc}")
        except (TimeoutError, OSError) as exc:
            self.metrics.actions.labels(verb, "error").inc()
            log.warning("event=action_error verb=%s node=%s error=%r", verb, a.node, str(exc))
        finally:
            try:
                if rt.spec.name in self.nodes:
                    snap = await asyncio.wait_for(client.describe(), timeout=5.0)
                    rt.snap = snap
            except (AgentCallError, TimeoutError, OSError):
                pass
            if isinstance(a, Prewarm):
                self.pending_prewarms.pop((a.node, a.model, a.gpus), None)
            elif isinstance(a, Activate):
                self.pending_starts.pop((a.node, a.gpus), None)

    async def teardown(self, md: ModelDeploymentSpec, timeout_s: float = 30.0) -> list[str]:
        """Remove every instance and slot the deleted deployment owns; return what is left.

        Called from the kopf delete handler (the finalizer); the caller retries while the
        returned list is not empty, so the deployment disappears only once nothing is left.
        Only what the agents recorded with the deployment's UID is touched (a duplicate owns
        nothing).  Serving instances drain through a grace period first (the agent refuses to
        end a serving instance) and end once idle or after ``max_grace_s``: deleting finishes
        within the grace period plus a few retries (issue 16, H1).  An agent the loop declared
        lost is skipped: what it still holds has no live owner once the deployment is gone, and
        the loop's orphan removal ends it when the agent is back.
        """
        uid = md.uid
        self.deleting[uid] = math.inf
        # Let prewarms/starts of this deployment already in flight land first, so none finishes
        # after the teardown and leaves a slot behind.
        deadline = self.clock() + timeout_s
        while self.clock() < deadline and any(
            p.owner == uid for p in (*self.pending_prewarms.values(), *self.pending_starts.values())
        ):
            await asyncio.sleep(0.1)
        await self._load_nodes()
        left: list[str] = []
        max_grace = self.cfg.autoscaler.max_grace_s
        for rt in list(self.nodes.values()):
            if rt.lost:
                continue
            client = self.agents.get(rt.spec.name, rt.spec.address)
            try:
                still = await self._teardown_node(uid, rt, client, timeout_s, max_grace)
            except (AgentCallError, TimeoutError, OSError) as exc:
                left.append(f"{rt.spec.name}: agent unreachable ({exc})")
                continue
            left += still
        if not left:
            try:
                await self.kube.delete_history(uid)
            except Exception as exc:
                log.warning("event=history_delete_failed model=%s error=%r", md.model, str(exc))
            rt_model = self.models.get(md.model)
            if rt_model is not None and rt_model.md.uid == uid:
                self.models.pop(md.model, None)
            self.deleting[uid] = self.clock()
        return left

    async def _teardown_node(
        self, uid: str, rt: NodeRuntime, client: Any, timeout_s: float, max_grace: float
    ) -> list[str]:
        """A few rounds of teardown on one agent (BeginGrace, then End when idle, Evict)."""
        name = rt.spec.name
        still: list[str] = []
        for _round in range(3):
            snap = await asyncio.wait_for(client.describe(), timeout=timeout_s)
            rt.snap = snap
            now = self.clock()
            self._note_grace(snap, now)
            actions, still = teardown_actions(uid, {name: snap}, now, self.grace_started, max_grace)
            if not actions:
                break
            for a in actions:
                try:
                    if isinstance(a, BeginGrace):
                        await client.begin_grace(a.instance_id, a.request_id)
                    elif isinstance(a, EndInstance):
                        self._ended_by_us.add(a.instance_id)
                        await client.end_instance(a.instance_id, True, a.request_id)
                    elif isinstance(a, Evict):
                        await client.evict(a.slot_id, a.request_id)
                    log.info("event=teardown_action detail=%r", describe(a))
                except AgentCallError as exc:
                    if exc.code != "NOT_FOUND":
                        still.append(f"{describe(a)}: {exc}")
        return still

    def _note_grace(self, snap: NodeSnapshot, now: float) -> set[str]:
        """Record when each grace instance of ``snap`` began its grace; return their ids."""
        seen = set()
        for inst in snap.instances:
            if inst.phase.value == "grace":
                seen.add(inst.instance_id)
                first = self.grace_started.setdefault(inst.instance_id, now)
                if inst.grace_started_unix:
                    self.grace_started[inst.instance_id] = min(inst.grace_started_unix, first)
        return seen

    # ------------------------------------------------------------------ report

    def _fetch_reporter(self, ref: ObjRef | None, node: str) -> Callable[[Any], None]:
        """Events for a fetch seen on one Prewarm stream: when it starts and when it ends."""
        seen = [False]

        def report(f: Any) -> None:
            ev = fetch_event(f, node, first=not seen[0])
            seen[0] = True
            if ev is not None:
                task = asyncio.get_running_loop().create_task(self._event(ref, *ev))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        return report

    def _md_ref(self, model: str) -> ObjRef | None:
        rt = self.models.get(model)
        return md_ref(rt.md.namespace, rt.md.name, rt.md.uid) if rt else None

    async def _event(
        self, ref: ObjRef | None, type_: str, reason: str, message: str, dedupe_s: float = 0.0
    ) -> None:
        if ref is None:
            return
        key = (f"{ref.kind}/{ref.namespace}/{ref.name}", reason, message)
        now = self.clock()
        if dedupe_s and now - self._events_seen.get(key, -math.inf) < dedupe_s:
            return
        self._events_seen[key] = now
        await self.kube.emit_event(ref, type_, reason, message)

    def _track_instances(self, snaps: Mapping[str, NodeSnapshot], now: float) -> None:
        """Notice instances that vanished without the operator ending them (crash, agent lost)."""
        current = {i.instance_id: (n, i.model) for n, s in snaps.items() for i in s.instances}
        for iid, (node, model) in self._known_instances.items():
            if iid not in current and iid not in self._ended_by_us:
                ref = self._md_ref(model)
                self._launch_event(
                    ref,
                    "Warning",
                    "InstanceLost",
                    f"instance {iid} of {model} on {node} is gone (agent lost or instance crashed)",
                )
                self._replan = True
        self._ended_by_us &= set(current)
        self._known_instances = current

    def _launch_event(self, ref: ObjRef | None, type_: str, reason: str, message: str) -> None:
        task = asyncio.get_running_loop().create_task(self._event(ref, type_, reason, message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _conditions(
        self, rt: ModelRuntime, snaps: Mapping[str, NodeSnapshot], problem: Condition | None
    ) -> list[Condition]:
        active = sum(
            1
            for s in snaps.values()
            for i in s.instances
            if i.model == rt.md.model and i.phase.value == "serving"
        )
        desired = rt.desired if rt.desired is not None else rt.md.min_instances
        max_gpus = max((len(s.gpus) for s in snaps.values()), default=0)
        if problem is None and not snaps:
            problem = Condition("Degraded", True, "NoAgents", "no GPUNode agent is reachable")
        if problem is None and rt.md.tp > max_gpus:
            problem = Condition(
                "Degraded",
                True,
                "Unplaceable",
                f"spec.tensorParallel={rt.md.tp} exceeds the GPU count of every node "
                f"(largest: {max_gpus})",
            )
        if problem is None and rt.no_capacity:
            problem = Condition("Degraded", True, "NoCapacity", rt.no_capacity)
        degraded = problem or Condition("Degraded", False, "AsExpected", "")
        if problem is not None and problem.reason in (
            "Unplaceable",
            "ModelNotFound",
            "DuplicateModel",
            "NoAgents",
        ):
            ready = Condition("Ready", False, problem.reason, problem.message)
        elif active >= desired:
            ready = Condition(
                "Ready",
                True,
                "ScaledToZero" if desired == 0 and active == 0 else "Serving",
                f"{active} of {desired} desired instances serving",
            )
        else:
            ready = Condition(
                "Ready", False, "Starting", f"{active} of {desired} desired instances serving"
            )
        if not rt.md.prewarm:
            pre = Condition("Prewarmed", False, "Disabled", "spec.prewarm.enabled is false")
        elif rt.unplaced:
            pre = Condition(
                "Prewarmed",
                False,
                "Unplaced",
                f"{rt.unplaced} replica(s) not placed: {rt.unplaced_reason}",
            )
        elif rt.replicas:
            loading = self._loading(rt, snaps)
            pre = Condition(
                "Prewarmed",
                not loading,
                "Loading" if loading else "AllPlaced",
                f"{len(rt.replicas)} replica(s) planned",
            )
        else:
            pre = Condition(
                "Prewarmed",
                False,
                "NotRequested",
                "the forecast asks for no prewarm replica this window",
            )
        return [ready, pre, degraded]

    def _loading(self, rt: ModelRuntime, snaps: Mapping[str, NodeSnapshot]) -> bool:
        built = self.last_built
        for r in rt.replicas:
            sid = built.slot_of.get((r.node, r.model, r.gpus)) if built else None
            slot = snaps[r.node].slot(sid) if sid and r.node in snaps else None
            if slot is None or slot.state != "ready":
                return True
        return False

    async def _write_statuses(
        self,
        built: Built,
        owners: Mapping[str, ModelDeploymentSpec],
        dups: list[ModelDeploymentSpec],
        problems: Mapping[str, Condition],
        now: float,
    ) -> None:
        snaps = built.snaps
        stamp = now_iso(now)
        for model, rt in self.models.items():
            if rt.md.uid in self.deleting:
                continue
            md = rt.md
            spec = rt.spec
            fc = rt.forecast
            view = ModelView(
                generation=md.generation,
                window_s=self.cfg.window_s,
                window_start=(self.window_index or 0) * self.cfg.window_s,
                predicted_avg=fc.avg if fc else None,
                predicted_peak=fc.peak if fc else None,
                observed_avg=rt.last_window[1] if rt.last_window else None,
                observed_peak=rt.last_window[2] if rt.last_window else None,
                history_windows=len(rt.history or []),
                hits=rt.hits,
                misses=rt.misses,
                replicas=rt.replicas,
                unplaced=rt.unplaced,
                unplaced_reason=rt.unplaced_reason,
                weight_bytes=spec.weight_bytes if spec else None,
                num_layers=spec.num_layers if spec else None,
                cold_start_s=spec.cold_start_s if spec else None,
                inflight=rt.inflight,
                held=rt.held if self.demand is not None else None,
                gateway_replicas=self.gateway_replicas,
                ttft_objective_s=md.ttft_s,
            )
            view.conditions = self._conditions(rt, snaps, problems.get(md.key))
            status = model_status(model, view, snaps, built.slot_of, rt.raw_status, stamp)
            self.metrics.instances.labels(model).set(status["instanceCount"])
            self.metrics.replicas.labels(model).set(status["prewarmedCount"])
            await self._condition_events(rt, status)
            key = strip_volatile(status)
            if key != rt.last_status:
                await self.kube.patch_md_status(md.namespace, md.name, status)
                rt.last_status = key
                rt.raw_status = status
        for md in dups:
            cond = problems[md.key]
            await self.kube.patch_md_status(
                md.namespace,
                md.name,
                {
                    "observedGeneration": md.generation,
                    "conditions": [
                        {
                            "type": "Degraded",
                            "status": "True",
                            "reason": cond.reason,
                            "message": cond.message,
                            "lastTransitionTime": stamp,
                        },
                        {
                            "type": "Ready",
                            "status": "False",
                            "reason": cond.reason,
                            "message": cond.message,
                            "lastTransitionTime": stamp,
                        },
                    ],
                },
            )
        for name, nrt in self.nodes.items():
            reachable = nrt.failures == 0 and nrt.snap is not None
            msg = f"agent {nrt.spec.address}" + (f": {nrt.error}" if nrt.error else "")
            status = node_status(
                nrt.snap if not nrt.lost else None,
                reachable,
                msg,
                nrt.raw_status,
                stamp,
                nrt.last_seen,
            )
            key = strip_volatile(status)
            if key != nrt.last_status or now - nrt.last_write >= self.cfg.node_status_refresh_s:
                await self.kube.patch_node_status(name, status)
                nrt.last_status, nrt.last_write, nrt.raw_status = key, now, status

    async def _condition_events(self, rt: ModelRuntime, status: Mapping[str, Any]) -> None:
        """An Event whenever Degraded or Prewarmed changes reason (not every poll)."""
        old = {c.get("type"): c for c in (rt.raw_status or {}).get("conditions") or []}
        ref = md_ref(rt.md.namespace, rt.md.name, rt.md.uid)
        for c in status["conditions"]:
            before = old.get(c["type"])
            if (
                before
                and before.get("reason") == c["reason"]
                and before.get("status") == c["status"]
            ):
                continue
            if c["type"] == "Degraded" and c["status"] == "True":
                await self._event(ref, "Warning", c["reason"], c["message"])
            elif c["type"] == "TTFTObjectiveMet" and c["status"] == "False":
                await self._event(ref, "Warning", "TTFTObjectiveMissed", c["message"])
            elif c["type"] == "Prewarmed" and c["reason"] == "Unplaced":
                await self._event(ref, "Warning", "Unplaced", c["message"])
            elif c["type"] == "Prewarmed" and c["reason"] == "AllPlaced":
                await self._event(
                    ref, "Normal", "Prewarmed", "every requested prewarm replica is resident"
                )
