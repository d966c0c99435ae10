"""The operator's ports: what its control loop needs of the Kubernetes API, as types.

The loop (observe, act, report, teardown, deployments) depends on these protocols and value
types only; :class:`.kube.KubeApi` is the adapter over the official ``kubernetes`` client and
``tests/operator/operator_fakes.py`` the in-memory one, so neither the loop nor its unit tests
import the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from warmserve.api.crd import API_VERSION, MD_KIND, NODE_KIND


@dataclass(frozen=True, slots=True)
class ObjRef:
    """The object an Event is about."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = API_VERSION


def md_ref(namespace: str, name: str, uid: str = "") -> ObjRef:
    return ObjRef(MD_KIND, name, namespace, uid)


def node_ref(name: str, uid: str = "") -> ObjRef:
    return ObjRef(NODE_KIND, name, "", uid)


@dataclass(frozen=True, slots=True)
class AgentDiscovery:
    """Find agent DaemonSet pods (label selector in a namespace) and register them as GPUNodes.

    In a cluster the chart's agent pods are discovered this way (GPUNode name = the pod's node,
    address = pod IP : gRPC port); outside one (tests, hand-run agents) GPUNodes are created
    by hand and discovery is off.
    """

    namespace: str
    selector: str = "app.kubernetes.io/part-of=warmserve,app.kubernetes.io/component=agent"
    port: int = 50051


class KubePort(Protocol):
    async def ready(self) -> bool: ...
    async def list_model_deployments(self) -> list[dict[str, Any]]: ...
    async def list_gpu_nodes(self) -> list[dict[str, Any]]: ...
    async def patch_md_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...
    async def patch_node_status(self, name: str, status: dict[str, Any]) -> None: ...
    async def read_histories(self, uids: list[str]) -> dict[str, dict[str, str]]: ...
    async def write_history(self, uid: str, data: dict[str, str], owner_key: str) -> None: ...
    async def delete_history(self, uid: str) -> None: ...
    async def list_history_uids(self) -> list[str]: ...
    async def emit_event(self, ref: ObjRef, type_: str, reason: str, message: str) -> None: ...
    async def is_leader(self) -> bool: ...
    def leading(self) -> bool: ...
    async def sync_agent_nodes(self) -> None: ...


class ClusterView(Protocol):
    """What the loop reads of the API: kopf's indexes of ModelDeployments and GPUNodes
    (:mod:`.handlers`), so a poll never re-lists them."""

    def model_deployments(self) -> list[dict[str, Any]]: ...
    def gpu_nodes(self) -> list[dict[str, Any]]: ...
    def ready(self) -> bool: ...
