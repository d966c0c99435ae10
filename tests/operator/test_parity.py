"""Parity: the operator and the simulator, driven through the same scripted scenario, make the
same decisions (issue 11, "decide once, do twice").

One script — a clock, each model's load, which started instances are serving — drives

* the operator's loop (``Reconciler``) against in-memory agents and API (``FakeAgent``,
  ``FakeKube``, the contract-tested fakes), and
* the simulator's executor (``warmserve.sim.executor``) on a simulated cluster of the same
  shape,

and every decision each side's controller emits is recorded in an executor-independent form
(:func:`warmserve.control.decisions.canonical`: no slot or instance ids).  The sequences must be
equal step by step.  Both sides run the same controller, so what this checks is everything
around it that used to drift: how each executor observes (free memory, Eq. 1, demand, grace
clocks, ownership, in-flight calls) and how it carries decisions out (the next observation shows
the result).  ``test_parity_fails_when_a_rule_drifts`` changes one rule on one side at a time
and checks that the comparison catches it.

With ``depth=True`` both sides also choose the prewarm depth and charge the prepared engine:
the operator from the profile its agents report (``spec.prewarm.layers: auto``), the simulator
from its engine model, both through the policy's depth rule; the profile the fake agents report
is the engine model's numbers, so the depth, the replicas' bytes and every decision must match.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from operator_fakes import Clock, FakeKube
from warmserve_operator.agents import AgentPool
from warmserve_operator.config import OperatorConfig
from warmserve_operator.model_spec import MeasuredProfile
from warmserve_operator.reconciler import Reconciler
from warmserve_operator.testing import FakeAgent

import warmserve.api.history as history_io
from warmserve.control.decisions import Decisions, canonical
from warmserve.control.history import LoadHistory
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import GiB, InstancePhase, ModelSpec
from warmserve.policy.prewarm_depth import choose_depth
from warmserve.sim.cluster import GRACE, SERVING, STARTING, SimCluster
from warmserve.sim.core import Simulation
from warmserve.sim.hardware import load_profile
from warmserve.sim.hooks import Controlled
from warmserve.sim.model import SimModel
from warmserve.sim.model_arch import ModelArch
from warmserve.sim.perf import EngineModel
from warmserve.sim.runner import depth_profile
from warmserve.sim.systems import get_system

W = 60.0
T0 = 1_000_020.0  # the operator's clock at step 0 (a window boundary, like the sim's 0)
STEP_S = 5.0
STEPS = 72  # six minutes: windows close, models scale up, drain, end, re-plan
NODES, GPUS = 2, 4
MEM = 80 * GiB
ASC = AutoscalerConfig(scale_down_delay_s=20.0, max_grace_s=30.0)
MODELS = {  # name: (arch, tp, history avg, history peak)
    "a": ("llama2-7b", 1, 6.0, 10.0),
    "b": ("llama2-13b", 2, 2.0, 4.0),
}


def load_at(model: str, t: float) -> int:
    """The scripted demand: a rises, falls and goes away; b starts from zero on held requests."""
    if model == "a":
        return 0 if t < 15 else 7 if t < 150 else 2 if t < 240 else 0
    return 0 if t < 40 else 9 if t < 150 else 2 if t < 260 else 0


PROMPT = 1155  # tokens of the representative prompt (AzureConv's mean)
# what each replica's prepared engine occupies per GPU: large, so the charge changes placement
# (two models' replicas no longer share a GPU)
ENGINE_BYTES = 50 * GiB


def engine(name: str) -> EngineModel:
    arch, tp, _a, _p = MODELS[name]
    return EngineModel(load_profile("h800"), ModelArch.named(arch), tp)


def measured(name: str) -> MeasuredProfile:
    """What the fake agents report in Describe: the engine model's numbers, as a real agent
    measures them (a load rate per GPU, a timed forward per layer, the activation)."""
    eng = engine(name)
    p = depth_profile(eng, PROMPT, eng.profile.startup.activation_s)
    return MeasuredProfile(
        eng.profile.host_to_gpu_bw, p.layer_compute_s, PROMPT, eng.tp, p.head_s, p.head_start_s,
        ENGINE_BYTES,
    )


def specs(depth: bool = False) -> dict[str, ModelSpec]:
    out = {}
    for name, (arch, tp, _a, _p) in MODELS.items():
        a = ModelArch.named(arch)
        out[name] = ModelSpec(name, a.weight_bytes, tp, 4, 20.0, a.num_layers)
        if depth:  # the simulator's depth: the policy's rule on its engine model (runner.py)
            eng = engine(name)
            layers = choose_depth(
                a.num_layers, None, depth_profile(eng, PROMPT, eng.profile.startup.activation_s)
            ).layers
            out[name] = ModelSpec(
                name, a.weight_bytes, tp, 4, 20.0, a.num_layers, layers, ENGINE_BYTES
            )
    return out


def history(avg: float, peak: float, end: int) -> LoadHistory:
    h = LoadHistory(W)
    for i in range(end - 30, end):
        h.record(i, avg, peak)
    return h


def split(load: int, n: int) -> list[int]:
    return [load // n + (1 if i < load % n else 0) for i in range(n)]


LINGER_S = {"a": 12.0, "b": 45.0}  # how long a drained instance's requests keep running (b's
# outlast the 30 s grace period: its grace ends cut off)


class Lingering:
    """Requests a drained instance still runs: its load when drained, until they finish."""

    def __init__(self) -> None:
        self.since: dict[tuple[str, tuple[int, ...]], tuple[float, int]] = {}

    def load(self, model: str, key: tuple[str, tuple[int, ...]], t: float, last: int) -> int:
        since, n = self.since.setdefault(key, (t, last))
        return n if t - since < LINGER_S[model] else 0

    def forget(self, live: set[tuple[str, tuple[int, ...]]]) -> None:
        for k in list(self.since):
            if k not in live:
                del self.since[k]


# ------------------------------------------------------------------ the operator side


class OperatorSide:
    def __init__(self, drift: str = "", depth: bool = False) -> None:
        self.clock = Clock(T0)
        self.kube = FakeKube()
        sp = specs()
        catalog = {m: (s.weight_bytes, s.num_layers) for m, s in sp.items()}
        self.agents = {
            f"node-{i}": FakeAgent(f"node-{i}", GPUS, MEM, catalog, clock=self.clock)
            for i in range(NODES)
        }
        for name, agent in self.agents.items():
            self.kube.add_node(name)
            if depth and drift != "operator-without-profile":
                agent.profiles = {m: measured(m) for m in MODELS}
            if drift == "operator-without-engine-bytes":
                agent.profiles = {m: replace(p, engine_overhead_bytes=0)
                                  for m, p in agent.profiles.items()}
        for m, (_arch, tp, avg, peak) in MODELS.items():
            self.kube.add_md(m, m, tensorParallel=tp, maxBatchSize=4, maxInstances=8)
            self.kube.mds[("default", m)]["spec"]["model"]["coldStartSeconds"] = 20.0
            hist = history(avg, peak, math.floor(T0 / W))
            self.kube.configmaps[f"uid-{m}"] = history_io.to_data(hist, m)
        cfg = OperatorConfig(window_s=W, poll_s=STEP_S, autoscaler=ASC, leader_settle_polls=1)
        pool = AgentPool(factory=lambda node, addr: self.agents[node])
        self.rec = Reconciler(cfg, self.kube, pool, clock=self.clock)
        self.drift = drift
        self.linger = Lingering()
        self.log: list[list[tuple[Any, ...]]] = []
        _record(self.rec.controller, self.log)

    def instances(self, model: str) -> list[Any]:
        out = [
            (a.node, i)
            for a in self.agents.values()
            for i in a.instances.values()
            if i.model == model
        ]
        return [i for _n, i in sorted(out, key=lambda x: (x[0], x[1].gpus))]

    async def step(self, t: float) -> None:
        self.clock.t = T0 + t
        held: dict[str, int] = {}
        live = set()
        for m in MODELS:
            serving = [i for i in self.instances(m) if i.phase == InstancePhase.SERVING]
            for a in self.agents.values():
                for i in a.instances.values():
                    if i.model == m:
                        key = (a.node, i.gpus)
                        live.add(key)
                        grace = i.phase == InstancePhase.GRACE
                        i.running = self.linger.load(m, key, t, i.running) if grace else 0
            load = load_at(m, t)
            if serving:
                for i, n in zip(serving, split(load, len(serving)), strict=True):
                    i.running = n
            elif load:
                held[m] = load
        self.linger.forget(live)
        if self.drift == "operator-ignores-held":
            held = {}
        self.rec.held = lambda: held
        for _ in range(3):  # an agent's instance event wakes the loop again (docs/operator.md)
            await self.rec.tick()
            await self.rec.drain_tasks(timeout=5)
            if not any(d[0] in ("Drain", "EndGrace") for d in self.log[-1]):
                break


# ------------------------------------------------------------------ the simulator side


class SimSide:
    def __init__(self, drift: str = "", depth: bool = False) -> None:
        profile = load_profile("h800")
        models = []
        for idx, (name, spec) in enumerate(specs(depth).items()):
            arch, tp, avg, peak = MODELS[name]
            eng = EngineModel(profile, ModelArch.named(arch), tp)
            models.append(
                SimModel(idx, spec, eng, 1024.0, GiB // 1024, 0.0, [avg] * 30, [peak] * 30)
            )
        empty = np.zeros(0)
        self.sim = Simulation(
            system=get_system("warmserve"),
            models=models,
            cluster=SimCluster(NODES, GPUS, MEM),
            arrival=empty,
            model_of=np.zeros(0, dtype=int),
            input_tokens=empty,
            output_tokens=empty,
            duration_s=STEPS * STEP_S,
            window_s=W,
            autoscaler=ASC,
            scale_interval_s=STEP_S,
            queue_timeout_s=3600.0,
            drain_s=0.0,
            hooks=Controlled(),
        )
        self.drift = drift
        self.linger = Lingering()
        self.log: list[list[tuple[Any, ...]]] = []
        assert self.sim.controller is not None and self.sim.executor is not None
        _record(self.sim.controller, self.log)
        if drift == "sim-drops-grace-load":
            import warmserve.sim.executor as ex

            orig = ex.instance_obs

            def no_grace(inst: Any) -> Any:
                o = orig(inst)
                if inst.phase == GRACE:
                    from dataclasses import replace

                    o = replace(o, in_flight=0, running=0)
                return o

            self._restore = (ex, orig)
            ex.instance_obs = no_grace

    def close(self) -> None:
        if hasattr(self, "_restore"):
            ex, orig = self._restore
            ex.instance_obs = orig

    def step(self, t: float) -> None:
        sim = self.sim
        sim.t_now = t
        for inst in list(sim.instances):
            if inst.phase == STARTING:
                inst.phase = SERVING  # the fake agent's instances serve at once
        live: set[tuple[str, tuple[int, ...]]] = set()
        for m in sim.models:
            mine = sorted(
                (i for i in sim.instances if i.model == m.spec.name), key=lambda i: (i.node, i.gpus)
            )
            serving = [i for i in mine if i.phase == SERVING]
            for i in mine:
                key = (i.node, i.gpus)
                live.add(key)
                grace = i.phase == GRACE
                i.n_assigned = self.linger.load(m.spec.name, key, t, i.n_assigned) if grace else 0
            load = load_at(m.spec.name, t)
            sim.queue[m.idx] = deque()
            if serving:
                for i, n in zip(serving, split(load, len(serving)), strict=True):
                    i.n_assigned = n
            elif load:
                sim.queue[m.idx] = deque(range(load))
        self.linger.forget(live)
        sim.executor.step(t)


def _record(controller: Any, log: list[list[tuple[Any, ...]]]) -> None:
    """Record every decide call's decisions, and with them the demand the controller measured
    and its forecasts (the inputs the decisions came from)."""
    orig: Callable[..., Decisions] = controller.decide
    orig_observe: Callable[..., dict[str, float]] = controller.observe
    seen: dict[str, Any] = {}

    def observe(obs: Any) -> dict[str, float]:
        out = orig_observe(obs)
        seen["demand"] = tuple(sorted(out.items()))
        return out

    def decide(obs: Any, only: Any = None) -> Decisions:
        out = orig(obs, only)
        fc = tuple(
            (m, round(f.avg, 6), round(f.peak, 6))
            for m in sorted(controller.models)
            if (f := controller.forecast_of(m)) is not None
        )
        log.append([("Inputs", seen.get("demand"), fc), *(canonical(d) for d in out.items)])
        return out

    controller.observe = observe
    controller.decide = decide


def run(drift: str = "", depth: bool = False) -> tuple[list[Any], list[Any]]:
    op, sim = OperatorSide(drift, depth), SimSide(drift, depth)
    try:
        sim.sim.executor.bootstrap(0.0, {})
        for k in range(STEPS):
            t = k * STEP_S
            asyncio.run(op.step(t))
            sim.step(t)
    finally:
        sim.close()
    return op.log, sim.log


def test_operator_and_simulator_decide_alike() -> None:
    op, sim = run()
    flat = [d for calls in op for d in calls if d[0] != "Inputs"]
    kinds = {d[0] for d in flat}
    # The script exercises every kind of decision, so parity covers every rule.
    assert {"Start", "Prewarm", "Drain", "EndGrace"} <= kinds, kinds
    assert any(d[0] == "Start" and d[4] for d in flat), "a prewarm hit"
    reasons = {d[4] for d in flat if d[0] == "EndGrace"}
    assert reasons == {"idle", "grace period over"}, reasons
    for k, (a, b) in enumerate(zip(op, sim, strict=False)):
        assert a == b, f"decision call {k} differs:\n operator {a}\n simulator {b}"
    assert len(op) == len(sim), f"{len(op)} decision calls by the operator, {len(sim)} by the sim"


@pytest.mark.parametrize("drift", ["operator-ignores-held", "sim-drops-grace-load"])
def test_parity_fails_when_a_rule_drifts(drift: str) -> None:
    op, sim = run(drift)
    assert op != sim, f"a drifted {drift} went unnoticed"


def test_operator_and_simulator_choose_the_same_depth_and_charge_the_same_engine() -> None:
    op, sim = run(depth=True)
    sp = specs(depth=True)
    prewarms = [d for calls in op for d in calls if d[0] == "Prewarm"]
    # the profiled depth is partial (the check would prove nothing with every layer resident)
    # and every replica carries its engine's bytes
    for d in prewarms:
        s = sp[d[1]]
        assert d[7] == s.prewarm_layers < s.num_layers, d
        assert d[8] == s.prewarm_bytes_per_gpu > ENGINE_BYTES, d
    assert {d[1] for d in prewarms} == set(MODELS)
    assert any(d[0] == "Start" and d[4] for calls in op for d in calls), "a prewarm hit"
    for k, (a, b) in enumerate(zip(op, sim, strict=False)):
        assert a == b, f"decision call {k} differs:\n operator {a}\n simulator {b}"
    assert len(op) == len(sim)


@pytest.mark.parametrize("drift", ["operator-without-profile", "operator-without-engine-bytes"])
def test_depth_parity_fails_when_the_operator_lacks_a_measurement(drift: str) -> None:
    op, sim = run(drift, depth=True)
    assert op != sim, f"{drift}: the operator still decided as the simulator"
