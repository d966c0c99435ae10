"""The operator's window loop against in-memory agents and API (no Kubernetes, no gRPC)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

import pytest
from warmserve_operator.agents import AgentPool
from warmserve_operator.leader import NotLeader
from warmserve_operator.observe import observation
from warmserve_operator.reconciler import OperatorConfig, Reconciler
from warmserve_operator.testing import FakeAgent

import warmserve.api.history as history_io
from tests.operator.operator_fakes import Clock, FakeKube
from warmserve.control.history import LoadHistory
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import GiB
from warmserve.policy.evict_aware_placement import plan_prewarm

W = 2.0
CATALOG = {"llama-a": (10 * GiB, 32), "llama-b": (20 * GiB, 40), "huge": (8 * GiB, 8)}


def seed_history(
    kube: FakeKube, name: str, model: str, now: float, avg: float, peak: float, windows: int = 20
) -> None:
    h = LoadHistory(W)
    end = math.floor(now / W)
    for i in range(end - windows, end):
        h.record(i, avg, peak)
    kube.configmaps[f"uid-{name}"] = history_io.to_data(h, model)  # FakeKube.add_md's default UID


def md_of(h: Harness, model: str):
    return next(d.md for d in h.rec.deployments.values() if d.md.model == model)


class Harness:
    def __init__(self, nodes: int = 2, gpus: int = 4, spare_replicas: int = 0) -> None:
        self.clock = Clock()
        self.kube = FakeKube()
        self.agents = {
            f"node-{i}": FakeAgent(f"node-{i}", gpus, catalog=CATALOG, clock=self.clock)
            for i in range(nodes)
        }
        for name in self.agents:
            self.kube.add_node(name)
        self.cfg = OperatorConfig(
            window_s=W,
            leader_settle_polls=1,
            poll_s=0.5,
            spare_replicas=spare_replicas,
            autoscaler=AutoscalerConfig(scale_down_delay_s=1.0, max_grace_s=3.0),
        )
        self.rec = self.new_reconciler()

    def new_reconciler(self) -> Reconciler:
        pool = AgentPool(factory=lambda node, addr: self.agents[node])
        return Reconciler(self.cfg, self.kube, pool, clock=self.clock)

    async def tick(self, n: int = 1, dt: float = 0.5) -> None:
        for _ in range(n):
            await self.rec.tick()
            await self.rec.drain_tasks(timeout=5)
            self.clock.t += dt

    def slots(self, model: str) -> list[tuple[str, tuple[int, ...]]]:
        return sorted(
            (a.node, s.gpus)
            for a in self.agents.values()
            for s in a.slots.values()
            if s.model == model and not s.active
        )

    def instances(self, model: str) -> list[tuple[str, tuple[int, ...]]]:
        return sorted(
            (a.node, i.gpus)
            for a in self.agents.values()
            for i in a.instances.values()
            if i.model == model
        )

    def status(self, name: str) -> dict:
        return self.kube.mds[("default", name)].get("status", {})

    def cond(self, name: str, type_: str) -> dict:
        return next(c for c in self.status(name)["conditions"] if c["type"] == type_)


async def test_prewarm_follows_policy_plan_and_status_reports_it() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4)
    h.kube.add_md("b", "llama-b", maxBatchSize=4, tensorParallel=2)
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=6.0, peak=10.0)
    seed_history(h.kube, "b", "llama-b", h.clock.t, avg=3.0, peak=3.0)
    await h.tick()
    # What the policy core plans for the same snapshot and forecasts:
    snaps = {n: await a.describe() for n, a in h.agents.items()}
    ctl = h.rec.controller
    assert ctl.forecast_of("llama-a").avg == pytest.approx(6.0, rel=1e-2)
    owners = {d.md.model: uid for uid, d in h.rec.deployments.items()}
    obs = observation(h.clock.t, snaps, owners, set(owners.values()))
    replanned = plan_prewarm(ctl.snapshot(obs))
    assert not replanned.place and not replanned.evict, "the operator placed exactly the plan"
    assert len(h.slots("llama-a")) == 3  # ceil(6/4)=2 basic + ceil(10/4)-2 = 1 burst
    assert len(h.slots("llama-b")) == 1
    assert all(len(g) == 2 for _, g in h.slots("llama-b"))
    await h.tick()
    st = h.status("a")
    assert st["prewarmedCount"] == 3
    assert [r["kind"] for r in st["prewarmedReplicas"]] == ["basic", "basic", "burst"]
    assert st["load"]["predictedAverage"] == pytest.approx(6.0, rel=1e-2)
    assert h.cond("a", "Prewarmed")["status"] == "True"
    assert h.cond("a", "Ready")["reason"] == "ScaledToZero"
    assert "Prewarmed" in h.kube.reasons("ModelDeployment/a")  # one Event, not one per replica
    node_st = h.kube.nodes["node-0"]["status"]
    assert node_st["gpuCount"] == 4 and node_st["conditions"][0]["status"] == "True"


async def test_spare_replicas_reach_the_operator_plan() -> None:
    """``--spare-replicas 1`` (docs/policy.md "Spare replicas"): the operator prewarms what the
    policy core plans with the spare — one more burst replica per model, score 0."""
    h = Harness(spare_replicas=1)
    h.kube.add_md("a", "llama-a", maxBatchSize=4)
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=6.0, peak=10.0)
    await h.tick()
    ctl = h.rec.controller
    assert ctl.cfg.spare_replicas == 1
    snaps = {n: await a.describe() for n, a in h.agents.items()}
    owners = {d.md.model: uid for uid, d in h.rec.deployments.items()}
    obs = observation(h.clock.t, snaps, owners, set(owners.values()))
    replanned = plan_prewarm(ctl.snapshot(obs), spare_replicas=1)
    assert not replanned.place and not replanned.evict, "the operator placed exactly the plan"
    assert len(h.slots("llama-a")) == 4  # 2 basic + 1 burst (Eq. 5-6) + the spare
    await h.tick()
    reps = h.status("a")["prewarmedReplicas"]
    assert [r["kind"] for r in reps] == ["basic", "basic", "burst", "burst"]


def test_config_rejects_negative_spare_replicas() -> None:
    from warmserve.policy.cluster import PolicyInputError

    with pytest.raises(PolicyInputError, match="spare replicas"):
        OperatorConfig(spare_replicas=-1)
    assert OperatorConfig(spare_replicas=2).control().spare_replicas == 2


async def test_load_rise_starts_on_prewarmed_group_and_restart_does_not_duplicate() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1, maxInstances=4)
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=6.0, peak=10.0)
    await h.tick(2)
    assert len(h.instances("llama-a")) == 1
    first = next(i for a in h.agents.values() for i in a.instances.values())
    assert not first.hit, "nothing was prewarmed before the first poll: a cold start"
    assert len(h.slots("llama-a")) == 2, "then the forecast's replicas were prewarmed around it"
    # Raise the load reported by the agent above one instance's batch: a second, warm start.
    h.agents[h.instances("llama-a")[0][0]].set_load("llama-a", 7)
    await h.tick(2)
    assert len(h.instances("llama-a")) == 2
    st = h.status("a")
    assert st["prewarm"]["hits"] == 1 and st["prewarm"]["misses"] == 1
    assert st["prewarm"]["hitRatio"] == 0.5
    assert h.kube.reasons("ModelDeployment/a").count("PrewarmHit") == 1
    # The prewarm named the deployment's engine and arguments, so the hit's engine was prepared;
    # the Events list the stages.
    msgs = {r: m for (ref, _t, r, m) in h.kube.events if ref == "ModelDeployment/a"}
    assert "; stages: process " in msgs["PrewarmHit"], msgs["PrewarmHit"]
    assert msgs["PrewarmHit"].endswith("(engine prepared at prewarm)"), msgs["PrewarmHit"]
    assert msgs["ColdStart"].endswith("(engine built at activation)"), msgs["ColdStart"]
    second = [i for a in h.agents.values() for i in a.instances.values() if i is not first]
    assert second[0].hit
    # Operator restart: a fresh reconciler rebuilds from agents + API and starts nothing new.
    activates = sum(1 for a in h.agents.values() for c in a.calls if c[0] == "activate")
    h.rec = h.new_reconciler()
    await h.tick(3)
    assert len(h.instances("llama-a")) == 2
    assert sum(1 for a in h.agents.values() for c in a.calls if c[0] == "activate") == activates
    assert h.status("a")["prewarm"]["hits"] == 1, "hit counters survive the restart via status"


async def test_delete_tears_down_everything_of_the_model() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1)
    h.kube.add_md("b", "llama-b", maxBatchSize=4, tensorParallel=2)
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=6.0, peak=10.0)
    seed_history(h.kube, "b", "llama-b", h.clock.t, avg=3.0, peak=3.0)
    await h.tick(3)
    assert h.slots("llama-a") and h.instances("llama-a")
    md = md_of(h, "llama-a")
    left = await h.rec.teardown(md)
    assert left == []
    assert not h.slots("llama-a") and not h.instances("llama-a")
    assert "uid-a" not in h.kube.configmaps
    assert h.slots("llama-b"), "other models are untouched"
    del h.kube.mds[("default", "a")]
    await h.tick(3)
    assert not h.slots("llama-a") and not h.instances("llama-a")


async def test_delete_drains_a_busy_instance_through_grace_within_the_bound() -> None:
    """Removal drains: the agent refuses to end a serving instance; teardown drains it."""
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1)
    await h.tick(3)
    ((node, _),) = h.instances("llama-a")
    h.agents[node].set_load("llama-a", 2)  # requests in flight: grace cannot end early
    md = md_of(h, "llama-a")
    h.kube.mds[("default", "a")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    t0 = h.clock.t
    rounds = 0
    while left := await h.rec.teardown(md):
        rounds += 1
        assert h.clock.t - t0 <= h.cfg.autoscaler.max_grace_s + 30, left
        assert any("grace" in x for x in left), left
        await h.tick()  # kopf retries the finalizer every 2 s; the loop runs meanwhile
    assert rounds >= 2, "it waited for the grace period"
    assert h.clock.t - t0 >= h.cfg.autoscaler.max_grace_s
    assert not h.slots("llama-a") and not h.instances("llama-a")


async def test_deleting_a_duplicate_in_another_namespace_touches_nothing_of_the_owner() -> None:
    """Ownership: identity is the deployment's UID, not its model name."""
    h = Harness()
    h.kube.add_md("code", "llama-a", ns="demo", maxBatchSize=4, minInstances=1)
    seed_history(h.kube, "code", "llama-a", h.clock.t, avg=6.0, peak=10.0)
    h.kube.add_md("b16", "llama-a", ns="bad", created="2026-02-01T00:00:00Z")
    await h.tick(3)
    before = (h.slots("llama-a"), h.instances("llama-a"))
    assert before[0] and before[1]
    assert md_of(h, "llama-a").key == "demo/code"
    from warmserve.api.crd import parse_model_deployment

    b16 = parse_model_deployment(h.kube.mds[("bad", "b16")])
    calls = sum(len(a.calls) for a in h.agents.values())
    assert await h.rec.teardown(b16) == []
    assert sum(len(a.calls) for a in h.agents.values()) == calls, "no agent call at all"
    del h.kube.mds[("bad", "b16")]
    await h.tick(3, dt=0.0)  # same window: the forecast (and so the plan) stays
    assert (h.slots("llama-a"), h.instances("llama-a")) == before


async def test_orphans_of_deleted_deployments_are_removed() -> None:
    h = Harness()
    await h.agents["node-0"].prewarm("llama-a", (0,), 0, "manual-1")
    await h.tick()
    assert not h.slots("llama-a")


async def test_unplaceable_tp_is_reported_in_condition_and_event() -> None:
    h = Harness(gpus=4)
    h.kube.add_md("big", "huge", tensorParallel=8, minInstances=1)
    await h.tick(2)
    cond = h.cond("big", "Degraded")
    assert cond["status"] == "True" and cond["reason"] == "Unplaceable"
    assert "tensorParallel=8" in cond["message"]
    assert h.cond("big", "Ready")["status"] == "False"
    assert h.kube.reasons("ModelDeployment/big").count("Unplaceable") == 1, (
        "one Event, not one per poll"
    )


async def test_agent_lost_is_reported_and_its_instance_replaced() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1)
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=2.0, peak=2.0)
    await h.tick(2)
    ((node, _),) = h.instances("llama-a")
    h.agents[node].down = True
    await h.tick(4)
    assert "AgentLost" in h.kube.reasons(f"GPUNode/{node}")
    assert h.kube.nodes[node]["status"]["conditions"][0]["status"] == "False"
    live = [(n, g) for n, g in h.instances("llama-a") if n != node]
    assert len(live) == 1, "a replacement instance runs on the other node"


async def test_duplicate_model_and_missing_weights_are_degraded() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", created="2026-01-01T00:00:00Z")
    h.kube.add_md("a2", "llama-a", created="2026-01-02T00:00:00Z")
    h.kube.add_md("ghost", "not-in-cache")
    await h.tick()
    assert h.cond("a2", "Degraded")["reason"] == "DuplicateModel"
    assert h.cond("ghost", "Degraded")["reason"] == "ModelNotFound"
    assert h.cond("a", "Degraded")["status"] == "False"


async def test_before_any_agent_answers_a_model_is_not_declared_missing() -> None:
    """The first poll of a fresh operator knows no weight cache yet: it says NoAgents (the
    gateway holds requests through it), never the permanent ModelNotFound (the gateway answers
    that with 503 at once: `warmserve up` saw its first requests dropped)."""
    h = Harness()
    h.kube.add_md("a", "llama-a")
    h.kube.add_md("ghost", "not-in-cache")
    for a in h.agents.values():
        a.down = True
    await h.tick()
    for name in ("a", "ghost"):
        assert h.cond(name, "Degraded")["reason"] == "NoAgents"
        assert h.cond(name, "Ready")["reason"] == "NoAgents"
    for a in h.agents.values():
        a.down = False
    await h.tick()
    assert h.cond("a", "Degraded")["status"] == "False"
    assert h.cond("ghost", "Degraded")["reason"] == "ModelNotFound"


async def test_not_leader_does_nothing() -> None:
    h = Harness()
    h.kube.leader = False
    h.kube.add_md("a", "llama-a", minInstances=1)
    await h.tick(3)
    assert not h.instances("llama-a") and h.kube.status_writes == 0


async def test_leadership_lost_during_a_poll_stops_it_before_acting() -> None:
    """The fence is checked after the poll's observation, not only at its start: a leader whose
    Lease lapsed while it described the agents makes no agent call and writes no status."""
    h = Harness()
    h.kube.add_md("a", "llama-a", minInstances=1)
    describe = h.agents["node-0"].describe

    async def slow_describe() -> Any:
        h.kube.leader = False  # the Lease task reports the loss meanwhile
        return await describe()

    h.agents["node-0"].describe = slow_describe  # type: ignore[method-assign]
    writes = h.kube.status_writes
    with pytest.raises(NotLeader):
        await h.rec.tick()
    await h.rec.drain_tasks(timeout=5)
    assert not h.instances("llama-a") and h.kube.status_writes == writes
    assert not h.rec.may_act()
    h.agents["node-0"].describe = describe  # type: ignore[method-assign]
    h.kube.leader = True
    await h.tick(2)
    assert h.instances("llama-a"), "acts again once it leads"


async def test_a_call_decided_before_the_loss_is_not_sent() -> None:
    """A decision launched while leading but run after the fence closed is dropped (the Actor
    checks the fence right before each call, not only the poll)."""
    h = Harness()
    h.kube.add_md("a", "llama-a", minInstances=1)
    closed = [False]

    class Fence:  # the poll's fence, as the actor sees it
        def may_act(self) -> bool:
            return not closed[0]

    launch = h.rec.actor.launch

    def launch_then_lose(actions: Any, ctx: Any) -> set[str]:
        busy = launch(actions, replace(ctx, fence=Fence()))  # the tasks exist; none has run yet
        closed[0] = True
        return busy

    h.rec.actor.launch = launch_then_lose  # type: ignore[method-assign]
    await h.tick()
    assert not h.instances("llama-a")
    assert not h.rec.actor.pending_starts, "a dropped call is no longer pending"
    closed[0] = False
    h.rec.actor.launch = launch  # type: ignore[method-assign]
    await h.tick(2)
    assert h.instances("llama-a")


async def test_a_new_leader_waits_for_settle_polls() -> None:
    from dataclasses import replace

    h = Harness()
    h.cfg = replace(h.cfg, leader_settle_polls=3)
    h.rec = h.new_reconciler()
    h.kube.add_md("a", "llama-a", minInstances=1)
    await h.tick(2)
    assert not h.instances("llama-a")
    await h.tick(1)
    assert h.instances("llama-a")
    h.kube.leader = False
    await h.tick(1)
    assert not h.rec.leader


async def test_history_is_persisted_each_window() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1)
    await h.tick(2)
    ((node, _),) = h.instances("llama-a")
    h.agents[node].set_load("llama-a", 3)
    await h.tick(10)  # 5 s = 2+ windows
    data = h.kube.configmaps["uid-a"]
    hist = history_io.from_data(data, W)
    assert len(hist) >= 2
    assert max(hist.peak) == pytest.approx(3.0)
    assert h.status("a")["load"]["observedPeak"] == pytest.approx(3.0)
    # A restarted operator continues the same history from the ConfigMap.
    h.rec = h.new_reconciler()
    await h.tick(1)
    again = h.rec.controller.history("llama-a")
    assert again is not None and again.end == hist.end and list(again.peak) == list(hist.peak)


def test_config_rejects_bad_window() -> None:
    from warmserve.policy.cluster import PolicyInputError

    with pytest.raises(PolicyInputError, match="divide a day"):
        OperatorConfig(window_s=7.0)
    with pytest.raises(PolicyInputError, match="poll interval"):
        OperatorConfig(window_s=2.0, poll_s=5.0)


async def test_scale_down_drains_through_grace_and_keeps_weights() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=0, maxInstances=4)
    await h.tick()
    h.kube.mds[("default", "a")]["spec"]["minInstances"] = 2
    await h.tick(2)
    assert len(h.instances("llama-a")) == 2
    h.kube.mds[("default", "a")]["spec"]["minInstances"] = 0
    await h.tick(4)  # load 0 for longer than scale_down_delay_s=1: drain, grace ends at once
    assert not h.instances("llama-a")
    reasons = h.kube.reasons("ModelDeployment/a")
    assert reasons.count("Draining") == 2 and reasons.count("InstanceEnded") == 2
    ends = [c for a in h.agents.values() for c in a.calls if c[0] == "end"]
    assert len(ends) == 2
    assert h.cond("a", "Ready")["reason"] == "ScaledToZero"


@pytest.mark.parametrize("prewarm", [True, False])
async def test_an_ended_instance_keeps_its_weights_only_with_prewarming_on(prewarm: bool) -> None:
    """With prewarming on, an ended instance's weights stay resident and the next start there
    is a prewarm hit; with spec.prewarm.enabled false they go with it and every start is cold
    (the simulator's reactive baseline), so status never counts hits of a model without
    prewarming."""
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, maxInstances=4, prewarm={"enabled": prewarm})
    spec = h.kube.mds[("default", "a")]["spec"]
    for _round in range(2):
        spec["minInstances"] = 1
        await h.tick(2)
        assert len(h.instances("llama-a")) == 1
        spec["minInstances"] = 0
        await h.tick(4)
        assert not h.instances("llama-a")
        assert bool(h.slots("llama-a")) is prewarm
    pre = h.status("a")["prewarm"]
    assert (pre["hits"], pre["misses"]) == ((1, 1) if prewarm else (0, 2))


async def test_metrics_follow_the_decisions() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1, maxInstances=4)
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=6.0, peak=10.0)
    await h.tick(2)
    h.agents[h.instances("llama-a")[0][0]].set_load("llama-a", 7)
    await h.tick(2)
    reg = h.rec.metrics.registry
    value = reg.get_sample_value
    assert (
        value("warmserve_operator_instance_starts_total", {"model": "llama-a", "start": "hit"}) == 1
    )
    assert (
        value("warmserve_operator_instance_starts_total", {"model": "llama-a", "start": "cold"})
        == 1
    )
    assert value(
        "warmserve_operator_predicted_load", {"model": "llama-a", "stat": "peak"}
    ) == pytest.approx(10, rel=1e-2)
    assert value("warmserve_operator_inflight", {"model": "llama-a"}) == 7
    assert value("warmserve_operator_leader") == 1
    assert value("warmserve_operator_actions_total", {"verb": "prewarm", "outcome": "ok"}) >= 2


async def test_agent_events_wake_the_loop_before_the_next_poll() -> None:
    import asyncio
    from dataclasses import replace

    class WatchingAgent(FakeAgent):
        async def watch(self):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.3)
            yield "KIND_INSTANCE_REMOVED"
            await asyncio.sleep(30)

    h = Harness()
    h.agents = {"node-0": WatchingAgent("node-0", 4, catalog=CATALOG)}
    h.kube.nodes.clear()
    h.kube.add_node("node-0")
    h.cfg = replace(h.cfg, window_s=60.0, poll_s=30.0)
    h.rec = h.new_reconciler()
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(h.rec.run(stop))
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(task, 10)
    polls = h.rec.metrics.registry.get_sample_value("warmserve_operator_polls_total")
    assert polls == 2, "one poll at start, one woken by the agent's event (poll interval 30 s)"
    assert not h.rec.watchers.tasks, "watch streams are stopped with the loop"


async def test_windows_are_wall_clock_aligned_and_a_late_start_is_not_diluted() -> None:
    h = Harness()
    h.clock.t = 1_000_001.0  # in the middle of window [1_000_000, 1_000_002)
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1)
    await h.tick(1)  # starts the instance at t=1_000_001.0
    ((node, _),) = h.instances("llama-a")
    h.agents[node].set_load("llama-a", 4)
    await h.tick(8)  # to t=1_000_005.5
    hist = h.rec.controller.history("llama-a")
    assert hist.end == 1_000_004 // 2  # windows 500000 and 500001 closed (index = t // W)
    # First window observed for 1 s only: 0 at t=1_000_001.0, 4 from t=1_000_001.5 -> avg 2
    # (an aligned tracker would have diluted it to 1 with the unobserved half).
    assert list(hist.avg[-2:]) == [2.0, 4.0] and list(hist.peak[-2:]) == [4.0, 4.0]


async def test_invalid_spec_is_reported_once_and_blocks_orphan_cleanup() -> None:
    h = Harness()
    await h.agents["node-0"].prewarm("llama-a", (0,), 0, "manual-1")
    h.kube.add_md("bad", "llama-a", tensorParallel=0)  # stored before a schema change, say
    await h.tick(3)
    cond = h.cond("bad", "Degraded")
    assert cond["reason"] == "InvalidSpec" and "spec.tensorParallel" in cond["message"]
    assert h.kube.status_writes == 1
    assert h.slots("llama-a"), "slots are not treated as orphans while a spec cannot be read"


async def test_rough_edges_of_issue_16_statuses_and_events() -> None:
    """A model in no weight store is Degraded (not refused every poll); a duplicate's status is
    written once, not every poll; a scaled-to-zero deployment is not Ready."""
    h = Harness()
    h.kube.add_md("zero", "llama-a")  # minInstances 0: scaled to zero
    h.kube.add_md("dup", "llama-a", created="2026-01-02T00:00:00Z")
    h.kube.add_md("nostore", "llama-zz")
    h.kube.mds[("default", "nostore")]["spec"]["model"].update(
        {"weightBytes": 4 * GiB, "numLayers": 8}
    )
    await h.tick(6)
    cond = h.cond("nostore", "Degraded")
    assert cond["status"] == "True" and cond["reason"] == "ModelNotInStore", cond
    assert not any(m == "llama-zz" for a in h.agents.values() for m in a.catalog)
    assert not any("llama-zz" in rid for a in h.agents.values() for _v, rid in a.calls)
    assert h.kube.reasons("ModelDeployment/nostore").count("ModelNotInStore") == 1
    assert "AgentRefused" not in h.kube.reasons()
    assert h.kube.writes_of[("default", "dup")] == 1, "a duplicate's status is written once"
    ready = h.cond("zero", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ScaledToZero"


async def test_a_deployment_asking_for_every_gpu_does_not_starve_the_others() -> None:
    """Fair shares: minInstances 1000 does not take every free GPU."""
    h = Harness()  # 2 nodes x 4 GPUs
    h.kube.add_md("hog", "llama-a", minInstances=1000, maxInstances=1000)
    await h.tick(2)
    h.kube.add_md("b", "llama-b", tensorParallel=2, minInstances=1)
    for _ in range(12):  # the hog drains to its share after the scale-down delay (1 s here)
        await h.tick()
    assert len(h.instances("llama-b")) == 1, "b got its instance"
    assert len(h.instances("llama-a")) == 6, "the hog keeps the rest (6 of 8 GPUs)"


def test_config_passes_overshoot_spares() -> None:
    from warmserve.policy.cluster import PolicyInputError

    with pytest.raises(PolicyInputError, match="overshoot spares"):
        OperatorConfig(overshoot_spares=-1)
    assert OperatorConfig(overshoot_spares=1).control().overshoot_spares == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--overshoot-spares", "-1"], "overshoot spares must be >= 0, got -1"),
        (["--overshoot-headroom", "1.5"], "overshoot_headroom must be in [0, 1], got 1.5"),
        (["--overshoot-headroom", "nan"], "overshoot_headroom must be in [0, 1], got nan"),
    ],
)
def test_operator_cli_refuses_bad_overshoot_flags(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from warmserve.cli import main

    assert main(["operator", *flags]) == 2
    assert message in capsys.readouterr().err


async def test_vllm_tp_the_heads_do_not_divide_is_refused_before_any_prewarm() -> None:
    """engine vllm with tensorParallel=2 on a model of 9 heads / 3 KV heads (SmolLM2's): the
    deployment is Unplaceable from the heads the agents report, and nothing is prewarmed or
    started; the same deployment at tensorParallel=1, or on the simulated engine, is served."""
    h = Harness(gpus=4)
    for a in h.agents.values():
        a.heads["huge"] = (9, 3)
    h.kube.add_md("odd", "huge", tensorParallel=2, minInstances=1, engine={"name": "vllm"})
    await h.tick(3)
    cond = h.cond("odd", "Degraded")
    assert cond["status"] == "True" and cond["reason"] == "Unplaceable", cond
    assert "does not divide the model's 9 attention heads" in cond["message"]
    assert h.cond("odd", "Ready")["status"] == "False"
    assert h.slots("huge") == [] and h.instances("huge") == []
    assert not any(c[0] in ("prewarm", "activate") for a in h.agents.values() for c in a.calls)

    h.kube.add_md("odd", "huge", tensorParallel=1, minInstances=1, engine={"name": "vllm"})
    await h.tick(3)
    assert h.cond("odd", "Degraded")["status"] == "False"
    assert h.instances("huge"), "tensorParallel=1 splits nothing"


def test_tp_refusal_only_for_vllm_and_known_heads() -> None:
    from warmserve_operator.model_spec import CatalogEntry, tp_refusal

    from warmserve.api.crd import parse_model_deployment

    def md(tp: int, engine: str) -> Any:
        spec: dict[str, Any] = {"model": {"name": "m"}, "tensorParallel": tp}
        if engine:
            spec["engine"] = {"name": engine}
        return parse_model_deployment({"metadata": {"name": "x"}, "spec": spec})

    known = CatalogEntry("m", 1, 1, heads=32, kv_heads=8)
    assert tp_refusal(md(4, "vllm"), known) is None
    assert tp_refusal(md(16, "vllm"), known) is None  # 8 KV heads, each on 2 ranks
    why = tp_refusal(md(3, "vllm"), known) or ""
    assert "does not divide the model's 32 attention heads" in why
    odd_kv = CatalogEntry("m", 1, 1, heads=12, kv_heads=4)
    assert "neither a divisor nor a multiple" in (tp_refusal(md(6, "vllm"), odd_kv) or "")
    assert tp_refusal(md(3, "simulated"), known) is None  # bytes split: any size
    assert tp_refusal(md(3, ""), known) is None  # the agent's default: refused at Prewarm
    assert tp_refusal(md(3, "vllm"), CatalogEntry("m", 1, 1)) is None  # heads not known
    assert tp_refusal(md(3, "vllm"), None) is None


class _ActivateLandsDuringDescribe(FakeAgent):
    """An agent whose in-flight Activate completes while a Describe is answering, after the
    snapshot was taken: the operator's next observation sees neither the instance (the
    snapshot is older) nor, unless it kept it, the start it had pending."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = asyncio.Event()
        self.land_in_describe = False
        self.sent = 0  # Activate calls received (held at the gate until it opens)

    async def activate(self, *a: Any, **kw: Any) -> Any:
        self.sent += 1
        await self.gate.wait()
        return await super().activate(*a, **kw)

    async def describe(self) -> Any:
        snap = await super().describe()
        if self.land_in_describe:
            self.gate.set()
            for _ in range(50):  # the Activate call, its status write and _forget run now
                await asyncio.sleep(0)
        return snap


async def test_a_start_landing_during_a_describe_is_not_started_twice() -> None:
    h = Harness(nodes=1)
    agent = _ActivateLandsDuringDescribe("node-0", 4, catalog=CATALOG, clock=h.clock)
    h.agents["node-0"] = agent
    h.rec = h.new_reconciler()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=1, maxInstances=4,
                  prewarm={"enabled": False})  # fmt: skip
    for _ in range(4):  # until the start is in flight (held at the agent)
        await h.rec.tick()
        h.clock.t += 0.5
        if agent.sent:
            break
    assert agent.sent == 1
    agent.land_in_describe = True
    await h.rec.tick()  # its Describe predates the instance; the start must still count
    await h.rec.drain_tasks(timeout=5)
    assert len(h.instances("llama-a")) == 1
    assert agent.sent == 1, agent.calls
