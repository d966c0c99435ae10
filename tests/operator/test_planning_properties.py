"""Property: for random cluster states, the actions the operator derives from the policy core are
consistent with each other and with the agent contract.

States are built by driving in-memory agents (the agent API's contract, ``FakeAgent``) with
random valid prewarms and activations; then one poll's worth of decisions (autoscaler starts,
drains, Algorithm 1) is translated into actions and executed on the same agents.  Whatever the
state: request ids are unique, starts use disjoint startable GPU groups, prewarms never target a
GPU a start or an instance holds, evictions name existing slots, and the agents accept every
call (no "GPU is serving", no "not enough memory").
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from warmserve_operator.act import call
from warmserve_operator.actions import action, rid
from warmserve_operator.observe import observation
from warmserve_operator.snapshot import AgentCallError
from warmserve_operator.testing import FakeAgent

from warmserve.control.controller import ControlConfig, Controller, ModelEntry
from warmserve.control.decisions import Evict, Prewarm, Start
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import GiB, LoadForecast, ModelSpec, WorkerState

MODELS = {
    "m1": (6 * GiB, 8, 1),
    "m2": (20 * GiB, 8, 2),
    "m3": (30 * GiB, 4, 1),
    "m4": (40 * GiB, 4, 4),
}


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    nodes = draw(st.integers(1, 3))
    gpus = [draw(st.sampled_from([1, 2, 4])) for _ in range(nodes)]
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["prewarm", "activate"]),
                st.integers(0, nodes - 1),
                st.sampled_from(sorted(MODELS)),
                st.integers(0, 3),
            ),
            max_size=8,
        )
    )
    fc = {m: (draw(st.floats(0, 20)), draw(st.floats(0, 30))) for m in MODELS}
    loads = {m: draw(st.integers(0, 12)) for m in MODELS}
    bounds = {m: (draw(st.integers(0, 1)), draw(st.integers(1, 3))) for m in MODELS}
    return {"gpus": gpus, "ops": ops, "fc": fc, "loads": loads, "bounds": bounds}


def _group(n_gpus: int, tp: int, start: int) -> tuple[int, ...] | None:
    if tp > n_gpus:
        return None
    first = (start * tp) % n_gpus
    if first + tp > n_gpus:
        first = 0
    return tuple(range(first, first + tp))


async def _build(sc: dict) -> dict[str, FakeAgent]:
    catalog = {m: (w, layers) for m, (w, layers, _tp) in MODELS.items()}
    agents = {
        f"n{i}": FakeAgent(f"n{i}", g, memory=80 * GiB, catalog=catalog)
        for i, g in enumerate(sc["gpus"])
    }
    for k, (op, node_i, model, start) in enumerate(sc["ops"]):
        agent = agents[f"n{node_i}"]
        gpus = _group(agent.n, MODELS[model][2], start)
        if gpus is None:
            continue
        try:
            if op == "prewarm":
                await agent.prewarm(model, gpus, 0, f"seed-p{k}")
            else:
                await agent.activate(model, gpus, "", f"seed-a{k}")
        except AgentCallError:
            pass  # an invalid random op: the state stays valid
    return agents


_ZERO = {m: (0.0, 0.0) for m in MODELS}


@given(scenarios())
# an autoscaler drain and reclaim (for m4, which needs the whole node) once drained the same
# instance twice: the drain must leave it in grace for the rest of the decision
@example(
    {
        "gpus": [4],
        "ops": [("activate", 0, "m1", 0)],
        "fc": _ZERO,
        "loads": {"m1": 0, "m2": 0, "m3": 0, "m4": 1},
        "bounds": {m: (0, 1) for m in MODELS},
    }
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_one_poll_of_actions_is_consistent_and_accepted(sc: dict) -> None:
    asyncio.run(_check(sc))


async def _check(sc: dict) -> None:
    agents = await _build(sc)
    snaps = {n: await a.describe() for n, a in agents.items()}
    ctl = Controller(
        ControlConfig(window_s=300.0, autoscaler=AutoscalerConfig(scale_down_delay_s=0))
    )
    ctl.set_models(
        {
            m: ModelEntry(
                ModelSpec(m, w, tp=tp, max_batch=4, cold_start_s=5.0, num_layers=layers),
                *sc["bounds"][m],
            )
            for m, (w, layers, tp) in MODELS.items()
        },
        100.0,
    )
    for m, (a, p) in sc["fc"].items():
        ctl.models[m].forecast = LoadForecast(a, max(a, p))
    obs = observation(100.0, snaps, {m: "" for m in MODELS}, set())
    obs = replace(obs, held=dict(sc["loads"]))  # the demand, as held requests
    out = ctl.decide(obs)
    actions = list(out.items)

    ids = [rid(a, snaps[a.node]) for a in actions]
    assert len(ids) == len(set(ids)), "request ids are unique"
    held: dict[str, set[int]] = {n: set() for n in snaps}
    for n, snap in snaps.items():
        for g in snap.gpus:
            if g.state in (WorkerState.DEDICATED, WorkerState.GRACE):
                held[n].add(g.index)
    for a in actions:
        if isinstance(a, Start):
            assert not held[a.node] & set(a.gpus), f"start on busy GPUs: {a}"
            held[a.node] |= set(a.gpus)
    for a in actions:
        if isinstance(a, Prewarm):
            busy = {g.index for g in snaps[a.node].gpus if g.state == WorkerState.DEDICATED}
            started = {
                g for b in actions if isinstance(b, Start) and b.node == a.node for g in b.gpus
            }
            assert not (busy | started) & set(a.gpus), f"prewarm on serving GPUs: {a}"
        if isinstance(a, Evict):
            assert snaps[a.node].slot(a.slot_id) is not None
    evicted = [(a.node, a.slot_id) for a in actions if isinstance(a, Evict)]
    assert len(evicted) == len(set(evicted))

    # Execute in the decisions' order through the operator's one dispatch; the agents must
    # accept every call (an eviction a start already did is skipped).
    for a in actions:
        agent = agents[a.node]
        if isinstance(a, Evict) and a.slot_id not in agent.slots:
            continue
        try:
            await call(agent, action(a, snaps[a.node]))
        except AgentCallError as exc:
            raise AssertionError(f"agent refused {a}: {exc}") from None
