"""Which instance endpoints the gateway may contact: only agents' records of running instances.

A ModelDeployment's ``status.instances`` is where the gateway learns a model's instances, but a
namespace's editors may be able to write that status (an RBAC mistake, or a role that grants
``modeldeployments/status``).  Taken as is, ``endpoint: http://169.254.169.254/...#`` would make
the gateway a proxy into the cloud's metadata service or any other internal address.  So an
instance is routed to only when the gateway can tie it to an **agent's record**: the operator
mirrors each agent's Describe answer into its cluster-scoped ``GPUNode``'s ``status.instances``
(id, model, endpoint), which tenants cannot write, and the gateway watches GPUNodes too.  An
instance of a deployment is routable when

* a GPUNode's record has the same instance id, the deployment's ``spec.model.name`` and the
  same endpoint (and the same node, when the deployment's status names one);
* the endpoint is ``http``/``https`` with an IP or host name, a port, no user info, query or
  fragment, and its host is the host of that GPUNode's ``spec.agentAddress`` (the chart's agents
  advertise their pod IP, which is also their registered address);
* the host is not link-local (``169.254.0.0/16``, ``fe80::/10`` — cloud metadata lives there),
  unspecified, multicast or a known metadata name.

Everything here is pure; :mod:`.catalog` applies it whenever a deployment or a GPUNode changes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

NO_RECORD = "no GPUNode's status lists this instance"
_METADATA_NAMES = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data"}
)


@dataclass(frozen=True, slots=True)
class AgentRecord:
    """One instance as its agent reported it (through the operator's GPUNode status)."""

    node: str
    instance_id: str
    model: str
    endpoint: str


@dataclass(frozen=True, slots=True)
class AgentNode:
    name: str
    host: str  # the host part of spec.agentAddress
    records: tuple[AgentRecord, ...] = ()


def _host_of_address(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]").lower()


def parse_gpunode(body: Mapping[str, Any]) -> AgentNode | None:
    """An :class:`AgentNode` from a GPUNode object, or None when it has no usable address."""
    name = str((body.get("metadata") or {}).get("name") or "")
    spec = body.get("spec") or {}
    addr = spec.get("agentAddress") if isinstance(spec, Mapping) else None
    if not name or not isinstance(addr, str) or not addr:
        return None
    status = body.get("status") or {}
    records = []
    for i in (status.get("instances") if isinstance(status, Mapping) else None) or []:
        if not isinstance(i, Mapping):
            continue
        iid, model, ep = i.get("id"), i.get("model"), i.get("endpoint")
        if isinstance(iid, str) and isinstance(model, str) and isinstance(ep, str) and iid:
            records.append(AgentRecord(name, iid, model, ep.rstrip("/")))
    return AgentNode(name, _host_of_address(addr), tuple(records))


def endpoint_problem(url: str) -> str:
    """Why ``url`` may never be contacted ("" when it may, as far as its form goes)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"malformed URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r} (only http/https)"
    if "@" in parts.netloc or parts.username is not None:
        return "user info in the URL"
    if parts.query or parts.fragment or "#" in url or "?" in url:
        return "a query or fragment in the URL"
    if parts.path not in ("", "/"):
        return "a path in the base URL"
    host = (parts.hostname or "").lower()
    if not host:
        return "no host"
    if port is None:
        return "no port"
    if host.rstrip(".") in _METADATA_NAMES:
        return f"metadata host {host!r}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local or ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255":
        return f"address {ip} (link-local, unspecified or multicast)"
    return ""


@dataclass(frozen=True, slots=True)
class Records:
    """Every GPUNode's records, indexed by instance id."""

    nodes: Mapping[str, AgentNode]
    by_instance: Mapping[str, AgentRecord]

    @classmethod
    def of(cls, nodes: Iterable[AgentNode]) -> Records:
        by_name = {n.name: n for n in nodes}
        by_instance: dict[str, AgentRecord] = {}
        for n in by_name.values():
            for r in n.records:
                by_instance[r.instance_id] = r
        return cls(by_name, by_instance)

    def why_not(self, model: str, instance_id: str, endpoint: str, node: str = "") -> str:
        """Why the instance a deployment's status lists may not get requests ("" when it may)."""
        rec = self.by_instance.get(instance_id)
        if rec is None:
            return NO_RECORD
        if rec.model != model:
            return f"its agent runs model {rec.model!r} there"
        if rec.endpoint != endpoint:
            return "its agent reports another endpoint"
        if node and node != rec.node:
            return f"its agent is on node {rec.node!r}"
        problem = endpoint_problem(endpoint)
        if problem:
            return problem
        host = (urlsplit(endpoint).hostname or "").lower()
        agent = self.nodes[rec.node].host
        if host != agent:
            return f"host {host!r} is not its agent's address ({agent!r})"
        return ""
