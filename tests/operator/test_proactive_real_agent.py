"""Proactive prewarming (WarmServe §4.1) through the operator's loop, with a real agent.

The loop runs against an in-memory API (FakeKube) and one real agent on loopback with two
simulated GPUs.  Model A serves on both GPUs with one request each; when A's deployment allows
scaling down, the autoscaler drains one instance into a grace period while its request still
runs.  The agent shrinks that instance's KV cache to the Eq. 1 reservation target and reports
the rest as free; the operator reacts (free memory appeared) by prewarming model B into the
lent memory of the *grace* GPU; when the request finishes the instance ends and the GPU is
universal, holding A's weights and B's replica.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from warmserve_operator.agents import AgentAuth, AgentPool, GrpcAgent
from warmserve_operator.config import OperatorConfig
from warmserve_operator.reconciler import Reconciler

import warmserve.api.history as history_io
from tests.operator.operator_fakes import FakeKube
from warmserve.control.history import LoadHistory
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import WorkerState

REPO = Path(__file__).resolve().parents[2]
W = 2.0


def _write_models(root: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "warmserve_agent_test_models", REPO / "tests" / "agent" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    slow = {"decode_tok_s": 20.0, "max_batch": 8, "kv_bytes_per_token": 256}
    mod.write_model(root, "model-a", layers=4, hidden=64, seed=1, profile=slow)
    mod.write_model(root, "model-b", layers=4, hidden=64, seed=2, profile=slow)


def _request(endpoint: str, model: str, max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": max_tokens, "stream": True})
    req = urllib.request.Request(
        f"{endpoint}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            while resp.read(256):
                pass
    except Exception:  # the agent may stop first at teardown
        return


@pytest.fixture
def agent_address(tmp_path: Path) -> Any:
    from warmserve_agent.config import AgentConfig, parse_simulated_gpus
    from warmserve_agent.testing import AgentThread

    _write_models(tmp_path / "models")
    cfg = AgentConfig(
        model_dir=tmp_path / "models",
        simulate_gpus=parse_simulated_gpus("2x32MiB"),
        listen="127.0.0.1:0",
        node_name="n1",
        memory_dir=tmp_path / "mem",
        use_workers=False,
        spare_workers=0,
        host_cache_bytes=16 * 1024**2,
    )
    with AgentThread(cfg) as a:
        yield a.address


async def _until(pred: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await pred()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


async def test_grace_instance_lends_memory_to_a_prewarm(agent_address: str) -> None:
    kube = FakeKube()
    kube.add_node("n1", agent_address)
    kube.add_md("a", "model-a", maxBatchSize=8, minInstances=2, maxInstances=2)
    kube.add_md("b", "model-b", maxBatchSize=8, minInstances=0, maxInstances=2)
    hist = LoadHistory(W)
    end = math.floor(time.time() / W)
    for i in range(end - 30, end):
        hist.record(i, 1.0, 1.0)  # B: one basic replica wanted (ceil(1/8) = 1)
    kube.configmaps["uid-b"] = history_io.to_data(hist, "model-b")
    cfg = OperatorConfig(
        window_s=W,
        poll_s=0.25,
        predictor="seasonal",
        leader_settle_polls=1,
        autoscaler=AutoscalerConfig(scale_down_delay_s=0.5, max_grace_s=60.0),
    )
    rec = Reconciler(cfg, kube, AgentPool(AgentAuth()))
    probe = GrpcAgent("n1", agent_address, AgentAuth())
    stop = asyncio.Event()
    loop_task = asyncio.get_running_loop().create_task(rec.run(stop))
    try:

        async def two_serving() -> Any:
            snap = await probe.describe()
            insts = [
                i for i in snap.instances if i.model == "model-a" and i.phase.value == "serving"
            ]
            return insts if len(insts) == 2 else None

        insts = await _until(two_serving, "two instances of A serving")
        # Both GPUs are dedicated to A: B's replica has nowhere to go yet.
        assert not [s for s in (await probe.describe()).slots if s.model == "model-b"]
        for inst in insts:  # one ~3 s request on each instance (R = 1 of C = 8)
            threading.Thread(
                target=_request, args=(inst.endpoint, "model-a", 60), daemon=True
            ).start()
        await _until(lambda: _running(probe, 2), "both requests running")
        kube.mds[("default", "a")]["spec"]["minInstances"] = 0  # allow the scale-down

        async def b_prewarmed_into_grace() -> Any:
            snap = await probe.describe()
            grace = [i for i in snap.instances if i.phase.value == "grace"]
            b = [s for s in snap.slots if s.model == "model-b"]
            if grace and b and set(b[0].gpus) <= set(grace[0].gpus) and grace[0].running > 0:
                return grace[0], b[0]
            return None

        grace, slot_b = await _until(
            b_prewarmed_into_grace, "B prewarmed into the grace GPU's lent memory"
        )
        assert grace.lent_bytes > 0, "the prewarm was mapped into pages the grace instance lent"

        async def universal_with_both() -> Any:
            snap = await probe.describe()
            gpu = next(g for g in snap.gpus if g.index == slot_b.gpus[0])
            models = {s.model for s in snap.slots if gpu.index in s.gpus}
            ok = gpu.state == WorkerState.UNIVERSAL and "model-b" in models
            return (gpu, models) if ok else None

        await _until(universal_with_both, "grace ended, GPU universal with B resident")

        async def posted() -> bool:  # the loop reports what the agent shows on a later poll
            reasons = kube.reasons("ModelDeployment/a") + kube.reasons("ModelDeployment/b")
            return {"Draining", "InstanceEnded", "Prewarmed"} <= set(reasons)

        await _until(posted, "Draining, InstanceEnded and Prewarmed posted", timeout=10.0)
    finally:
        stop.set()
        await asyncio.wait_for(loop_task, 15)
        await rec.agents.close()
        await probe.close()


async def _running(probe: GrpcAgent, n: int) -> bool:
    snap = await probe.describe()
    return sum(i.running for i in snap.instances) >= n
