"""The production GPU path on the device: ``CudaBackend`` inside the GPU's worker process,
weights read by the worker from the safetensors files into its pinned ring, an engine in that
worker verifying the slot by virtual address and serving."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from warmserve_agent.backends.workers import WorkerMemoryBackend
from warmserve_agent.engine_host import WorkerEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import write_model
from warmserve_agent.worker import WorkerPool

pytestmark = pytest.mark.gpu

MiB = 1024**2


def test_worker_owned_cuda_memory_prewarm_activate_serve(
    tmp_path: Path, driver_spec: str | None
) -> None:
    root = tmp_path / "models"
    write_model(root, "m", layers=4, hidden=512, seed=7)
    pool = WorkerPool([0], spares=0)
    pool.start()
    backend = WorkerMemoryBackend(pool, "cuda", 2 * MiB, driver=driver_spec, reserve_bytes=64 * MiB)
    core = NodeCore(
        MemoryManager(backend),
        WeightStore(root),
        {0: 256 * MiB},
        lambda group: WorkerEngine(pool, group),
        node_name="gpu-check",
    )
    try:
        assert core.mm.num_pages(0) == 128
        slot = core.prewarm("m", [0])
        slot.loader.join()
        assert slot.state == "ready", slot.message
        assert slot.bytes_loaded == sum(p.shard_bytes for p in slot.layout.placements)
        inst, _ = core.activate("m", [0])  # the engine hashes its slot by virtual address
        assert inst.prewarm_hit
        body = json.dumps({"prompt": "gpu", "max_tokens": 3}).encode()
        req = urllib.request.Request(
            inst.endpoint + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        core.begin_grace(inst.instance_id)
        core.end_instance(inst.instance_id, evict_weights=True)
        core.check()
    finally:
        core.shutdown()
        core.mm.close()
        pool.close()
