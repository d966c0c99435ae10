"""Helpers of the node agent tests: sizes, an agent's settings on loopback, polling.

The fixtures that use them (small real models, cores over simulated GPUs) are in ``conftest.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmserve_agent.config import AgentConfig

MiB = 1024**2
PAGE = 64 * 1024  # small pages keep the tests' simulated GPUs tiny


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
