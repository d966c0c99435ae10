"""One set of contract cases, run against the unit tests' ``FakeAgent`` AND the real agent.

A fake that accepted what the real agent refuses (``EndInstance`` for a serving instance) once
hid a deletion that never finished.  Every case here drives the operator's
:class:`~warmserve_operator.agents.AgentPort` — the fake directly, the real agent
(``warmserve_agent`` in-process on loopback, simulated GPUs) through
:class:`~warmserve_operator.agents.GrpcAgent` — and asserts the same outcome, so the fake
cannot drift from the agent without a failing test; and both take exactly the parameters the
port declares.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from warmserve_operator.agents import AgentAuth, AgentPort, GrpcAgent
from warmserve_operator.lease import fencing_token
from warmserve_operator.snapshot import AgentCallError, FetchView, InstanceView
from warmserve_operator.testing import FakeAgent

from warmserve.policy.cluster import InstancePhase, WorkerState

REPO = Path(__file__).resolve().parents[2]
A, B = "model-a", "model-b"


def _write_models(root: Path) -> dict[str, tuple[int, int]]:
    spec = importlib.util.spec_from_file_location(
        "warmserve_agent_test_models", REPO / "tests" / "agent" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prof = {"decode_tok_s": 50.0, "max_batch": 4, "kv_bytes_per_token": 256}
    mod.write_model(root, A, layers=4, hidden=64, seed=1, profile=prof)
    mod.write_model(root, B, layers=4, hidden=64, seed=2, profile=prof)
    mod.write_model(root.parent / "remote", "model-c", layers=4, hidden=64, seed=3, profile=prof)
    # 3 attention heads / 1 KV head (config.json): no tensor-parallel split of 2 exists for vLLM
    odd = mod.write_model(root, ODD, layers=2, hidden=48, seed=4, profile=prof)
    cfg = json.loads((odd / "config.json").read_text())
    cfg |= ODD_HEADS
    (odd / "config.json").write_text(json.dumps(cfg))
    return {A: (200_000, 4), B: (200_000, 4), ODD: (0, 2)}


ODD = "model-odd"
ODD_HEADS = {
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 256,
}


def _source(root: Path) -> str:
    """The ``file://`` source of a model no store holds (beside the store, :func:`_write_models`),
    which a node links into its store on first use."""
    return f"file://{root.parent / 'remote' / 'model-c'}"


@pytest.fixture(scope="module")
def contract_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("contract")


@pytest.fixture(scope="module")
def real_agent(contract_dir: Path) -> Any:
    from warmserve_agent.config import AgentConfig, parse_simulated_gpus
    from warmserve_agent.testing import AgentThread

    tmp = contract_dir
    _write_models(tmp / "models")
    cfg = AgentConfig(
        model_dir=tmp / "models",
        simulate_gpus=parse_simulated_gpus("2x32MiB"),
        listen="127.0.0.1:0",
        node_name="n1",
        memory_dir=tmp / "mem",
        use_workers=False,
        spare_workers=0,
        engines=("simulated", "vllm"),  # hosted for the refusals only: nothing imports vLLM
        host_cache_bytes=16 * 1024**2,
        allowed_paths=(tmp / "remote",),
    )
    with AgentThread(cfg) as a:
        yield a


class Term:
    """The operator's :class:`~warmserve_operator.agents.Fencing`, set by hand: the token calls
    carry (``term``) and the tokens the agent refused (``refused_tokens``)."""

    def __init__(self) -> None:
        self.term = 0
        self.refused_tokens: list[int] = []

    def token(self) -> int:
        return self.term

    def refused(self, token: int) -> None:
        self.refused_tokens.append(token)


@pytest.fixture(params=["fake", "real"])
async def agent(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "fake":
        catalog = _write_models(tmp_path / "models")
        fake = FakeAgent(
            "n1",
            gpus=2,
            memory=32 * 1024**2,
            catalog=catalog,
            remote={_source(tmp_path / "models"): (200_000, 4)},
            fencing=Term(),
        )
        fake.heads[ODD] = (ODD_HEADS["num_attention_heads"], ODD_HEADS["num_key_value_heads"])
        yield fake
        return
    real = request.getfixturevalue("real_agent")
    client = GrpcAgent("n1", real.address, AgentAuth(), Term())
    try:
        yield client
    finally:
        client.fencing.term = 0  # unfenced: always accepted by default
        await _reset(client)
        await client.close()


@pytest.fixture
def source(agent: Any, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The source of a model the ``agent`` under test does not hold yet but can read."""
    fake = isinstance(agent, FakeAgent)
    return _source((tmp_path if fake else request.getfixturevalue("contract_dir")) / "models")


_ids = iter(range(10**9))


def rid(verb: str) -> str:
    return f"contract-{verb}-{next(_ids)}"


async def _reset(agent: Any) -> None:
    """Leave the shared real agent empty for the next case."""
    snap = await agent.describe()
    for inst in snap.instances:
        if inst.phase == InstancePhase.SERVING:
            await agent.begin_grace(inst.instance_id, rid("grace"))
        await agent.end_instance(inst.instance_id, True, rid("end"))
    for s in (await agent.describe()).slots:
        await agent.evict(s.slot_id, rid("evict"))


async def refused(code: str, call: Callable[[], Awaitable[Any]]) -> str:
    with pytest.raises(AgentCallError) as info:
        await call()
    assert info.value.code == code, info.value
    return info.value.message


async def test_a_serving_instance_ends_only_through_grace(agent: Any) -> None:
    res = await agent.activate(A, (0,), "", rid("act"), "uid-1")
    iid = res.instance.instance_id
    msg = await refused("FAILED_PRECONDITION", lambda: agent.end_instance(iid, True, rid("end")))
    assert "grace" in msg
    await agent.begin_grace(iid, rid("grace"))
    snap = await agent.describe()
    (inst,) = snap.instances
    assert inst.phase == InstancePhase.GRACE and inst.grace_started_unix > 0
    assert {g.state for g in snap.gpus if g.index == 0} == {WorkerState.GRACE}
    await refused("FAILED_PRECONDITION", lambda: agent.begin_grace(iid, rid("grace")))
    await refused("FAILED_PRECONDITION", lambda: agent.activate(A, (0,), "", rid("act")))
    await agent.end_instance(iid, True, rid("end"))
    snap = await agent.describe()
    assert not snap.instances and not snap.slots
    await refused("NOT_FOUND", lambda: agent.end_instance(iid, True, rid("end")))


async def test_request_ids_replay_the_first_outcome(agent: Any) -> None:
    r = rid("pre")
    first = await agent.prewarm(A, (0,), 0, r, "uid-1")
    again = await agent.prewarm(A, (0,), 0, r, "uid-1")
    assert again.slot_id == first.slot_id
    assert len((await agent.describe()).slots) == 1
    await refused("ALREADY_EXISTS", lambda: agent.prewarm(A, (1,), 0, r, "uid-1"))
    await refused("ALREADY_EXISTS", lambda: agent.prewarm(A, (0,), 0, r, "uid-2"))
    res = await agent.activate(A, (1,), "", rid("act"))
    g = rid("grace")
    await agent.begin_grace(res.instance.instance_id, g)
    await agent.begin_grace(res.instance.instance_id, g)  # a replay, not a second grace


async def test_owner_is_recorded_on_slots_and_instances(agent: Any) -> None:
    slot = await agent.prewarm(A, (0,), 0, rid("pre"), "uid-1")
    assert slot.owner == "uid-1"
    (s,) = (await agent.describe()).slots
    assert s.owner == "uid-1"
    res = await agent.activate(A, (0,), slot.slot_id, rid("act"), "uid-2")
    assert res.hit and res.instance.owner == "uid-2"
    snap = await agent.describe()
    assert snap.instances[0].owner == "uid-2" and snap.slots[0].owner == "uid-2"
    await refused("INVALID_ARGUMENT", lambda: agent.prewarm(B, (1,), 0, rid("p"), "x" * 200))


async def test_serving_gpus_and_slots_are_protected(agent: Any) -> None:
    res = await agent.activate(A, (0,), "", rid("act"), "uid-1")
    (slot,) = (await agent.describe()).slots
    await refused("FAILED_PRECONDITION", lambda: agent.evict(slot.slot_id, rid("ev")))
    await refused("FAILED_PRECONDITION", lambda: agent.prewarm(B, (0,), 0, rid("pre")))
    await refused("FAILED_PRECONDITION", lambda: agent.activate(B, (0,), "", rid("act")))
    assert res.instance.phase == InstancePhase.SERVING


async def test_activation_evicts_other_slots_on_its_group(agent: Any) -> None:
    b = await agent.prewarm(B, (0,), 0, rid("pre"), "uid-b")
    res = await agent.activate(A, (0,), "", rid("act"), "uid-a")
    assert not res.hit and res.evicted_slot_ids == (b.slot_id,)
    snap = await agent.describe()
    assert [s.model for s in snap.slots] == [A]


async def test_a_hit_uses_the_engine_its_prewarm_prepared(agent: Any) -> None:
    """Prewarm names the engine and arguments; an Activate with the same ones builds no engine
    (the Event lists the stages), one with other arguments builds its own."""
    args = ("--max-model-len", "64")
    slot = await agent.prewarm(
        A, (0,), 0, rid("pre"), "uid-1", engine="simulated", engine_args=args
    )
    res = await agent.activate(A, (0,), slot.slot_id, rid("act"), "uid-1", "simulated", args)
    assert res.hit and res.engine_prepared
    names = [name for name, _ in res.stages]
    # KV may be mapped after Activate answers (the agent's pager maps the range in the
    # background; a loaded machine finishes it later): it is not part of the answer's contract.
    assert {"process", "engine", "weights", "endpoint"} <= set(names), names
    assert set(names) <= {"process", "engine", "weights", "KV", "endpoint", "first token"}, names
    assert res.stages_text().startswith("stages: process ")
    assert res.stages_text().endswith("(engine prepared at prewarm)")
    other = await agent.prewarm(B, (1,), 0, rid("pre"), "uid-2", engine="simulated")
    res = await agent.activate(B, (1,), other.slot_id, rid("act"), "uid-2", "simulated", args)
    assert res.hit and not res.engine_prepared
    assert res.stages_text().endswith("(engine built at activation)")
    await refused(
        "INVALID_ARGUMENT",
        lambda: agent.prewarm(A, (0,), 0, rid("pre"), engine_args=("--max-model-lenn", "64")),
    )


async def test_unknown_and_malformed_ids(agent: Any) -> None:
    await refused("NOT_FOUND", lambda: agent.evict("slot-0123456789ab", rid("ev")))
    await refused("NOT_FOUND", lambda: agent.end_instance("inst-0123456789ab", True, rid("e")))
    await refused("NOT_FOUND", lambda: agent.begin_grace("inst-0123456789ab", rid("g")))
    await refused("INVALID_ARGUMENT", lambda: agent.evict("nonsense", rid("ev")))
    await refused("NOT_FOUND", lambda: agent.prewarm("no-such-model", (0,), 0, rid("p")))
    await refused("INVALID_ARGUMENT", lambda: agent.prewarm(A, (0, 0), 0, rid("p")))
    await refused("INVALID_ARGUMENT", lambda: agent.prewarm(A, (7,), 0, rid("p")))


# The real agent is shared by the cases (module scope) and keeps its highest token: every case
# that raises the fence starts above the last.  Terms of one real Lease (created an hour ago),
# close enough that no rise jumps more terms than an agent accepts at once.
_terms = itertools.count(fencing_token(int(time.time()) - 3600, 100), 100)


async def test_a_lower_fencing_token_is_refused_equal_and_higher_accepted(agent: Any) -> None:
    base = next(_terms)
    term = agent.fencing
    term.term = base + 2  # the new leader raises the fence
    slot = await agent.prewarm(A, (0,), 0, rid("pre"), "uid-1")
    term.term = base + 1  # the deposed leader's late calls
    for call in (
        lambda: agent.prewarm(B, (1,), 0, rid("pre"), "uid-1"),
        lambda: agent.evict(slot.slot_id, rid("ev")),
        lambda: agent.activate(A, (0,), slot.slot_id, rid("act"), "uid-1"),
        lambda: agent.describe(),
    ):
        msg = await refused("FAILED_PRECONDITION", call)
        assert msg.startswith("fenced:") and f"token {base + 1}" in msg, msg
        assert f"token {base + 2}" in msg and "newer operator leader" in msg, msg
    assert term.refused_tokens == [base + 1] * 4
    term.term = base + 2  # equal: the current leader, retries included
    snap = await agent.describe()
    assert [s.slot_id for s in snap.slots] == [slot.slot_id]  # nothing of the refused calls
    res = await agent.activate(A, (0,), slot.slot_id, rid("act"), "uid-1")
    await agent.begin_grace(res.instance.instance_id, rid("grace"))
    term.term = base + 3  # higher: accepted, and the fence rises again
    await agent.end_instance(res.instance.instance_id, True, rid("end"))
    term.term = base + 2
    await refused("FAILED_PRECONDITION", lambda: agent.prewarm(A, (0,), 0, rid("pre")))
    term.term = 0  # an unfenced caller (the CLI): accepted unless the agent requires a token
    await agent.prewarm(A, (0,), 0, rid("pre"), "uid-1")
    assert term.refused_tokens == [base + 1] * 4 + [base + 2]


async def test_a_deposed_leader_cannot_replay_its_own_request_id(agent: Any) -> None:
    """The token is checked before the request id: a replay of the deposed leader's own call
    is refused too (it learns that it is deposed), while the new leader repeating that id
    gets the first outcome (the token is not part of the request's fingerprint)."""
    base = next(_terms)
    term = agent.fencing
    term.term = base + 1
    r = rid("pre")
    first = await agent.prewarm(A, (0,), 0, r, "uid-1")
    term.term = base + 2
    again = await agent.prewarm(A, (0,), 0, r, "uid-1")
    assert again.slot_id == first.slot_id
    term.term = base + 1
    await refused("FAILED_PRECONDITION", lambda: agent.prewarm(A, (0,), 0, r, "uid-1"))
    assert term.refused_tokens == [base + 1]


def _signature(cls: type, name: str) -> inspect.Signature:
    sig = inspect.signature(getattr(cls, name), eval_str=True)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "self"])


@pytest.mark.parametrize("impl", [FakeAgent, GrpcAgent])
@pytest.mark.parametrize(
    "name", sorted(n for n, v in vars(AgentPort).items() if inspect.iscoroutinefunction(v))
)
def test_the_fake_and_the_grpc_port_take_exactly_the_ports_parameters(
    impl: type, name: str
) -> None:
    """Every parameter an implementation accepts (``source``, ``on_fetch``...) is declared by
    the port, with the same kind, default and type, so the loop can pass it through the port."""
    assert _signature(impl, name) == _signature(AgentPort, name)


async def test_a_model_missing_from_the_store_is_fetched_from_its_source(
    agent: Any, source: str
) -> None:
    model = f"fetched-{next(_ids)}"  # a new name each time: the real agent's store is shared
    seen: list[FetchView] = []
    slot = await agent.prewarm(
        model, (0,), 0, rid("pre"), "uid-1", source=source, on_fetch=seen.append
    )
    assert slot.model == model and slot.owner == "uid-1" and slot.gpus == (0,)
    assert seen and all(isinstance(f, FetchView) for f in seen)
    assert {(f.model, f.source) for f in seen} == {(model, source)}
    assert seen[-1].state == "done"
    # Describe reports the URI it was fetched from (a file:// model is a link in the store: the
    # operator's per-namespace source rules compare this URI, never the link's target path).
    assert (await agent.describe()).models[model].source == source
    seen.clear()  # in the store now: nothing to fetch
    await agent.prewarm(model, (1,), 0, rid("pre"), "uid-1", source=source, on_fetch=seen.append)
    assert not seen
    (second,) = [s for s in (await agent.describe()).slots if s.gpus == (1,)]
    await agent.evict(second.slot_id, rid("ev"))
    other = f"fetched-{next(_ids)}"
    res = await agent.activate(other, (1,), "", rid("act"), "uid-2", source=source)
    assert not res.hit and res.instance.model == other and res.instance.owner == "uid-2"
    assert other in (await agent.describe()).models
    missing = source + "-missing"
    msg = await refused(
        "FAILED_PRECONDITION",
        lambda: agent.prewarm("never", (0,), 0, rid("pre"), source=missing, on_fetch=seen.append),
    )
    assert msg.startswith(missing), msg
    assert "never" not in (await agent.describe()).models


def _record(i: InstanceView) -> InstanceView:
    # The engine's TTFT window is a live measurement: the Activate answer is taken before the
    # engine's first report, a later Describe after it.
    return replace(i, ttft_p95_s=0.0, ttft_samples=0, ttft_window_s=0.0)


async def test_replies_are_the_records_describe_reports(agent: Any) -> None:
    """Prewarm answers the slot and Activate the instance as Describe reports them (one
    converter per message), with the activation's facts beside the instance."""
    slot = await agent.prewarm(A, (0,), 2, rid("pre"), "uid-1")
    assert slot == (await agent.describe()).slot(slot.slot_id)
    res = await agent.activate(A, (0,), slot.slot_id, rid("act"), "uid-1")
    snap = await agent.describe()
    (inst,) = snap.instances
    assert _record(res.instance) == _record(inst)
    assert res.hit and res.instance.prewarm_hit and res.instance.slot_id == slot.slot_id
    assert isinstance(res.activation_s, float) and res.activation_s > 0
    assert res.evicted_slot_ids == ()


async def test_vllm_refuses_a_tensor_parallel_group_the_heads_do_not_split(agent: Any) -> None:
    """Describe reports the heads config.json declares; a vllm Prewarm (and Activate) of that
    model on 2 GPUs is FAILED_PRECONDITION before anything changes; the simulated engine (bytes
    split) and one GPU are accepted."""
    snap = await agent.describe()
    assert (snap.models[ODD].heads, snap.models[ODD].kv_heads) == (3, 1)
    assert (snap.models[A].heads, snap.models[A].kv_heads) == (0, 0)  # none declared
    why = await refused(
        "FAILED_PRECONDITION",
        lambda: agent.prewarm(ODD, (0, 1), 0, rid("pre"), engine="vllm"),
    )
    assert "does not divide the model's 3 attention heads" in why, why
    why = await refused(
        "FAILED_PRECONDITION", lambda: agent.activate(ODD, (0, 1), "", rid("act"), engine="vllm")
    )
    assert "does not divide the model's 3 attention heads" in why, why
    assert (await agent.describe()).slots == ()
    slot = await agent.prewarm(ODD, (0, 1), 0, rid("pre"), engine="simulated")
    await agent.evict(slot.slot_id, rid("evict"))
