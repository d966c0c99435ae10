"""Decisions become actions with one poll's context, and the dispatch passes what they carry to
the agent unchanged (pure; the agent is the unit tests' contract-checked fake)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from warmserve_operator.act import call
from warmserve_operator.actions import Action, action, actions
from warmserve_operator.context import NodePort, PollContext
from warmserve_operator.identity import request_id
from warmserve_operator.ports import md_ref
from warmserve_operator.snapshot import FetchView
from warmserve_operator.testing import FakeAgent

from warmserve.api.crd import ModelDeploymentSpec, parse_model_deployment
from warmserve.control.decisions import Drain, Evict, Prewarm, Start
from warmserve.policy.cluster import GiB, ReplicaKind

SOURCE = "hf://org/fetched"


def md(name: str, source: str = "", **spec: Any) -> ModelDeploymentSpec:
    """A ModelDeployment ``name`` in namespace team-a serving the model of the same name."""
    model = {"name": name, **({"source": source} if source else {})}
    return parse_model_deployment(
        {
            "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}"},
            "spec": {"model": model, **spec},
        }
    )


class Open:
    def may_act(self) -> bool:
        return True


async def poll(
    agent: FakeAgent, owners: dict[str, ModelDeploymentSpec], deleting: frozenset[str] = frozenset()
) -> PollContext:
    return PollContext(
        owners, {agent.node: NodePort(agent, await agent.describe())}, Open(), deleting
    )


def prewarm(model: str) -> Prewarm:
    return Prewarm(model, "n1", (1,), ReplicaKind.BASIC, 0, 1.0, 0, GiB)


async def test_a_start_carries_its_owners_engine_args_and_source_to_the_agent() -> None:
    agent = FakeAgent("n1", 2, catalog={"chat": (GiB, 8)}, remote={SOURCE: (GiB, 8)})
    chat = md("chat", engine={"name": "vllm", "args": ["--max-model-len=256"]})
    fetched = md("fetched", SOURCE)
    ctx = await poll(agent, {"chat": chat, "fetched": fetched})
    snap = ctx.nodes["n1"].snap
    start = Start("chat", "n1", (0,), hit=False)
    (a,) = actions([start], ctx)
    assert a == Action(
        start,
        request_id("activate", "chat", "n1", "g0", snap.agent_id, snap.generation),
        "uid-chat",
        md_ref("team-a", "chat", "uid-chat"),
        "vllm",
        ("--max-model-len=256",),
    )
    assert not a.fetching and a.node == "n1" and a.verb == "activate"
    res = await call(agent, a)
    assert res is not None and res.instance.owner == "uid-chat" and res.instance.engine == "vllm"
    assert agent.engine_args[("chat", (0,))] == ("vllm", ("--max-model-len=256",))

    (cold,) = actions([Start("fetched", "n1", (1,), hit=False)], ctx)
    assert cold.source == SOURCE and cold.fetching, "the node's store lacks it: a fetch first"
    assert (await call(agent, cold)) is not None
    assert agent.fetched == [("fetched", SOURCE)]


async def test_a_prewarm_passes_its_source_and_reports_the_fetch() -> None:
    agent = FakeAgent("n1", 2, remote={SOURCE: (GiB, 8)})
    ctx = await poll(agent, {"fetched": md("fetched", SOURCE)})
    (a,) = actions([prewarm("fetched")], ctx)
    assert a.source == SOURCE and not a.fetching, "a prewarm's fetch shows on its stream"
    seen: list[FetchView] = []
    assert await call(agent, a, seen.append) is None
    assert [f.state for f in seen] == ["downloading", "done"]
    (slot,) = (await agent.describe()).slots
    assert slot.owner == "uid-fetched" and slot.gpus == (1,)


async def test_what_no_deployment_owns_is_removed_but_never_started() -> None:
    agent = FakeAgent("n1", 2, catalog={"chat": (GiB, 8), "gone": (GiB, 8)})
    chat = md("chat")
    ctx = await poll(agent, {"chat": chat}, deleting=frozenset())
    drain = Drain("gone", "n1", (0,), "inst-000000000001", "no ModelDeployment owns it")
    evict = Evict("chat", "n1", (1,), "slot-000000000002", "duplicate")
    got = actions([Start("gone", "n1", (0,), False), prewarm("gone"), drain, evict], ctx)
    assert [a.decision for a in got] == [drain, evict]
    assert got[0].owner == "" and got[0].about is None, "an orphan's Events go nowhere"
    assert got[1].owner == "uid-chat" and got[1].about == md_ref("team-a", "chat", "uid-chat")
    tearing_down = await poll(agent, {"chat": chat}, deleting=frozenset({"uid-chat"}))
    assert actions([Start("chat", "n1", (0,), False), prewarm("chat")], tearing_down) == []


async def test_the_poll_context_cannot_change_after_the_poll() -> None:
    agent = FakeAgent("n1", 2, catalog={"chat": (GiB, 8)})
    owners = {"chat": md("chat")}
    ctx = await poll(agent, owners)
    owners.clear()  # the loop's own dict changes later: the context keeps what it was given
    assert ctx.owner_of("chat") is not None
    with pytest.raises(TypeError):
        ctx.owners["other"] = md("other")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.fence = Open()  # type: ignore[misc]
    assert ctx.snap_of("n1") is ctx.nodes["n1"].snap and ctx.snap_of("n2") is None
    assert action(Start("chat", "n1", (0,), False), None).request_id.endswith(":0")
