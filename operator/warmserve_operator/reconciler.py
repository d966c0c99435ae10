"""The operator's loop: observe → controller → act → report (WarmServe §5).

Every poll (default 5 s), or earlier when an agent reports a change, the leading replica:

1. **observes**: ModelDeployments and GPUNodes from kopf's indexes (:mod:`.handlers`; no
   re-listing), every agent's ``Describe`` (:mod:`.observe`), and turns them into the control
   layer's observation (ownership by UID, calls in flight added);
2. asks the **controller** (:class:`warmserve.control.Controller`, the same one the simulator
   runs): it measures each model's demand, closes windows and forecasts, ends grace periods,
   and decides starts, drains, grace ends, prewarms and evictions;
3. **acts**: the decisions, plus the removal of what no deployment owns (:mod:`.identity`),
   become actions (:mod:`.actions`: request id, owner, engine, engine arguments, model source)
   that the actor (:mod:`.act`) carries out as agent calls with the poll's one immutable context
   (:mod:`.context`: the owners' specs, the nodes' agent ports and snapshots, the leader fence);
4. **reports**: statuses, conditions and Events (:mod:`.report`), and persists the windows the
   controller closed (:mod:`.history`).

The operator decides nothing itself: every rule (eviction, grace, load, re-planning) is the
controller's (``docs/policy.md``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from warmserve.api.crd import ModelDeploymentSpec, dedupe_models
from warmserve.control.controller import Controller
from warmserve.control.decisions import Decisions
from warmserve.policy.cluster import ModelSpec

from . import tracing
from .act import Actor
from .actions import actions
from .agents import AgentPool
from .config import OperatorConfig
from .context import PollContext
from .deployments import DeploymentBook
from .gateway_demand import GatewayDemand, GatewayHeld
from .identity import orphans
from .leader import LoopFence, NotLeader
from .metrics import Metrics, Phases
from .observe import Observer, note_grace, observation
from .ports import KubePort, ObjRef, md_ref
from .report import Deployment, Reporter
from .snapshot import NodeSnapshot
from .status import Condition
from .watchers import AgentWatchers

log = logging.getLogger("warmserve.operator")

MIN_TICK_S = 0.25


class Reconciler:
    """One per operator process; :meth:`run` is the loop, :meth:`tick` one poll."""

    def __init__(
        self,
        config: OperatorConfig,
        kube: KubePort,
        agents: AgentPool,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        demand: GatewayDemand | None = None,
    ) -> None:
        from warmserve.policy.predictor import make_predictor

        make_predictor(config.predictor)  # fail fast on an unknown predictor name
        self.cfg = config
        self.kube = kube
        self.agents = agents
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.controller = Controller(config.control())
        self.reporter = Reporter(kube, self.metrics, clock)
        self.observer = Observer(
            kube,
            agents,
            self.reporter.event,
            poll_s=config.poll_s,
            agent_lost_after=config.agent_lost_after,
            on_nodes=self._sync_watchers,
        )
        self.book = DeploymentBook(
            kube, self.reporter, self.controller, self.metrics, config, clock
        )
        self.fence = LoopFence(kube.leading, config.leader_settle_polls)
        self._wake = asyncio.Event()
        # A landed call wakes the next poll (it describes every agent once).
        self.actor = Actor(self.metrics, self.reporter.event, self.book.count_start, self._wake.set)
        self._watching = False  # only inside run(): unit tests drive tick() directly
        self.watchers = AgentWatchers(agents, self._wake.set, config.poll_s)
        self.grace_started: dict[str, float] = {}
        # Requests held at the gateways (None: no gateway configured; gateway_demand.py). A test
        # without gateways may set ``held`` instead (model -> requests held).
        self.demand = demand
        self.held: Callable[[], Mapping[str, int]] = dict
        self.gateway_replicas: int | None = None
        self.last: Decisions | None = None
        self._known: dict[str, tuple[str, Any]] = {}

    # ------------------------------------------------------------------ plumbing

    @property
    def deployments(self) -> dict[str, Deployment]:
        return self.book.items

    @property
    def deleting(self) -> dict[str, float]:
        return self.book.deleting

    @property
    def live_uids(self) -> frozenset[str]:
        return self.book.live_uids

    @property
    def models(self) -> Mapping[str, Any]:
        """The controller's per-model state (demand tracker, history, forecast), by model."""
        return self.controller.models

    @property
    def nodes(self) -> dict[str, Any]:
        return self.observer.nodes

    @property
    def tasks(self) -> set[asyncio.Task[Any]]:
        return self.actor.tasks

    @property
    def leader(self) -> bool:
        return self.fence.leader

    def _ref(self, uid: str) -> ObjRef | None:
        d = self.deployments.get(uid)
        return md_ref(d.md.namespace, d.md.name, uid) if d else None

    def may_act(self) -> bool:
        """The fence before every leader-only side effect (:class:`.leader.LoopFence`)."""
        return self.fence.may_act()

    def _fence(self) -> None:
        if not self.may_act():
            raise NotLeader("leadership lost during the poll")

    def leadership_changed(self, leading: bool, reason: str) -> None:
        """The Lease task's report of a transition: the gauge at once, and the loop wakes (to
        start acting, or to stop its agent streams)."""
        self.metrics.leader.set(1 if leading else 0)
        if not leading:
            self.metrics.leadership_lost.labels(reason).inc()
            self.fence.lost()
        self._wake.set()

    def wake(self) -> None:
        """Run the next poll now (an agent event, or a gateway reporting held requests)."""
        self._wake.set()

    async def drain_tasks(self, timeout: float) -> None:
        await self.actor.drain(timeout)

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set; errors of one poll are logged, never fatal."""
        self._watching = True
        if self.demand is not None:
            self.demand.watch(self.wake)  # a held request at a gateway wakes the loop
        try:
            while not stop.is_set():
                started = self.clock()
                self._wake.clear()
                try:
                    await self.tick()
                except NotLeader:  # fenced mid-poll: event=leadership_lost says why
                    log.info("event=poll_fenced")
                    self._sync_watchers()
                except Exception:  # keep the loop alive; the next poll starts afresh
                    log.exception("event=tick_failed")
                await self._sleep(stop, started)
        finally:
            self.watchers.stop()
            if self.demand is not None:
                await self.demand.close()
            await self.drain_tasks(timeout=5.0)

    async def _sleep(self, stop: asyncio.Event, started: float) -> None:
        await asyncio.sleep(max(MIN_TICK_S - (self.clock() - started), 0))
        delay = max(self.cfg.poll_s - (self.clock() - started), 0.0)
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def _sync_watchers(self) -> None:
        """One Watch stream per agent while this replica leads (:mod:`.watchers`)."""
        if not self._watching:
            return
        nodes = self.observer.nodes
        self.watchers.sync(
            {name: rt.spec.address for name, rt in nodes.items()} if self.leader else {}
        )

    # ------------------------------------------------------------------ one poll

    async def tick(self) -> None:
        """One poll: observe, decide, act, report."""
        now = self.clock()
        self.fence.poll(await self.kube.is_leader())
        self.metrics.leader.set(1 if self.leader else 0)
        if not self.leader:
            self._sync_watchers()
            return
        if not await self.kube.ready():  # kopf's indexes are still filling: look again soon
            self._wake.set()
            return
        self.metrics.polls.inc()
        phases = Phases(self.metrics)
        mds, invalid = await self.book.sync()
        # The calls in flight now: one that lands while the agents are described is in neither
        # a snapshot taken before it landed nor, once forgotten, the pending sets, so it would be
        # decided again (a second start on a GPU the snapshot still shows free).
        pending_prewarms = dict(self.actor.pending_prewarms)
        pending_starts = dict(self.actor.pending_starts)
        await self.observer.load_nodes()
        try:
            await self.kube.sync_agent_nodes()
        except Exception as exc:  # discovery is best effort; registered GPUNodes still work
            log.warning("event=agent_discovery_failed error=%r", str(exc))
        self.metrics.agents_up.set(await self.observer.describe_all(now))
        phases.done("observe")
        ports = self.observer.live_ports()
        snaps = {name: port.snap for name, port in ports.items()}
        owners, dups = dedupe_models(mds)
        await self.book.sources.refresh(
            owners,
            {m: e for snap in snaps.values() for m, e in snap.models.items()},
            [port.client for port in ports.values()],
        )
        problems = await self.book.resolve(owners, dups, snaps, now)
        managed = {
            m: d for m, d in owners.items() if d.uid not in self.deleting and self._spec(d.uid)
        }
        await self.book.load_histories(managed, now)
        phases.done("resolve")
        owner_uid = {m: d.uid for m, d in managed.items()}
        obs = observation(
            now,
            snaps,
            owner_uid,
            self.live_uids,
            {**pending_prewarms, **self.actor.pending_prewarms}.values(),
            {**pending_starts, **self.actor.pending_starts}.values(),
            await self._gateway_held(),
            {m: e.spec.engine_overhead_bytes for m, e in self.controller.models.items()},
        )
        loads = self.controller.observe(obs)
        for m, load in loads.items():
            held = float(obs.held.get(m, 0))
            self.metrics.inflight.labels(m).set(load - held)
            self.metrics.gateway_held.labels(m).set(held)
        self.book.note_demand(managed, loads, obs.held, self.gateway_replicas, self.demand)
        t0 = time.perf_counter()
        out = self.controller.decide(obs)
        if out.plan is not None:
            self.metrics.plan_seconds.observe(time.perf_counter() - t0)
        phases.done("decide")
        self.book.record(out, managed)
        self.last = out
        self._note_grace(snaps, now)
        decisions = list(out.items)
        if not invalid:
            decisions += orphans(
                snaps,
                {m: d.uid for m, d in owners.items()},
                self.live_uids,
                now,
                self.grace_started,
                self.cfg.autoscaler.max_grace_s,
            )
        ctx = PollContext(managed, ports, self.fence, frozenset(self.deleting))
        self._fence()  # the poll may have outlasted the Lease: act only while still leading
        busy = self.actor.launch(actions(decisions, ctx), ctx)
        await self.book.persist()
        self._track_lost(snaps)
        phases.done("act")
        # A deployment whose prewarm/start was just launched is reported once the call lands
        # (the agent's event wakes the loop): one status write instead of two.
        writes, posted = self.reporter.writes, self.reporter.posted
        self._fence()
        await self._report(snaps, dups, problems, now, busy if self._watching else set())
        phases.done("report")
        phases.log(
            len(self.deployments),
            status_writes=self.reporter.writes - writes,
            events=self.reporter.posted - posted,
        )

    async def _gateway_held(self) -> Mapping[str, int]:
        """Requests held at every gateway replica, per model (``held`` without gateways)."""
        if self.demand is None:
            return self.held()
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
        tracing.note_held(got.traces)  # a start of a model links to its held requests
        return got.held

    def _spec(self, uid: str) -> ModelSpec | None:
        d = self.deployments.get(uid)
        return d.spec if d else None

    def _note_grace(self, snaps: Mapping[str, NodeSnapshot], now: float) -> None:
        seen = set()
        for snap in snaps.values():
            seen |= self.note_grace(snap, now)
        for iid in list(self.grace_started):
            if iid not in seen:
                del self.grace_started[iid]

    def note_grace(self, snap: NodeSnapshot, now: float) -> set[str]:
        return note_grace(self.grace_started, snap, now)

    def _track_lost(self, snaps: Mapping[str, NodeSnapshot]) -> None:
        """An Event for instances that vanished without the operator ending them."""
        current = {i.instance_id: (n, i) for n, s in snaps.items() for i in s.instances}
        for iid, (node, inst) in self._known.items():
            if iid not in current and iid not in self.actor.ended:
                self.actor.spawn(
                    self.actor.post(
                        self._ref(inst.owner),
                        "Warning",
                        "InstanceLost",
                        f"instance {iid} of {inst.model} on {node} is gone (agent lost or "
                        "instance crashed)",
                    )
                )
        self.actor.ended &= set(current)
        self._known = current

    async def _report(
        self,
        snaps: Mapping[str, NodeSnapshot],
        dups: list[ModelDeploymentSpec],
        problems: Mapping[str, Condition],
        now: float,
        later: set[str],
    ) -> None:
        todo = [
            d
            for uid, d in self.deployments.items()
            if uid not in self.deleting and not d.md.deleting and uid not in later
        ]
        # GPUNodes first: the gateways route only to instances a GPUNode's status lists, so a
        # deployment's status saying "serving" is usable the moment the gateways see it.
        for name, nrt in self.observer.nodes.items():
            await self.reporter.node(name, nrt, now, self.cfg.node_status_refresh_s)
        await self.reporter.everything(
            todo, {dup.uid for dup in dups}, problems, snaps, self.controller, self.cfg.window_s
        )
        self.reporter.flush_soon()  # lifecycle Events after the statuses, within the budget

    async def teardown(self, md: ModelDeploymentSpec, timeout_s: float = 30.0) -> list[str]:
        from .teardown import teardown

        return await teardown(self, md, timeout_s)
