"""The production GPU path on the device: ``CudaBackend`` inside the GPU's worker process,
weights read by the worker from the safetensors files into its pinned ring, an engine in that
worker verifying the slot by virtual address and serving."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from warmserve_agent.backends.workers import WorkerMemoryBackend
from warmserve_agent.engine_host import WorkerEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore
from warmserve_agent.worker import WorkerPool

pytestmark = pytest.mark.gpu

MiB = 1024**2


def write_model(root: Path, name: str, layers: int = 4, hidden: int = 512) -> None:
    rng = np.random.default_rng(7)
    d = root / name
    d.mkdir(parents=True)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((1000, hidden), dtype=np.float32),
        "lm_head.weight": rng.standard_normal((1000, hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal((hidden,), dtype=np.float32),
    }
    for i in range(layers):
        t[f"model.layers.{i}.mlp.weight"] = rng.standard_normal((hidden, 4 * hidden), np.float32)
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))


def test_worker_owned_cuda_memory_prewarm_activate_serve(
    tmp_path: Path, driver_spec: str | None
) -> None:
    root = tmp_path / "models"
    write_model(root, "m")
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
