"""Namespaces are tenants, on the real kube-apiserver: the real gateway (its Kubernetes watch under
the chart's gateway ServiceAccount token) with ModelDeployments in two namespaces, API keys
scoped per namespace, a status endpoint no agent reported (a real listener records any hit), and
spec.gateway.maxQueue above the replica cap refused at admission."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from gw_support import REPO, Engines, gpunode
from warmserve_gateway.config import GatewayConfig
from warmserve_gateway.server import Gateway

from warmserve.testing.k8s import apply_chart_gateway_rbac

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _md(name: str, model: str, **gateway: Any) -> dict[str, Any]:
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": model}, "gateway": {"maxHoldSeconds": 1, **gateway}},
    }


def _status(kubectl: Any, kind: str, name: str, ns: str | None, status: dict[str, Any]) -> None:
    where = ["-n", ns] if ns else []
    kubectl(
        "patch", kind, name, *where, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


async def _post(s: aiohttp.ClientSession, url: str, model: str, key: str) -> tuple[int, Any]:
    body = {"model": model, **CHAT}
    async with s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def _ids(s: aiohttp.ClientSession, api: str, key: str) -> set[str]:
    async with s.get(f"{api}/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
        return {m["id"] for m in (await r.json())["data"]}


@pytest.fixture
async def listener() -> Any:
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path_qs)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", hits
    await runner.cleanup()


async def test_two_namespaces_on_the_real_api_server(
    helm: Any,
    kubectl: Any,
    k8s_namespace: str,
    sa_kubeconfig: Any,
    engines: Engines,
    listener: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/modeldeployments.warmserve.io", "crd/gpunodes.warmserve.io",
    )  # fmt: skip
    release = k8s_namespace
    team_a, team_b = f"{release}-a", f"{release}-b"
    for ns in (team_a, team_b):
        kubectl("create", "namespace", ns)
    node = f"{release}-node"
    iid = ""
    gw: Gateway | None = None
    try:
        # team-a serves "chat" from a real engine; team-b has a deployment of the same bare
        # name and one whose status (written by someone who may write it) points elsewhere.
        kubectl("apply", "-n", team_a, "-f", "-", input=json.dumps(_md("chat", "tiny")))
        kubectl("apply", "-n", team_b, "-f", "-", input=json.dumps(_md("chat", "tiny-b")))
        kubectl("apply", "-n", team_b, "-f", "-", input=json.dumps(_md("probe", "probe")))
        iid, url = await asyncio.to_thread(engines.start, "tiny", 0)
        kubectl("apply", "-f", "-", input=json.dumps(gpunode(node, engines.agent.address)))
        _status(kubectl, "gpunode", node, None, gpunode(node, "", [(iid, "tiny", url)])["status"])
        serving = {"id": iid, "endpoint": url, "phase": "serving"}
        _status(kubectl, "wsmd", "chat", team_a, {"instances": [serving]})
        target, hits = listener
        forged = [
            {"id": "forged", "endpoint": target, "phase": "serving"},  # no agent reported it
            {"id": iid, "endpoint": target, "phase": "serving"},  # team-a's id, elsewhere
            {"id": "m", "endpoint": "http://169.254.169.254:80/latest/#", "phase": "serving"},
        ]
        _status(kubectl, "wsmd", "probe", team_b, {"instances": forged})

        keys = tmp_path / "keys"
        keys.mkdir()
        (keys / f"{team_a}.alice").write_text("sk-alice")
        (keys / f"{team_b}.bob").write_text("sk-bob")
        sa = apply_chart_gateway_rbac(helm, kubectl, release, f"gw{release[-8:]}")
        monkeypatch.setenv("KUBECONFIG", str(sa_kubeconfig(release, sa)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        from warmserve_gateway.discovery import KubeSource

        cfg = GatewayConfig(
            host="127.0.0.1", port=0, admin_host="127.0.0.1", admin_port=0, api_keys=keys,
            anonymous_namespaces=(release,),
        )  # fmt: skip
        # the two tenants' namespaces only: other tests' deployments on this shared API server
        # must not take the model name "tiny" (one deployment per spec.model.name is served)
        gw = Gateway(cfg, KubeSource((team_a, team_b)))
        await gw.start()
        api = gw.urls["api"]
        url_chat = f"{api}/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                listed = gw.synced and await _ids(s, api, "sk-alice") == {"tiny"}
                if listed and gw.catalog.owners["tiny"].serving:
                    break
                await asyncio.sleep(0.1)
            assert await _ids(s, api, "sk-alice") == {"tiny"}
            assert await _ids(s, api, "sk-bob") == {"tiny-b", "probe"}
            st, doc = await _post(s, url_chat, "chat", "sk-alice")
            assert st == 200 and doc["model"] == "tiny", doc
            for name in ("tiny", f"{team_a}/chat"):
                st, doc = await _post(s, url_chat, name, "sk-bob")
                assert st == 404 and doc["error"]["code"] == "model_not_found", (name, doc)
            st, doc = await _post(s, url_chat, "chat", "sk-bob")  # its own "chat": not team-a's
            assert st == 503 and doc["error"]["code"] == "hold_timeout", doc
            # the forged status: held until the hold time, never sent anywhere
            st, doc = await _post(s, url_chat, "probe", "sk-bob")
            assert st == 503 and doc["error"]["code"] == "hold_timeout", doc
            text = await (await s.get(f"{gw.urls['admin']}/metrics")).text()
        assert hits == []
        assert "warmserve_gateway_upstream_errors_total{" not in text

        # maxQueue above the replica cap: refused by the API server (the CRD's maximum) ...
        proc = kubectl(
            "apply", "-n", team_b, "-f", "-",
            input=json.dumps(_md("flood", "flood", maxQueue=100_000)), check=False,
        )  # fmt: skip
        assert proc.returncode != 0
        assert "spec.gateway.maxQueue" in proc.stderr and "10000" in proc.stderr
        ok = kubectl(
            "apply", "-n", team_b, "-f", "-",
            input=json.dumps(_md("most", "most", maxQueue=10_000)), check=False,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
    finally:
        if gw is not None:
            await gw.stop()
        if iid:
            await asyncio.to_thread(engines.end, iid)
        kubectl("delete", "gpunode", node, "--wait=false", check=False)
        for ns in (team_a, team_b):
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
