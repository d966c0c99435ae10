"""Engines by name: the registry the agent and its worker processes pick an engine from.

Like vLLM's ``Executor.get_class`` (an executor class chosen from the config) and KubeAI's one
file per engine: each engine is a module here implementing :class:`warmserve_agent.engine.Engine`
and one :class:`EngineInfo` entry below.  Nothing imports an engine's libraries until a worker
needs it: ``preload`` lists the modules a pooled worker imports *before any model is known* (the
point of pooled processes, WarmServe §6), ``factory`` is imported when an instance starts.

Which engine an instance uses: ``spec.engine.name`` on the ModelDeployment (sent on
``Activate``), else the agent's ``--engine`` default.  ``spec.engine.args`` are vLLM's engine
arguments for every engine (``warmserve.engine_args``), validated by the operator at admission
and again by the agent before anything starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


class UnknownEngine(ValueError):
    pass


@dataclass(frozen=True)
class EngineInfo:
    name: str
    factory: str  # "module:Class"; Class(backend=...) -> Engine
    preload: tuple[str, ...]  # imported by pooled workers ahead of time
    summary: str
    # its tensor-parallel ranks take each tensor as vLLM's TP layers load it (rows, columns,
    # vocabulary), so a slot split by bytes cannot serve it (``store.Placement.byte_split``)
    tp_layers: bool = False
    # its start checks the slot's bytes against the store's digests (the simulated engine hashes
    # its own rank; the other ranks' workers hash theirs).  A real engine trusts the slot the
    # loader filled, as it trusts a file: hashing a 70B shard at activation takes a minute.
    verifies_slot: bool = False

    def load(self) -> type:
        mod, _, cls = self.factory.partition(":")
        return getattr(importlib.import_module(mod), cls)

    def create(self, backend: Any = None) -> Any:
        return self.load()(backend=backend)


ENGINES: dict[str, EngineInfo] = {
    e.name: e
    for e in (
        EngineInfo(
            "simulated",
            "warmserve_agent.engines.simulated:SimulatedEngine",
            ("aiohttp.web", "prometheus_client", "warmserve_agent.engines.simulated"),
            "OpenAI-compatible server paced from the model's profile; verifies the slot's bytes",
            verifies_slot=True,
        ),
        EngineInfo(
            "vllm",
            "warmserve_agent.engines.vllm.engine:VllmEngine",
            ("warmserve_agent.engines.vllm.preload",),
            "real vLLM in the pooled worker, parameters built over the prewarm slot",
            tp_layers=True,
        ),
    )
}
DEFAULT_ENGINE = "simulated"


def engine_info(name: str) -> EngineInfo:
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngine(
            f"unknown engine {name!r}; engines: {', '.join(sorted(ENGINES))}"
        ) from None


def preload(names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Import the preload modules of ``names``; returns {engine: error} for those that failed
    (a worker without vLLM still serves the simulated engine)."""
    failed: dict[str, str] = {}
    for n in names:
        try:
            for mod in engine_info(n).preload:
                importlib.import_module(mod)
        except Exception as exc:  # ImportError, or a library failing to initialise
            failed[n] = f"{type(exc).__name__}: {exc}"
    return failed
