"""What one poll hands the act path: the owners' specs, the nodes as observed, the fence.

:class:`PollContext` is built once per poll by the loop (:mod:`.reconciler`) after it resolved
the deployments and described the agents, and is immutable: the actions of that poll
(:mod:`.actions`) and their agent calls (:mod:`.act`) read everything they need from it, so
nothing on the act path asks the loop for data it already held when it decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from warmserve.api.crd import ModelDeploymentSpec

from .agents import AgentPort
from .snapshot import NodeSnapshot


class Fence(Protocol):
    """The leader fence (:class:`.leader.LoopFence`): asked right before each agent call, since
    leadership can end between the poll that decided a call and the call."""

    def may_act(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class NodePort:
    """One node as this poll observed it: its agent's port (fenced, :mod:`.agents`) and the
    snapshot the poll's decisions were made on."""

    client: AgentPort
    snap: NodeSnapshot


@dataclass(frozen=True, slots=True)
class PollContext:
    """``owners``: model -> the ModelDeployment that owns it and is acted on this poll (its
    UID, engine, engine arguments and model source); ``nodes``: the live nodes, by GPUNode
    name; ``deleting``: UIDs being torn down (nothing is prewarmed or started for them)."""

    owners: Mapping[str, ModelDeploymentSpec]
    nodes: Mapping[str, NodePort]
    fence: Fence
    deleting: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # Read-only views of private copies: a context cannot change after its poll built it.
        object.__setattr__(self, "owners", MappingProxyType(dict(self.owners)))
        object.__setattr__(self, "nodes", MappingProxyType(dict(self.nodes)))

    def owner_of(self, model: str) -> ModelDeploymentSpec | None:
        return self.owners.get(model)

    def snap_of(self, node: str) -> NodeSnapshot | None:
        port = self.nodes.get(node)
        return port.snap if port is not None else None
