"""Helpers of the gateway tests (fixtures are in conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmserve_agent.testing import AgentThread

from warmserve.api.agent.client import SyncAgentClient

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Engines:
    """A running agent; ``start(model, gpu)`` activates an instance and returns (id, URL)."""

    agent: AgentThread
    client: SyncAgentClient

    def start(self, model: str, gpu: int) -> tuple[str, str]:
        r = self.client.activate(model, [gpu])
        return r.instance.instance_id, r.instance.endpoint

    def end(self, instance_id: str) -> None:
        self.client.begin_grace(instance_id)
        self.client.end_instance(instance_id)


def md(
    name: str,
    model: str,
    instances: list[tuple[str, str]] | list[tuple[str, str, str]] = (),  # type: ignore[assignment]
    *,
    namespace: str = "default",
    max_batch: int = 32,
    max_queue: int | None = None,
    max_hold_s: float | None = None,
    created: str = "2026-01-01T00:00:00Z",
    ready_reason: str = "",
    max_instances: int = 8,
    node: str = "",
) -> dict[str, Any]:
    """A ModelDeployment object as the API server returns it (status as the operator writes)."""
    gw: dict[str, Any] = {}
    if max_queue is not None:
        gw["maxQueue"] = max_queue
    if max_hold_s is not None:
        gw["maxHoldSeconds"] = max_hold_s
    status: dict[str, Any] = {
        "instances": [
            {"id": i[0], "endpoint": i[1], "phase": i[2] if len(i) > 2 else "serving"}
            for i in instances
        ]
    }
    if node:
        for i in status["instances"]:
            i["node"] = node
    if ready_reason:
        status["conditions"] = [{"type": "Ready", "status": "False", "reason": ready_reason}]
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "creationTimestamp": created,
        },
        "spec": {
            "model": {"name": model},
            "maxBatchSize": max_batch,
            "maxInstances": max_instances,
            "gateway": gw,
        },
        "status": status,
    }


NODE = "gw-test"  # the GPUNode the mirrored records are on
AGENT_ADDRESS = "127.0.0.1:50051"  # its agentAddress: the engines of the tests listen on 127.0.0.1


def gpunode(
    name: str,
    address: str,
    instances: list[tuple[str, str, str]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """A GPUNode object as the operator writes it: (id, model, endpoint) per instance its agent
    reported."""
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "GPUNode",
        "metadata": {"name": name},
        "spec": {"agentAddress": address},
        "status": {
            "instances": [
                {"id": i, "model": m, "endpoint": e, "phase": "serving"} for i, m, e in instances
            ]
        },
    }


def mirror(objs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The GPUNode record the operator would write for these deployments' instances (what the
    real operator does: it writes both from the same agent reports)."""
    recs = [
        (i["id"], o["spec"]["model"]["name"], i["endpoint"])
        for o in objs
        for i in (o.get("status") or {}).get("instances") or []
    ]
    return gpunode(NODE, AGENT_ADDRESS, recs)


MDS = ("modeldeployments", None)
NODES = ("gpunodes", None)


@dataclass
class ListSource:
    """Hands objects to the gateway through the watch's callbacks: ModelDeployments, and the
    GPUNode records — with ``mirrored`` (the default) one GPUNode listing every instance of the
    deployments, updated with each change as the operator's status writes do; otherwise the
    GPUNodes among ``items``."""

    items: list[Mapping[str, Any]] = field(default_factory=list)
    scopes: tuple[Any, ...] = (MDS, NODES)
    mirrored: bool = True
    on_list: Callable[..., None] | None = None
    on_event: Callable[..., None] | None = None
    _mds: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def start(self, loop: Any, on_list: Callable[..., None], on_event: Callable[..., None]) -> None:
        self.on_list, self.on_event = on_list, on_event
        mds = [o for o in self.items if o.get("kind") != "GPUNode"]
        self._mds = {_key(o): o for o in mds}
        nodes = [o for o in self.items if o.get("kind") == "GPUNode"]
        if self.mirrored:
            nodes.append(mirror(mds))
        on_list(NODES, nodes)  # records first: the operator writes them with the instances
        on_list(MDS, mds)

    def stop(self) -> None:
        pass

    def modified(self, obj: Mapping[str, Any]) -> None:
        assert self.on_event is not None
        if obj.get("kind") == "GPUNode":
            self.on_event(NODES, "MODIFIED", obj)
            return
        self._mds[_key(obj)] = obj
        if self.mirrored:
            self.on_event(NODES, "MODIFIED", mirror(list(self._mds.values())))
        self.on_event(MDS, "MODIFIED", obj)

    def deleted(self, obj: Mapping[str, Any]) -> None:
        assert self.on_event is not None
        self._mds.pop(_key(obj), None)
        self.on_event(MDS, "DELETED", obj)


def _key(o: Mapping[str, Any]) -> str:
    m = o.get("metadata") or {}
    return f"{m.get('namespace')}/{m.get('name')}"


def demand_headers(gw: Any) -> dict[str, str]:
    """What the operator sends to /demand (the gateway's --demand-token-file)."""
    path = gw.config.demand_token_file
    return {"Authorization": f"Bearer {path.read_text().strip()}"} if path else {}


# ---- real sockets and a gateway process -------------------------------------------------------


async def raw_http(
    url: str, request: bytes, timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as written on a fresh connection; the answer's status, headers (names
    lower-cased; repeated ones joined by ``, ``) and body (by its Content-Length, else to EOF)."""
    import asyncio

    from yarl import URL

    u = URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if line:
                    k, _, v = line.partition(":")
                    k = k.strip().lower()
                    headers[k] = f"{headers[k]}, {v.strip()}" if k in headers else v.strip()
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                body = await reader.read()
        return status, headers, body
    finally:
        writer.close()


@dataclass
class GatewayProcess:
    """``warmserve gateway`` as its own process (``--models-file``), as the chart runs it."""

    proc: Any
    api: str
    admin: str
    log: Path
    demand_token: str  # what the operator sends to /demand (--demand-token-file)

    @property
    def demand_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.demand_token}"}

    def status_kib(self, field: str) -> int:
        """A memory figure of the process from /proc (``VmRSS``: now, ``VmHWM``: its peak)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def start_gateway_process(
    tmp: Path, objects: list[Mapping[str, Any]], *flags: str
) -> GatewayProcess:
    """The deployments in ``objects`` with the GPUNode record the operator would write for their
    instances (:func:`mirror`), and a /demand token, as the chart runs a replica."""
    import json
    import subprocess
    import sys
    import time

    models, addr, log = tmp / "models.json", tmp / "gw-address.json", tmp / "gw.log"
    token = tmp / "gw-demand-token"
    token.write_text("demand-secret-for-tests\n")
    mds = [o for o in objects if o.get("kind") != "GPUNode"]
    models.write_text(json.dumps([*objects, mirror(mds)]))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmserve", "gateway", "--models-file", str(models),
             "--host", "127.0.0.1", "--port", "0", "--admin-host", "127.0.0.1",
             "--admin-port", "0", "--address-file", str(addr),
             "--demand-token-file", str(token), *flags],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not addr.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the gateway did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    urls = json.loads(addr.read_text())
    return GatewayProcess(proc, urls["api"], urls["admin"], log, token.read_text().strip())
