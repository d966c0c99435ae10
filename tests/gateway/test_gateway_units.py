"""Pure pieces of the gateway: the routing rule, the dispatcher's queue invariants (hypothesis),
deployments as routes, API keys, and the demand edge detection."""

from __future__ import annotations

import asyncio
import hmac
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_gateway.auth import ApiKeyError, ApiKeys, Caller
from warmserve_gateway.catalog import Ambiguous, Catalog, parse_deployment
from warmserve_gateway.demand import DemandTracker
from warmserve_gateway.holding import Dispatcher, HoldTimeout, QueueFull
from warmserve_gateway.routing import Endpoint, pick

from tests.gateway.gw_support import gpunode, md
from warmserve.api.crd import dedupe_models, parse_model_deployment

# ------------------------------------------------------------------------------------ routing

endpoints_st = st.lists(st.tuples(st.integers(0, 10), st.booleans()), min_size=0, max_size=8).map(
    lambda xs: [
        Endpoint(f"i{n}", f"http://e{n}", out, ejected_until=100.0 if ej else 0.0)
        for n, (out, ej) in enumerate(xs)
    ]
)


@given(endpoints_st, st.integers(1, 10), st.sets(st.integers(0, 7)))
def test_pick_is_least_outstanding_with_room(eps: list[Endpoint], mb: int, avoid: set[int]) -> None:
    avoid_ids = frozenset(f"i{n}" for n in avoid)
    got = pick(eps, mb, now=50.0, avoid=avoid_ids)
    room = [e for e in eps if e.outstanding < mb and e.ejected_until <= 50.0]
    if not room:
        assert got is None
        return
    assert got is not None and got in room
    preferred = [e for e in room if e.instance_id not in avoid_ids] or room
    assert got in preferred
    assert got.outstanding == min(e.outstanding for e in preferred)


def test_pick_spreads_ties_at_random() -> None:
    eps = [Endpoint("a", "u"), Endpoint("b", "u")]
    seen = {pick(eps, 4, 0.0).instance_id for _ in range(200)}  # type: ignore[union-attr]
    assert seen == {"a", "b"}


# ------------------------------------------------------------------------------------ holding


def _dispatcher(instances: int, max_batch: int, **kw: Any) -> tuple[Dispatcher, Any]:
    d = Dispatcher(**kw)
    obj = md("m", "m", [(f"i{k}", f"http://e{k}") for k in range(instances)], max_batch=max_batch)
    d.update("m", parse_deployment(obj))
    st_ = d.state("m")
    assert st_ is not None
    return d, st_


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 3),
    st.integers(1, 3),
    st.lists(st.sampled_from(["arrive", "finish", "cancel", "scale"]), max_size=40),
)
def test_queue_invariants_under_random_operations(
    instances: int, max_batch: int, ops: list[str]
) -> None:
    """FIFO dispatch; after every step the queue is empty or no instance has room; held and
    outstanding counts always match what is waiting and running."""

    async def run() -> None:
        d, s = _dispatcher(instances, max_batch, max_held=1000)
        arrivals: list[tuple[int, asyncio.Task[Endpoint]]] = []
        running: list[tuple[int, Endpoint]] = []
        order: list[int] = []
        n_inst = instances
        for i, op in enumerate(ops):
            if op == "arrive":
                t = asyncio.create_task(d.acquire(s, deadline=1e12))
                arrivals.append((i, t))
            elif op == "finish" and running:
                _, ep = running.pop(0)
                d.release(s, ep)
            elif op == "cancel":
                waiting = [(k, t) for k, t in arrivals if not t.done()]
                if waiting:
                    waiting[-1][1].cancel()
            elif op == "scale":
                n_inst += 1
                obj = md("m", "m", [(f"i{k}", f"http://e{k}") for k in range(n_inst)])
                obj["spec"]["maxBatchSize"] = max_batch
                d.update("m", parse_deployment(obj))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            for k, t in list(arrivals):
                if t.done():
                    arrivals.remove((k, t))
                    if not t.cancelled():
                        running.append((k, t.result()))
                        order.append(k)
            assert d.check_invariant(s)
            assert s.inflight == len(running) == sum(e.outstanding for e in s.endpoints.values())
            assert s.held == sum(1 for _, t in arrivals if not t.done())
            assert all(e.outstanding <= max_batch for e in s.endpoints.values())
        assert order == sorted(order)  # first come, first served
        for _, t in arrivals:
            t.cancel()

    asyncio.run(run())


async def test_caps_and_hold_timeout() -> None:
    d, s = _dispatcher(0, 1, max_held=3)
    obj = md("m", "m", [], max_queue=2, max_hold_s=0.2)
    d.update("m", parse_deployment(obj))
    waiters = [asyncio.create_task(d.acquire(s, deadline=d.clock() + 0.2)) for _ in range(3)]
    await asyncio.sleep(0)
    assert isinstance(waiters[2].exception(), QueueFull)
    for w in waiters[:2]:
        with pytest.raises(HoldTimeout) as err:
            await w
        assert err.value.retry_after == 1  # min(5 s, the hold time rounded up)
    assert s.held == 0 and d.held_total == 0


async def test_dispatch_racing_a_cancel_gives_the_endpoint_back() -> None:
    d, s = _dispatcher(0, 1)
    t = asyncio.create_task(d.acquire(s, deadline=1e12))
    await asyncio.sleep(0)
    d.update("m", parse_deployment(md("m", "m", [("i0", "http://e0")], max_batch=1)))
    t.cancel()  # dispatched and cancelled in the same loop iteration
    with pytest.raises(asyncio.CancelledError):
        await t
    assert s.inflight == 0 and s.endpoints["i0"].outstanding == 0


# ------------------------------------------------------------------------------------ catalog


def test_catalog_follows_the_operator_on_duplicates_and_parses_status() -> None:
    objs = [
        md("new", "w", [("x", "http://10.0.0.1:80")], namespace="a", created="2026-03-01T00:00Z"),
        md(
            "old", "w", [("y", "http://10.0.0.2:80/", "grace")], namespace="b",
            created="2026-01-01T00:00Z",
        ),
        md("bad", "v", []),
    ]  # fmt: skip
    objs[2]["spec"]["minInstances"] = 5
    objs[2]["spec"]["maxInstances"] = 1
    c = Catalog()
    c.replace_nodes([gpunode("n", "10.0.0.2:50051", [("y", "w", "http://10.0.0.2:80")])])
    changed = c.replace(objs)
    owners, dups = dedupe_models(
        parse_model_deployment(o) for o in objs[:2]
    )  # the operator's own choice
    assert c.owners["w"].key == owners["w"].key == "b/old" and changed == {"w"}
    assert [d.key for d in dups] == list(c.duplicates) == ["a/new"]
    assert "default/bad" in c.invalid and "minInstances" in c.invalid["default/bad"]
    everyone = frozenset({"a", "b", "default"})
    dep = c.resolve("w", everyone)
    assert dep is not None and dep.instances[0].url == "http://10.0.0.2:80" and dep.serving == ()
    assert c.resolve("b/old", everyone) is dep and c.resolve("old", everyone) is dep
    for name in ("a/new", "new"):  # a duplicate is found (to say why) but is not served
        dup = c.resolve(name, everyone)
        assert dup is not None and dup.key == "a/new" and not c.is_served(dup)
    changed = c.delete(objs[1])
    assert changed == {"w"} and c.owners["w"].key == "a/new"  # the next one takes over


def test_catalog_ambiguous_bare_name() -> None:
    c = Catalog()
    c.replace([md("chat", "m1", [], namespace="a"), md("chat", "m2", [], namespace="b")])
    with pytest.raises(Ambiguous, match="a/chat, b/chat"):
        c.resolve("chat", frozenset({"a", "b"}))
    assert c.resolve("a/chat", frozenset({"a", "b"})).model == "m1"  # type: ignore[union-attr]
    assert c.resolve("chat", frozenset({"b"})).model == "m2"  # type: ignore[union-attr]
    changed = c.replace([md("chat", "m3", [], namespace="c")], namespace="b")
    assert changed == {"m2", "m3"} and set(c.owners) == {"m1", "m3"}


# ------------------------------------------------------------------------------------ auth


def test_api_keys_file_and_directory(tmp_path: Path) -> None:
    f = tmp_path / "keys.txt"
    f.write_text("# team keys\nsk-one\n\n  team-a,team-b sk-two  \n")
    keys = ApiKeys(f, default_namespaces=("warmserve",))
    assert len(keys) == 2
    assert keys.check("Bearer sk-one") == Caller("keys.txt:2", frozenset({"warmserve"}))
    assert keys.check("bearer sk-two") == Caller("keys.txt:4", frozenset({"team-a", "team-b"}))
    for bad in (None, "", "Bearer", "Bearer sk-on", "Basic sk-one", "sk-one"):
        assert keys.check(bad) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ApiKeyError, match="no key"):
        ApiKeys(empty)
    with pytest.raises(ApiKeyError):
        ApiKeys(tmp_path / "missing")
    f.write_text("Team_A sk-x\n")
    with pytest.raises(ApiKeyError, match="not a namespace"):
        ApiKeys(f)


def test_api_keys_compare_every_key_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    for i in range(5):
        (d / f"k{i}").write_text(f"sk-{i}")
    keys = ApiKeys(d)
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert keys.check("Bearer sk-0").key_id == "k0"  # type: ignore[union-attr]  # the first ...
    assert len(calls) == 5  # ... and every key is still compared (no early exit)


def test_api_keys_reload_when_the_secret_changes(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "a").write_text("sk-old")
    keys = ApiKeys(d, reload_s=0.0)
    assert keys.check("Bearer sk-old").key_id == "a"  # type: ignore[union-attr]
    import os
    import time

    (d / "a").write_text("sk-new")
    os.utime(d / "a", (time.time() + 5, time.time() + 5))
    assert keys.check("Bearer sk-new").key_id == "a"  # type: ignore[union-attr]
    assert keys.check("Bearer sk-old") is None
    for f in d.iterdir():
        f.unlink()
    os.utime(d, (time.time() + 10, time.time() + 10))
    assert keys.check("Bearer sk-new").key_id == "a"  # type: ignore[union-attr]  # kept


# ------------------------------------------------------------------------------------ demand


@given(st.lists(st.integers(0, 200), min_size=1, max_size=20))
def test_demand_wakes_are_logarithmic_in_a_burst(levels: list[int]) -> None:
    """Held counts move one request at a time; between two returns to zero, a rise to a peak P
    emits at most 1 + log2(P) reports, the first one at the first held request."""
    t = DemandTracker("r", dict)
    h, emitted_since_zero, peak = 0, 0, 0
    for target in levels:
        while h != target:
            h += 1 if target > h else -1
            seq = t.seq
            t.held_changed("m", h)
            if t.seq != seq:
                emitted_since_zero += 1
                assert emitted_since_zero > 1 or h == 1  # the first held request wakes at once
            if h == 0:
                emitted_since_zero, peak = 0, 0
            peak = max(peak, h)
            assert emitted_since_zero <= 1 + math.floor(math.log2(peak)) if peak else True
    t2 = DemandTracker("r", dict)
    reported = []
    for k in range(1, 1025):
        seq = t2.seq
        t2.held_changed("m", k)
        if t2.seq != seq:
            reported.append(k)
    assert reported == [2**i for i in range(11)]
