"""``FakeAgents``, the agents an operator process reaches in place of gRPC clients
(``python -m warmserve_operator.testing``, ``bench/control_plane_bench.py``): one agent per
node whatever its address, calling with the pool's fencing tokens, unreachable where the
cluster has no such node; its JSON document, and a malformed one refused."""

from __future__ import annotations

import pytest
from warmserve_operator.agents import AgentPool
from warmserve_operator.snapshot import AgentCallError
from warmserve_operator.testing import FakeAgents

from warmserve.policy.cluster import GiB


class Term:
    """A leader's fencing tokens (the Lease term) and the refusals reported back."""

    def __init__(self, term: int) -> None:
        self.term = term
        self.refusals: list[int] = []

    def token(self) -> int:
        return self.term

    def refused(self, token: int) -> None:
        self.refusals.append(token)


def _fleet() -> FakeAgents:
    return FakeAgents({"n0": (2, 80 * GiB), "n1": (4, 80 * GiB)}, {"chat": (GiB, 8)})


async def test_one_agent_per_node_through_the_pool_with_its_fencing() -> None:
    fleet, term = _fleet(), Term(7)
    pool = AgentPool(factory=lambda node, addr: fleet.connect(node, addr, term), fencing=term)
    a = pool.get("n0", "10.0.0.1:50051")
    snap = await a.describe()
    assert (snap.node, len(snap.gpus), set(snap.models)) == ("n0", 2, {"chat"})
    await a.prewarm("chat", (0,), 0, "r1")
    assert pool.get("n0", "10.0.0.2:50051") is a  # a new address: the same node and its state
    assert len((await a.describe()).slots) == 1
    term.term = 5  # a deposed leader's token, lower than one the agent has seen
    with pytest.raises(AgentCallError) as err:
        await a.prewarm("chat", (1,), 0, "r2")
    assert err.value.code == "FAILED_PRECONDITION" and "fenced" in str(err.value)
    assert term.refusals == [5]


async def test_a_node_without_an_agent_is_unreachable() -> None:
    agent = _fleet().connect("gone", "10.0.0.9:50051", Term(1))
    with pytest.raises(OSError, match="unreachable"):
        await agent.describe()


def test_the_json_document_round_trips_and_a_malformed_one_is_refused() -> None:
    fleet = FakeAgents.from_json(_fleet().to_json())
    assert fleet.nodes == {"n0": (2, 80 * GiB), "n1": (4, 80 * GiB)}
    assert fleet.catalog == {"chat": (GiB, 8)}
    for bad in ("[]", "{}", '{"nodes": {"n0": {"gpus": "x"}}, "catalog": {}}', "not json"):
        with pytest.raises(ValueError, match="not a FakeAgents document"):
            FakeAgents.from_json(bad)
