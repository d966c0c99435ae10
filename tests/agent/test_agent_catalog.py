"""The agent's model catalogue in Describe is cached, yet follows the store (with 1,000
models, re-scanning the store on every Describe made every operator poll slow)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from warmserve_agent.node import NodeCore
from warmserve_agent.service import AgentService
from warmserve_agent.service_describe import ServiceInfo
from warmserve_agent.testing import write_model

from warmserve.modelref import store_dirname


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


def test_catalog_follows_org_name_models_in_the_flat_store(
    make_core: Callable[..., NodeCore], model_root: Path
) -> None:
    """``ORG/NAME`` models are one entry directly under the store's root like any other
    (``<root>/ORG~NAME``), so adding or removing one changes the root's mtime, which the
    catalogue's stamp watches (an e2e test once saw a freshly fetched ``acme/chat`` missing from
    Describe for the cache's whole TTL, when such models lived one level down)."""
    write_model(model_root, store_dirname("acme/one"), layers=2, hidden=32, seed=5)
    svc = AgentService(make_core(), ServiceInfo("a"))
    assert "acme/one" in [m.name for m in svc.describe_pb().models]
    svc.describe_pb()
    root_mtime = model_root.stat().st_mtime_ns
    write_model(model_root, store_dirname("acme/two"), layers=2, hidden=32, seed=6)
    assert model_root.stat().st_mtime_ns != root_mtime
    names = [m.name for m in svc.describe_pb().models]
    assert {"acme/one", "acme/two"} <= set(names), names
    shutil.rmtree(svc.core.store.model_path("acme/one"))
    assert "acme/one" not in [m.name for m in svc.describe_pb().models]
