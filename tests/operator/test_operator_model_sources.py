"""The operator and spec.model.source (against the in-memory agents, which fetch like the real
agent: a model missing from a store is fetched from its source, an unknown source is refused).
The real agent and huggingface_hub are exercised by tests/e2e/test_model_sources_e2e.py."""

from __future__ import annotations

import pytest
from test_reconciler import Harness, seed_history
from warmserve_operator.testing import FakeAgent

from warmserve.api.crd import SpecError, parse_model_deployment
from warmserve.policy.cluster import GiB

NAME = "meta-llama/Llama-3.1-8B-Instruct"
SRC = "hf://meta-llama/Llama-3.1-8B-Instruct@main"


def add_sourced(h: Harness, name: str, model: str, source: str, **spec) -> None:
    h.kube.add_md(name, model, **spec)
    h.kube.mds[("default", name)]["spec"]["model"]["source"] = source


def sourced_harness() -> Harness:
    h = Harness(nodes=2, gpus=4)
    for a in h.agents.values():
        a.remote = {SRC: (16 * GiB, 32)}
    return h


async def test_a_sourced_model_no_node_holds_is_sized_prewarmed_and_started() -> None:
    h = sourced_harness()
    add_sourced(h, "llama", NAME, SRC, maxBatchSize=4, minInstances=1)
    seed_history(h.kube, "llama", NAME, h.clock.t, avg=6.0, peak=10.0)
    await h.tick(3)
    spec = h.rec.models[NAME].spec
    assert spec is not None and (spec.weight_bytes, spec.num_layers) == (16 * GiB, 32)
    fetched = [m for a in h.agents.values() for m in a.fetched]
    assert fetched and all(f == (NAME, SRC) for f in fetched)
    assert h.instances(NAME) and h.slots(NAME)
    reasons = h.kube.reasons("ModelDeployment/llama")
    assert "Fetching" in reasons and "Fetched" in reasons
    node = next(n for n, a in h.agents.items() if a.fetched)
    models = h.kube.nodes[node]["status"]["models"]
    assert any(m["name"] == NAME for m in models)


async def test_an_unreadable_source_is_a_degraded_condition_naming_it() -> None:
    h = sourced_harness()
    bad = "hf://nobody/nothing"
    add_sourced(h, "x", "nobody/nothing", bad)
    await h.tick(2)
    cond = h.cond("x", "Degraded")
    assert (cond["status"], cond["reason"]) == ("True", "SourceUnavailable")
    assert bad in cond["message"] and "repository not found" in cond["message"]
    assert not any(a.fetched for a in h.agents.values())


async def test_a_deployment_without_source_still_needs_the_weights_in_a_store() -> None:
    h = Harness()
    h.kube.add_md("y", "not-here")
    await h.tick()
    cond = h.cond("y", "Degraded")
    assert cond["reason"] == "ModelNotFound" and "spec.model.source" in cond["message"]


def test_spec_parses_and_checks_the_source() -> None:
    body = {
        "metadata": {"name": "a", "namespace": "n"},
        "spec": {"model": {"name": NAME, "source": SRC}},
    }
    assert parse_model_deployment(body).source == SRC
    body["spec"]["model"]["source"] = "ftp://x/y"
    with pytest.raises(SpecError, match=r"spec\.model\.source: unsupported model source"):
        parse_model_deployment(body)


async def test_fake_agent_refuses_like_the_real_one() -> None:
    """The contract cases the real agent answers in tests/agent/test_model_sources_grpc.py."""
    from warmserve_operator.snapshot import AgentCallError

    a = FakeAgent("n", remote={SRC: (GiB, 4)})
    with pytest.raises(AgentCallError) as e:
        await a.prewarm(NAME, (0,), 0, "r1")  # not in the store, no source
    assert e.value.code == "NOT_FOUND"
    with pytest.raises(AgentCallError) as e:
        await a.prewarm(NAME, (0,), 0, "r2", source="hf://other/repo")
    assert e.value.code == "FAILED_PRECONDITION"
    slot = await a.prewarm(NAME, (0,), 0, "r3", source=SRC)
    assert slot.model == NAME and a.fetched == [(NAME, SRC)]
