"""Fixtures for the node agent tests: small real safetensors models and simulated GPUs.

Models are tiny (a few MiB at most) and written as real ``.safetensors`` files with HF-style
names (:func:`warmserve_agent.testing.write_model`), so "first N layers" and byte-for-byte checks
are meaningful.  Simulated GPU memory lives in sparse files under a per-test temp directory that
the fixtures remove.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.config import AgentConfig
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import write_model

MiB = 1024**2
PAGE = 64 * 1024  # small pages keep the tests' simulated GPUs tiny


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
