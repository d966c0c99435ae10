"""The operator's gRPC port (GrpcAgent) against a real agent on loopback (no Kubernetes)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from warmserve_operator.agents import AgentAuth, GrpcAgent
from warmserve_operator.snapshot import AgentCallError

from warmserve.policy.cluster import InstancePhase, WorkerState

REPO = Path(__file__).resolve().parents[2]


def _write_model(root: Path, name: str) -> None:
    spec = importlib.util.spec_from_file_location(
        "warmserve_agent_test_models", REPO / "tests" / "agent" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_model(root, name, layers=4, hidden=32, seed=5)


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    from warmserve_agent.config import AgentConfig, parse_simulated_gpus
    from warmserve_agent.testing import AgentThread

    _write_model(tmp_path / "models", "m")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = AgentConfig(
        model_dir=tmp_path / "models",
        simulate_gpus=parse_simulated_gpus("2x16MiB"),
        listen="127.0.0.1:0",
        node_name="n1",
        memory_dir=tmp_path / "mem",
        use_workers=False,
        spare_workers=0,
        token_file=token,
        host_cache_bytes=16 * 1024**2,
    )
    with AgentThread(cfg) as a:
        yield a.address, token


async def test_grpc_agent_round_trip_and_auth(agent: tuple[str, Path]) -> None:
    address, token = agent
    c = GrpcAgent("node-1", address, AgentAuth(token_file=str(token)))
    try:
        snap = await c.describe()
        assert snap.node == "node-1" and len(snap.gpus) == 2 and "m" in snap.models
        assert all(g.state == WorkerState.IDLE for g in snap.gpus)
        slot = await c.prewarm("m", (1,), 2, "prewarm:m:1")
        assert slot.model == "m" and slot.gpus == (1,) and slot.layers_resident == 2
        again = await c.prewarm("m", (1,), 2, "prewarm:m:1")  # replay: same answer, no new slot
        assert again.slot_id == slot.slot_id and len((await c.describe()).slots) == 1
        res = await c.activate("m", (1,), slot.slot_id, "activate:m:1")
        assert res.hit and res.instance.phase in (InstancePhase.STARTING, InstancePhase.SERVING)
        assert res.instance.endpoint.startswith("http://127.0.0.1:")
        await c.begin_grace(res.instance.instance_id, "grace:m:1")
        await c.end_instance(res.instance.instance_id, True, "end:m:1")
        snap = await c.describe()
        assert not snap.instances and not snap.slots
        with pytest.raises(AgentCallError) as err:
            await c.evict(slot.slot_id, "evict:x")  # evicted with its instance
        assert err.value.code == "NOT_FOUND"
    finally:
        await c.close()
    anon = GrpcAgent("node-1", address, AgentAuth())
    try:
        with pytest.raises(AgentCallError) as err:
            await anon.describe()
        assert err.value.code == "UNAUTHENTICATED"
    finally:
        await anon.close()
    await asyncio.sleep(0)
