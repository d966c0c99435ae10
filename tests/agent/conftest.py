"""Fixtures for the node agent tests: small real safetensors models and simulated GPUs.

Models are tiny (a few MiB at most) and written as real ``.safetensors`` files with HF-style
names (:func:`warmserve_agent.testing.write_model`), so "first N layers" and byte-for-byte checks
are meaningful.  Simulated GPU memory lives in sparse files under a per-test temp directory that
the fixtures remove.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import write_model

from tests.agent.agent_support import PAGE, MiB


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
