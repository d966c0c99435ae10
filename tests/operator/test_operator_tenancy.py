"""Namespaces are tenants in the operator: model sources per namespace (admission of
spec.model.source before any agent call), weights in a store fetched from another tenant's
source, spec.gateway.maxQueue's bound, and the namespace reaching the fair share."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_reconciler import Harness
from warmserve_operator.tenancy import SourcePolicy, TenancyError, prefix_matches
from warmserve_operator.testing import FakeAgent

from warmserve.api.crd import MAX_QUEUE_LIMIT, SpecError, parse_model_deployment
from warmserve.policy.cluster import GiB

PRIVATE = "s3://models/team-a/llama"
MODEL = "team-a/llama"


def add(h: Harness, ns: str, name: str, model: str, source: str = "", **spec: object) -> None:
    h.kube.add_md(name, model, ns=ns, uid=f"uid-{ns}-{name}", **spec)
    if source:
        h.kube.mds[(ns, name)]["spec"]["model"]["source"] = source


def cond(h: Harness, ns: str, name: str, type_: str) -> dict:
    st = h.kube.mds[(ns, name)].get("status", {})
    return next(c for c in st["conditions"] if c["type"] == type_)


def harness(policy: SourcePolicy) -> Harness:
    h = Harness(nodes=1, gpus=4)
    h.cfg = replace(h.cfg, model_sources=policy)
    h.rec = h.new_reconciler()
    for a in h.agents.values():
        a.catalog = dict(a.catalog)  # its own store (the harness's agents share one dict)
        a.remote = {PRIVATE: (4 * GiB, 8), "hf://public-org/llama": (4 * GiB, 8)}
    return h


def agent(h: Harness) -> FakeAgent:
    return next(iter(h.agents.values()))


async def test_a_source_outside_the_namespace_allowlist_is_refused_before_any_agent_call() -> None:
    h = harness(SourcePolicy())  # the default: any hf:// repo, nothing else
    add(h, "team-b", "steal", MODEL, PRIVATE, minInstances=1)
    await h.tick(3)
    c = cond(h, "team-b", "steal", "Degraded")
    assert (c["status"], c["reason"]) == ("True", "SourceNotAllowed")
    assert PRIVATE in c["message"] and "hf://" in c["message"]
    assert cond(h, "team-b", "steal", "Ready")["reason"] == "SourceNotAllowed"
    events = [e for e in h.kube.events if e[0] == "ModelDeployment/steal"]
    assert [(t, r) for _, t, r, _ in events] == [("Warning", "SourceNotAllowed")]  # once
    assert PRIVATE in events[0][3]
    a = agent(h)
    assert a.inspected == [] and a.fetched == [] and a.calls == []  # nothing reached the agent
    assert not h.instances(MODEL)


async def test_the_admin_allows_sources_per_namespace() -> None:
    h = harness(SourcePolicy.parse(["team-a=s3://models/team-a/", "*=hf://public-org/"]))
    add(h, "team-a", "llama", MODEL, PRIVATE, minInstances=1)
    add(h, "team-b", "pub", "public-org/llama", "hf://public-org/llama", minInstances=1)
    add(h, "team-b", "steal", "team-b/llama", PRIVATE, minInstances=1)
    await h.tick(4)
    assert h.instances(MODEL) and h.instances("public-org/llama")
    assert cond(h, "team-b", "steal", "Degraded")["reason"] == "SourceNotAllowed"
    assert sorted(agent(h).fetched) == [
        ("public-org/llama", "hf://public-org/llama"),
        (MODEL, PRIVATE),
    ]


async def test_weights_another_tenant_fetched_are_not_served_to_a_namespace_without_access() -> (
    None
):
    h = harness(SourcePolicy.parse(["team-a=s3://models/team-a/", "*=hf://"]))
    add(h, "team-a", "llama", MODEL, PRIVATE, minInstances=1)
    await h.tick(3)
    assert h.instances(MODEL) and agent(h).fetched == [(MODEL, PRIVATE)]
    # team-a leaves; team-b names the same model without a source (the weights are in the store)
    del h.kube.mds[("team-a", "llama")]
    add(h, "team-b", "reuse", MODEL, minInstances=1)
    await h.tick(6, dt=2.0)
    c = cond(h, "team-b", "reuse", "Degraded")
    assert c["reason"] == "SourceNotAllowed" and PRIVATE not in c["message"]
    assert not h.instances(MODEL)  # team-a's instance ended; none started for team-b


def test_prefixes_match_on_a_boundary_and_flags_are_checked() -> None:
    assert prefix_matches("hf://team-a-org", "hf://team-a-org/llama")
    assert prefix_matches("hf://team-a-org/", "hf://team-a-org/llama@v2")
    assert prefix_matches("hf://team-a-org/llama", "hf://team-a-org/llama@v2")
    assert not prefix_matches("hf://team-a-org", "hf://team-a-org-evil/llama")
    assert not prefix_matches("s3://models/team-a", "s3://models/team-ab/x")
    assert prefix_matches("s3://", "s3://any/thing")
    p = SourcePolicy.parse(["team-a=pvc://team-a-claim", "*="])
    assert p.allows("team-a", "pvc://team-a-claim/sub") and not p.allows("team-b", "hf://x/y")
    assert "none" in p.refusal("team-b", "hf://x/y")
    assert SourcePolicy.parse([]).allows("anyone", "hf://org/name")
    assert not SourcePolicy.parse([]).allows("anyone", "file:///models/x")
    for bad in ("team-a", "=hf://", "Team_A=hf://", "team-a=ftp://x", "team-a=hf://a b"):
        with pytest.raises(TenancyError):
            SourcePolicy.parse([bad])


def test_max_queue_is_bounded_by_the_replica_cap() -> None:
    body = {"metadata": {"name": "a", "namespace": "n"}, "spec": {"model": {"name": "m"}}}
    body["spec"]["gateway"] = {"maxQueue": MAX_QUEUE_LIMIT}
    assert parse_model_deployment(body).max_queue == MAX_QUEUE_LIMIT == 10_000
    body["spec"]["gateway"] = {"maxQueue": 100_000}
    with pytest.raises(SpecError, match=r"spec\.gateway\.maxQueue must be in \[0, 10000\]"):
        parse_model_deployment(body)


async def test_the_namespace_reaches_the_fair_share() -> None:
    h = harness(SourcePolicy())
    h.kube.add_md("a", "llama-a", ns="team-a", uid="uid-a")
    h.kube.add_md("b", "llama-b", ns="team-b", uid="uid-b")
    await h.tick()
    entries = {m: st.entry.namespace for m, st in h.rec.controller.models.items()}
    assert entries == {"llama-a": "team-a", "llama-b": "team-b"}
