"""Tenancy's pure pieces in the gateway: name resolution per caller (hypothesis), the agent
records an endpoint must match, API key scopes, the held caps per namespace and key, and the
demand wire's namespace."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_gateway.auth import ApiKeys, Caller
from warmserve_gateway.catalog import Catalog, parse_deployment
from warmserve_gateway.holding import Dispatcher, QueueFull
from warmserve_gateway.names import Ambiguous, Named, NameIndex, parse_global, resolve, visible
from warmserve_gateway.records import endpoint_problem
from warmserve_operator.gateway_demand import sum_held

from tests.gateway.gw_support import gpunode, md
from warmserve.api.demand import DemandReport, ModelDemand

# ------------------------------------------------------------------------------ name resolution

NS = ["team-a", "team-b", "team-c"]
names_st = st.sampled_from(["chat", "code", "tiny", "team-a/chat", "team-b/chat", "org/x"])
deps_st = st.lists(
    st.builds(Named, st.sampled_from(NS), st.sampled_from(["chat", "code", "x"]), names_st),
    max_size=8,
).map(lambda ds: {d.key: d for d in ds})
globals_st = st.dictionaries(
    st.sampled_from(["chat", "code", "tiny", "shared"]),
    st.sampled_from([f"{n}/{d}" for n in NS for d in ("chat", "code", "x")]),
    max_size=3,
)
scope_st = st.frozensets(st.sampled_from(NS), max_size=3)


def _ident(d: Named) -> Named:
    return d


def _try(name: str, scope: frozenset[str], deps: dict[str, Named], gl: dict[str, str]) -> Any:
    try:
        return resolve(name, scope, deps, _ident, gl)
    except Ambiguous as exc:
        return exc


@given(names_st, scope_st, deps_st, globals_st)
@settings(max_examples=500, deadline=None)
def test_a_name_reaches_another_namespace_only_through_an_admin_claim(
    name: str, scope: frozenset[str], deps: dict[str, Named], gl: dict[str, str]
) -> None:
    got = _try(name, scope, deps, gl)
    if isinstance(got, Ambiguous):
        # the message lists only ids the caller may use (the requested name is echoed before
        # the list, so only the list is read)
        listed = str(got).split("you may use (", 1)[1].split(")", 1)[0].split(", ")
        assert len(listed) > 1
        for key in listed:
            assert deps[key].namespace in scope
        return
    if got is not None and got.namespace not in scope:
        assert gl.get(name) == got.key, "outside the caller's namespaces only via the claim"
    # Deployments of other namespaces that no claim names change nothing for this caller.
    claimed = set(gl.values())
    mine = {k: d for k, d in deps.items() if d.namespace in scope or k in claimed}
    again = _try(name, scope, mine, gl)
    assert type(again) is type(got) and (isinstance(got, Ambiguous) or again == got)


@given(scope_st, deps_st, globals_st)
@settings(max_examples=300, deadline=None)
def test_every_listed_id_resolves_to_its_deployment_and_canonical_ids_work(
    scope: frozenset[str], deps: dict[str, Named], gl: dict[str, str]
) -> None:
    listed = visible(scope, deps, _ident, gl)
    for i, d in listed:
        assert _try(i, scope, deps, gl) is d
        assert d.namespace in scope or gl.get(i) == d.key
    assert len({i for i, _ in listed}) == len(listed), "ids are unique"
    for key, d in deps.items():
        if d.namespace in scope:
            got = _try(key, scope, deps, gl)
            assert got is d or (isinstance(got, Ambiguous) and key in str(got))
        else:  # listed only under a name the admin claimed for it
            assert all(gl.get(i) == key for i, x in listed if x is d)


@given(names_st, scope_st, deps_st, globals_st)
@settings(max_examples=500, deadline=None)
def test_the_index_the_gateway_uses_answers_like_the_rule(
    name: str, scope: frozenset[str], deps: dict[str, Named], gl: dict[str, str]
) -> None:
    index = NameIndex(deps, _ident)
    want = _try(name, scope, deps, gl)
    try:
        got: Any = index.resolve(name, scope, gl)
    except Ambiguous as exc:
        got = exc
    assert type(got) is type(want)
    assert str(got) == str(want) if isinstance(want, Ambiguous) else got is want
    assert visible(scope, deps, _ident, gl, index) == visible(scope, deps, _ident, gl)


def test_global_claims_are_parsed_strictly() -> None:
    assert parse_global(["chat=team-a/chat"]) == {"chat": "team-a/chat"}
    for bad in ("chat", "chat=team-a", "=team-a/chat", "chat=team-a/x/y", "chat=/x"):
        with pytest.raises(ValueError, match="NAME=NAMESPACE/DEPLOYMENT"):
            parse_global([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_global(["c=a/x", "c=b/y"])


# ------------------------------------------------------------------------------ agent records


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://169.254.169.254:80", "link-local"),
        ("http://[fe80::1]:80", "link-local"),
        ("http://[::ffff:169.254.169.254]:80", "link-local"),
        ("http://0.0.0.0:80", "unspecified"),
        ("http://10.0.0.7:8000/#", "fragment"),
        ("http://10.0.0.7:8000?x=1", "query"),
        ("http://user:pw@10.0.0.7:8000", "user info"),
        ("http://10.0.0.7:8000/latest/meta-data", "path"),
        ("file:///etc/passwd", "scheme"),
        ("gopher://10.0.0.7:70", "scheme"),
        ("http://metadata.google.internal:80", "metadata"),
        ("http://10.0.0.7", "no port"),
        ("http://10.0.0.7:99999", "malformed"),
    ],
)
def test_endpoints_that_are_never_contacted(url: str, why: str) -> None:
    assert why in endpoint_problem(url)


def test_an_instance_is_routed_only_when_its_agent_reported_it() -> None:
    good = "http://10.0.0.7:41000"
    objs = [
        md(
            "chat", "tiny",
            [("i1", good), ("i2", "http://10.0.0.7:41001"), ("i3", "http://10.0.0.9:41002"),
             ("i4", "http://169.254.169.254:80"), ("i5", "http://10.0.0.7:41005")],
            namespace="team-a", node="n1",
        ),
    ]  # fmt: skip
    c = Catalog()
    c.replace_nodes(
        [
            gpunode(
                "n1",
                "10.0.0.7:50051",
                [
                    ("i1", "tiny", good),
                    ("i2", "tiny", "http://10.0.0.7:41999"),  # another endpoint
                    ("i3", "tiny", "http://10.0.0.9:41002"),  # not the agent's host
                    ("i4", "tiny", "http://169.254.169.254:80"),
                    ("i5", "other", "http://10.0.0.7:41005"),  # another model
                ],
            )
        ]
    )
    c.replace(objs)
    assert [i.instance_id for i in c.owners["tiny"].serving] == ["i1"]
    # The record going away takes the route away; coming back restores it.
    assert c.replace_nodes([]) == {"tiny"} and c.owners["tiny"].serving == ()
    c.replace_nodes([gpunode("n1", "10.0.0.7:50051", [("i1", "tiny", good)])])
    assert [i.url for i in c.owners["tiny"].serving] == [good]
    # A status naming another node than the record's is not trusted either.
    c.upsert(md("chat", "tiny", [("i1", good)], namespace="team-a", node="n2"))
    assert c.owners["tiny"].serving == ()


# ------------------------------------------------------------------------------ API key scopes


def test_secret_keys_are_scoped_by_their_namespace_prefix(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "team-a.alice").write_text("sk-alice")
    (d / "team-b.bob").write_text("sk-bob")
    (d / "team-a.ci").write_text("sk-ci")
    (d / "team-b.ci").write_text("sk-ci")  # the same token under two names: both namespaces
    (d / "legacy").write_text("sk-old")  # the old format: the default namespaces only
    (d / "Not_A_Namespace.x").write_text("sk-odd")
    keys = ApiKeys(d, default_namespaces=("warmserve",))
    assert keys.check("Bearer sk-alice") == Caller("team-a.alice", frozenset({"team-a"}))
    assert keys.check("Bearer sk-bob") == Caller("team-b.bob", frozenset({"team-b"}))
    assert keys.check("Bearer sk-ci") == Caller(
        "team-a.ci,team-b.ci", frozenset(["team-a", "team-b"])
    )
    assert keys.check("Bearer sk-old") == Caller("legacy", frozenset({"warmserve"}))
    assert keys.check("Bearer sk-odd") == Caller("Not_A_Namespace.x", frozenset({"warmserve"}))


# ------------------------------------------------------------------------------ caps


async def test_held_caps_per_namespace_and_per_key_and_a_clamped_max_queue() -> None:
    d = Dispatcher(max_held=100, max_held_per_namespace=3, max_held_per_key=2)
    for name, ns in (("a1", "team-a"), ("a2", "team-a"), ("b1", "team-b")):
        d.update(name, parse_deployment(md(name, name, [], namespace=ns, max_queue=10_000)))
    st = {m: d.state(m) for m in ("a1", "a2", "b1")}
    assert d.queue_cap(st["a1"]) == 3  # type: ignore[arg-type]
    held = [asyncio.create_task(d.acquire(st["a1"], 1e12, key="k1")) for _ in range(2)]  # type: ignore[arg-type]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="--max-held-per-key"):
        await d.acquire(st["b1"], 1e12, key="k1")  # type: ignore[arg-type]
    held.append(asyncio.create_task(d.acquire(st["a2"], 1e12, key="k2")))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert d.held_by_namespace == {"team-a": 3} and d.held_by_key == {"k1": 2, "k2": 1}
    with pytest.raises(QueueFull, match=r"namespace 'team-a'.*--max-held-per-namespace"):
        await d.acquire(st["a2"], 1e12, key="k3")  # type: ignore[arg-type]
    held.append(asyncio.create_task(d.acquire(st["b1"], 1e12)))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # another namespace still holds
    assert d.held_by_namespace == {"team-a": 3, "team-b": 1}
    for t in held:
        t.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert d.held_by_namespace == {} and d.held_by_key == {} and d.held_total == 0


async def test_a_model_taken_over_by_another_deployment_fails_the_old_queue() -> None:
    d = Dispatcher()
    d.update("m", parse_deployment(md("x", "m", [], namespace="team-a")))
    st = d.state("m")
    held = asyncio.create_task(d.acquire(st, 1e12))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    d.update("m", parse_deployment(md("y", "m", [("i", "http://e")], namespace="team-b")))
    with pytest.raises(Exception, match="no longer served"):
        await held  # never dispatched to team-b's instance
    assert d.held_by_namespace == {}


# ------------------------------------------------------------------------------ demand wire


def test_demand_reports_carry_the_namespace_and_are_capped_per_namespace() -> None:
    r = DemandReport(
        "r", 1.0, 1, {"a1": ModelDemand(30, 0, "team-a"), "b": ModelDemand(2, 0, "team-b")}
    )
    assert DemandReport.from_json(r.to_json()) == r
    r2 = DemandReport("r2", 1.0, 1, {"a2": ModelDemand(10, 1, "team-a")})
    assert sum_held([r, r2]) == {"a1": 30, "a2": 10, "b": 2}
    assert sum_held([r, r2], 8) == {"a1": 6, "a2": 2, "b": 2}
    bad = r.to_json()
    bad["models"]["a1"]["namespace"] = "Team A"
    with pytest.raises(ValueError, match="namespace"):
        DemandReport.from_json(bad)


async def test_a_models_file_carries_the_agent_records_too(tmp_path: Path) -> None:
    """--models-file: GPUNode objects in the file are the agents' records, as in a cluster."""
    import json

    from warmserve_gateway.discovery import FileSource

    url = "http://10.0.0.7:41000"
    f = tmp_path / "models.json"
    f.write_text(
        json.dumps(
            [
                md("chat", "tiny", [("i1", url), ("i2", "http://10.0.0.7:41001")]),
                gpunode("n1", "10.0.0.7:50051", [("i1", "tiny", url)]),
            ]
        )
    )
    c = Catalog()
    src = FileSource(f)
    src.start(asyncio.get_running_loop(), lambda scope, items: c.listed(scope, items), print)
    src.stop()
    assert [i.instance_id for i in c.owners["tiny"].serving] == ["i1"]
    assert set(src.scopes) == {("modeldeployments", None), ("gpunodes", None)}


# The catalog updates incrementally (a status write re-checks one deployment, a GPUNode write
# the deployments listing its instances); the result must be a rebuild from scratch's.
_URLS = ["http://10.0.0.1:8000", "http://10.0.0.1:8001", "http://10.0.0.2:8000"]
_inst = st.tuples(st.sampled_from(["i0", "i1", "i2", "i3"]), st.sampled_from(_URLS))
_md_st = st.builds(
    lambda ns, name, model, insts, created, batch: md(
        name, model, insts, namespace=ns, created=f"2026-01-0{created}T00:00:00Z", max_batch=batch
    ),
    st.sampled_from(["a", "b"]),
    st.sampled_from(["d0", "d1", "d2"]),
    st.sampled_from(["m0", "m1"]),
    st.lists(_inst, max_size=2, unique_by=lambda x: x[0]),
    st.integers(1, 3),
    st.sampled_from([4, 8]),
)
_node_st = st.builds(
    lambda name, host, recs: gpunode(name, f"{host}:50051", recs),
    st.sampled_from(["n0", "n1"]),
    st.sampled_from(["10.0.0.1", "10.0.0.2"]),
    st.lists(
        st.tuples(
            st.sampled_from(["i0", "i1", "i2", "i3"]),
            st.sampled_from(["m0", "m1"]),
            st.sampled_from(_URLS),
        ),
        max_size=3,
        unique_by=lambda x: x[0],
    ),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("md"), _md_st),
        st.tuples(st.just("del"), _md_st),
        st.tuples(st.just("node"), _node_st),
        st.tuples(st.just("delnode"), _node_st),
    ),
    max_size=25,
)


@given(_ops)
@settings(max_examples=300, deadline=None)
def test_incremental_catalog_equals_a_fresh_one(ops: list[tuple[str, Any]]) -> None:
    c = Catalog()
    c.replace_nodes([])
    c.replace([])
    mds: dict[str, Any] = {}
    nodes: dict[str, Any] = {}
    for op, obj in ops:
        key = f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}"
        if op == "md":
            c.upsert(obj)
            mds[key] = obj
        elif op == "del":
            c.delete(obj)
            mds.pop(key, None)
        elif op == "node":
            c.upsert_node(obj)
            nodes[obj["metadata"]["name"]] = obj
        else:
            c.delete_node(obj)
            nodes.pop(obj["metadata"]["name"], None)
    fresh = Catalog()
    fresh.replace_nodes(list(nodes.values()))
    fresh.replace(list(mds.values()))
    assert c.owners == fresh.owners and c.served == fresh.served
    assert c.duplicates == fresh.duplicates
    everyone = frozenset({"a", "b"})
    for name in ("m0", "m1", "d0", "d1", "d2", "a/d0", "b/d1"):
        try:
            got: Any = c.resolve(name, everyone)
        except Ambiguous as exc:
            got = str(exc)
        try:
            want: Any = fresh.resolve(name, everyone)
        except Ambiguous as exc:
            want = str(exc)
        assert got == want, name
