"""Fixtures for the engine tests.

* ``model_root``/``make_core``: the agent tests' small safetensors models and a ``NodeCore`` over
  simulated GPUs with engines hosted in this process.
* The ``vllm`` marker: tests that run real vLLM (CPU).  They run in the venv
  ``hack/vllm/setup.sh`` installs (``hack/test.sh`` does that); where vLLM is not importable they
  are deselected and the summary says so — unless ``WARMSERVE_REQUIRE_VLLM=1`` (CI), which makes
  a missing vLLM an error instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore

from tests.agent import conftest as agent_conftest

MiB = 1024**2
PAGE = agent_conftest.PAGE
model_root = agent_conftest.model_root  # the agent tests' small safetensors models (fixture)


@pytest.fixture
def make_core(tmp_path: Path, model_root: Path) -> Iterator[Callable[..., NodeCore]]:
    made: list[NodeCore] = []

    def make(
        gpus: int = 2,
        gpu_bytes: int = 4 * MiB,
        page: int = PAGE,
        root: Path | None = None,
        engines: tuple[str, ...] = ("simulated",),
    ) -> NodeCore:
        backend = SimulatedBackend(tmp_path / f"gpus{len(made)}", page_bytes=page)
        core = NodeCore(
            MemoryManager(backend),
            WeightStore(root or model_root),
            dict.fromkeys(range(gpus), gpu_bytes),
            lambda group: InProcessEngine(group),
            node_name="test-node",
            engines=engines,
        )
        made.append(core)
        return core

    yield make
    for core in made:
        core.shutdown()
        core.mm.close()


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_available():
        return
    marked = [i for i in items if i.get_closest_marker("vllm")]
    if not marked:
        return
    if os.environ.get("WARMSERVE_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(
            "WARMSERVE_REQUIRE_VLLM=1 but vllm is not importable: run the vllm group with the "
            "python hack/vllm/setup.sh prints"
        )
    config.hook.pytest_deselected(items=marked)
    items[:] = [i for i in items if not i.get_closest_marker("vllm")]
    config._warmserve_vllm_deselected = len(marked)  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    n = getattr(terminalreporter.config, "_warmserve_vllm_deselected", 0)
    if n:
        terminalreporter.write_line(
            f"{n} vllm tests deselected here (no vLLM in this venv); hack/test.sh runs them "
            "with real vLLM from hack/vllm/setup.sh"
        )
