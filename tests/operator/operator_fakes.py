"""In-memory stand-ins for the Kubernetes API and the clock, for the operator's unit tests (the
agents' stand-in, :class:`~warmserve_operator.testing.FakeAgent`, is importable from
``warmserve_operator.testing``, which the benchmarks use too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from warmserve_operator.ports import ObjRef


@dataclass
class FakeKube:
    """KubePort in memory: objects are dicts as the API returns them."""

    mds: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)  # by owner UID
    events: list[tuple[str, str, str, str]] = field(default_factory=list)
    leader: bool = True
    status_writes: int = 0
    writes_of: dict[tuple[str, str], int] = field(default_factory=dict)

    def add_md(
        self,
        name: str,
        model: str,
        ns: str = "default",
        uid: str | None = None,
        created: str = "2026-01-01T00:00:00Z",
        **spec: Any,
    ) -> None:
        body = {"model": {"name": model}, **spec}
        self.mds[(ns, name)] = {
            "metadata": {
                "name": name,
                "namespace": ns,
                "uid": uid or f"uid-{name}",
                "generation": 1,
                "creationTimestamp": created,
            },
            "spec": body,
        }

    def add_node(self, name: str, address: str = "127.0.0.1:1") -> None:
        self.nodes[name] = {"metadata": {"name": name}, "spec": {"agentAddress": address}}

    def reasons(self, kind_name: str | None = None) -> list[str]:
        return [r for (ref, _t, r, _m) in self.events if kind_name is None or ref == kind_name]

    async def ready(self) -> bool:
        return True

    async def list_model_deployments(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.mds.values()]

    async def list_gpu_nodes(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.nodes.values()]

    async def patch_md_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        if (namespace, name) in self.mds:
            self.status_writes += 1
            self.writes_of[(namespace, name)] = self.writes_of.get((namespace, name), 0) + 1
            self.mds[(namespace, name)]["status"] = {
                **self.mds[(namespace, name)].get("status", {}),
                **status,
            }

    async def patch_node_status(self, name: str, status: dict[str, Any]) -> None:
        if name in self.nodes:
            self.nodes[name]["status"] = status

    async def read_histories(self, uids: list[str]) -> dict[str, dict[str, str]]:
        return {u: dict(self.configmaps[u]) for u in uids if u in self.configmaps}

    async def write_history(self, uid: str, data: dict[str, str], owner_key: str) -> None:
        self.configmaps[uid] = dict(data)

    async def delete_history(self, uid: str) -> None:
        self.configmaps.pop(uid, None)

    async def list_history_uids(self) -> list[str]:
        return list(self.configmaps)

    async def emit_event(self, ref: ObjRef, type_: str, reason: str, message: str) -> None:
        self.events.append((f"{ref.kind}/{ref.name}", type_, reason, message))

    async def is_leader(self) -> bool:
        return self.leader

    def leading(self) -> bool:
        return self.leader

    async def sync_agent_nodes(self) -> None:
        return None


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
