"""Fixtures for the node agent tests: small real safetensors models and simulated GPUs.

Models are tiny (a few MiB at most) and written as real ``.safetensors`` files with HF-style
names, so "first N layers" and byte-for-byte checks are meaningful.  Simulated GPU memory lives
in sparse files under a per-test temp directory that the fixtures remove.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.config import AgentConfig
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore

MiB = 1024**2
PAGE = 64 * 1024  # small pages keep the tests' simulated GPUs tiny


def write_model(
    root: Path,
    name: str,
    *,
    layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    files: int = 2,
    profile: dict | None = None,
) -> Path:
    """Write a random model: embeddings, ``layers`` blocks, final norm, lm_head."""
    rng = np.random.default_rng(seed)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((256, hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal((hidden,), dtype=np.float32),
        "lm_head.weight": rng.standard_normal((256, hidden), dtype=np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.qkv_proj.weight"] = rng.standard_normal(
            (3 * hidden, hidden), dtype=np.float32
        )
        tensors[p + "mlp.down_proj.weight"] = rng.standard_normal(
            (hidden, 2 * hidden), dtype=np.float32
        )
        tensors[p + "input_layernorm.weight"] = rng.standard_normal((hidden,), dtype=np.float32)
    names = sorted(tensors)
    for k in range(files):
        part = {n: tensors[n] for n in names[k::files]}
        save_file(part, str(d / f"model-{k + 1:05d}-of-{files:05d}.safetensors"))
    cfg = {"num_hidden_layers": layers, "hidden_size": hidden}
    cfg["warmserve"] = {
        "max_batch": 4,
        "prefill_tok_s": 1e6,
        "decode_tok_s": 2000.0,
        "kv_bytes_per_token": 1024,
        **(profile or {}),
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_model(root, "alpha", layers=4, hidden=64, seed=1)
    write_model(root, "beta", layers=3, hidden=48, seed=2)
    write_model(root, "gamma", layers=2, hidden=32, seed=3, files=1)
    return root


@pytest.fixture
def make_core(tmp_path: Path, model_root: Path) -> Iterator[Callable[..., NodeCore]]:
    """Build a NodeCore over simulated GPUs with in-process engines."""
    made: list[NodeCore] = []

    def make(gpus: int = 2, gpu_bytes: int = 4 * MiB, page: int = PAGE) -> NodeCore:
        backend = SimulatedBackend(tmp_path / f"gpus{len(made)}", page_bytes=page)
        core = NodeCore(
            MemoryManager(backend),
            WeightStore(model_root),
            dict.fromkeys(range(gpus), gpu_bytes),
            lambda group: InProcessEngine(group),
            node_name="test-node",
        )
        made.append(core)
        return core

    yield make
    for core in made:
        core.shutdown()
        core.mm.close()


def cfg_for(tmp_path: Path, model_root: Path, **kw: Any) -> AgentConfig:
    """An agent on loopback over two small simulated GPUs, engines in-process by default."""
    base: dict[str, Any] = dict(
        model_dir=model_root,
        simulate_gpus=[4 * MiB] * 2,
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / f"gpus-{time.monotonic_ns()}",
        node_name="node-a",
        spare_workers=1,
        use_workers=False,
        grace_interval_s=0.05,
        monitor_interval_s=0.1,
    )
    base.update(kw)
    return AgentConfig(**base)


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
