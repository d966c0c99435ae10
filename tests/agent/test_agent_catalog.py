"""The agent's model catalogue in Describe is cached, yet follows the store (issue 16: with 1,000
models, re-scanning the store on every Describe made every operator poll slow)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from conftest import write_model
from warmserve_agent.node import NodeCore
from warmserve_agent.service import AgentService, ServiceInfo


def test_catalog_is_cached_and_follows_added_and_removed_models(
    make_core: Callable[..., NodeCore], model_root: Path
) -> None:
    svc = AgentService(make_core(), ServiceInfo("a"))
    names = [m.name for m in svc.describe_pb().models]
    assert names == ["alpha", "beta", "gamma"]
    calls = 0
    real = svc.core.store.list_models

    def counting() -> list[str]:
        nonlocal calls
        calls += 1
        return real()

    svc.core.store.list_models = counting  # type: ignore[method-assign]
    for _ in range(5):
        svc.describe_pb()
    assert calls == 0, "an unchanged store is not re-scanned per Describe"
    write_model(model_root, "delta", layers=2, hidden=32, seed=4)
    assert [m.name for m in svc.describe_pb().models] == ["alpha", "beta", "delta", "gamma"]
    shutil.rmtree(model_root / "beta")
    assert [m.name for m in svc.describe_pb().models] == ["alpha", "delta", "gamma"]
