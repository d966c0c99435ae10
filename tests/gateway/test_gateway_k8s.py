"""The gateway's Kubernetes parts on the real kube-apiserver (tests/k8s_support.py):

* the chart's gateway RBAC grants exactly what it uses (watch ModelDeployments and GPUNodes),
  nothing else;
* the ModelDeployment watch under that ServiceAccount's token: a held request goes out the moment
  the operator's status shows a serving instance, a deleted deployment fails its held requests;
* the operator finds gateway replicas through a Service's EndpointSlices under the chart's
  operator RBAC and sums what they hold.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from gw_support import REPO, Engines, gpunode
from warmserve_gateway.config import GatewayConfig
from warmserve_gateway.server import Gateway

from warmserve.testing.k8s import apply_chart_gateway_rbac, apply_chart_operator_rbac, host_ip

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def crds(kubectl: Any) -> None:
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/modeldeployments.warmserve.io", "crd/gpunodes.warmserve.io",
    )  # fmt: skip


def _can(kubectl: Any, who: str, verb: str, resource: str, ns: str | None) -> bool:
    scope = ["-A"] if ns is None else ["-n", ns]
    # "R/S" is subresource S of R (can-i reads "R/S" as the object named S)
    resource, _, sub = resource.partition("/")
    subresource = [f"--subresource={sub}"] if sub else []
    proc = kubectl(
        "auth", "can-i", verb, resource, *subresource, "--as", who, *scope, check=False
    )
    return proc.stdout.strip() == "yes"


def _wait_rbac(kubectl: Any, who: str, ns: str | None) -> None:
    """The authorizer sees new RBAC objects through an informer: wait until it does."""
    deadline = time.monotonic() + 15
    while not _can(kubectl, who, "watch", "modeldeployments.warmserve.io", ns):
        assert time.monotonic() < deadline, f"RBAC for {who} never took effect"
        time.sleep(0.2)


def test_gateway_rbac_is_least_privilege(
    crds: None, helm: Any, kubectl: Any, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    sa = apply_chart_gateway_rbac(helm, kubectl, ns, f"gw{ns[-8:]}")
    who = f"system:serviceaccount:{ns}:{sa}"
    _wait_rbac(kubectl, who, None)
    for verb in ("get", "list", "watch"):
        assert _can(kubectl, who, verb, "modeldeployments.warmserve.io", None), verb
    for verb, res, where in [
        ("patch", "modeldeployments.warmserve.io", None),
        ("patch", "modeldeployments.warmserve.io/status", None),
        ("get", "secrets", ns),  # API keys come from a mounted volume
        ("list", "pods", ns),
        ("list", "endpointslices.discovery.k8s.io", ns),
        ("create", "events", ns),
        ("patch", "gpunodes.warmserve.io", None),
        ("patch", "gpunodes.warmserve.io/status", None),
        ("*", "*", None),
    ]:
        assert not _can(kubectl, who, verb, res, where), (verb, res, where)
    # The agents' records (GPUNode status) an instance endpoint must match: read only.
    for verb in ("get", "list", "watch"):
        assert _can(kubectl, who, verb, "gpunodes.warmserve.io", None), verb
    # With operator.watchNamespaces the gateway may watch those namespaces only.
    other = f"{ns}-w"
    kubectl("create", "namespace", other)
    try:
        sa2 = apply_chart_gateway_rbac(
            helm, kubectl, ns, f"gx{ns[-8:]}", "--set-json",
            f"operator.watchNamespaces={json.dumps([other])}",
        )  # fmt: skip
        who2 = f"system:serviceaccount:{ns}:{sa2}"
        _wait_rbac(kubectl, who2, other)
        assert not _can(kubectl, who2, "watch", "modeldeployments.warmserve.io", None)
        assert not _can(kubectl, who2, "watch", "modeldeployments.warmserve.io", ns)
        assert _can(kubectl, who2, "watch", "gpunodes.warmserve.io", None)
    finally:
        kubectl("delete", "namespace", other, "--wait=false", check=False)


def _md(name: str, model: str) -> dict[str, Any]:
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": model}, "gateway": {"maxHoldSeconds": 30}},
    }


async def test_watch_under_chart_rbac_routes_held_requests_when_status_says_serving(
    crds: None,
    helm: Any,
    kubectl: Any,
    k8s_namespace: str,
    sa_kubeconfig: Any,
    engines: Engines,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = k8s_namespace
    sa = apply_chart_gateway_rbac(helm, kubectl, ns, f"gw{ns[-8:]}")
    monkeypatch.setenv("KUBECONFIG", str(sa_kubeconfig(ns, sa)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    from warmserve_gateway.discovery import KubeSource

    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_md("w", "tiny")))
    node = f"{ns}-node"
    kubectl("apply", "-f", "-", input=json.dumps(gpunode(node, engines.agent.address)))
    cfg = GatewayConfig(
        host="127.0.0.1", port=0, admin_host="127.0.0.1", admin_port=0, anonymous_namespaces=(ns,)
    )
    gw = Gateway(cfg, KubeSource((ns,)))
    await gw.start()
    iid = ""
    mine = frozenset({ns})
    try:
        deadline = time.monotonic() + 20
        while (
            not (gw.synced and gw.catalog.resolve(f"{ns}/w", mine)) and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        dep = gw.catalog.resolve(f"{ns}/w", mine)
        assert dep is not None and dep.serving == ()
        async with aiohttp.ClientSession() as s:

            async def one() -> int:
                body = {"model": f"{ns}/w", **CHAT}
                async with s.post(f"{gw.urls['api']}/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status

            held = [asyncio.create_task(one()) for _ in range(3)]
            await asyncio.sleep(0.5)
            assert gw.dispatcher.state("tiny").held == 3  # type: ignore[union-attr]
            iid, url = await asyncio.to_thread(engines.start, "tiny", 3)
            status = {"status": {"instances": [{"id": iid, "endpoint": url, "phase": "serving"}]}}
            t0 = time.monotonic()
            # What the operator writes from the agent's report: the GPUNode first, then the
            # deployment (the gateway routes only to an instance a GPUNode lists).
            rec = gpunode(node, engines.agent.address, [(iid, "tiny", url)])
            kubectl(
                "patch", "gpunode", node, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": rec["status"]}),
            )  # fmt: skip
            kubectl(
                "patch", "wsmd", "w", "-n", ns, "--subresource=status", "--type=merge",
                "-p", json.dumps(status),
            )  # fmt: skip
            codes = await asyncio.wait_for(asyncio.gather(*held), 20)
            assert codes == [200, 200, 200]
            assert time.monotonic() - t0 < 10  # the watch, not a slow re-list
            # Deleting the deployment fails the requests still held for it (404).
            kubectl("patch", "wsmd", "w", "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"instances": []}}))  # fmt: skip
            await asyncio.sleep(0.5)
            late = asyncio.create_task(one())
            await asyncio.sleep(0.5)
            kubectl("delete", "wsmd", "w", "-n", ns)
            assert await asyncio.wait_for(late, 20) == 404
    finally:
        await gw.stop()
        kubectl("delete", "gpunode", node, "--wait=false", check=False)
        if iid:
            await asyncio.to_thread(engines.end, iid)


async def test_operator_reads_gateway_replicas_from_endpointslices_under_chart_rbac(
    helm: Any,
    kubectl: Any,
    k8s_namespace: str,
    sa_kubeconfig: Any,
    make_gateway: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gw_support import md

    ns = k8s_namespace
    gws = [await make_gateway([md("c", "cold", [], max_hold_s=30)], admin_host="0.0.0.0")]
    gws.append(await make_gateway([md("c", "cold", [], max_hold_s=30)], admin_host="0.0.0.0"))
    ip = host_ip()
    for k, (gw, _) in enumerate(gws):  # what the EndpointSlice controller writes for the pods
        port = int(gw.urls["admin"].rsplit(":", 1)[1])
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"demand-{k}",
                "labels": {"kubernetes.io/service-name": "gw-demand"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "admin", "port": port, "protocol": "TCP"}],
            "endpoints": [
                {
                    "addresses": [ip],
                    "conditions": {"ready": k == 0},  # a not-ready replica still counts
                    "targetRef": {"kind": "Pod", "name": f"gw-{k}", "namespace": ns},
                }
            ],
        }
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(slice_))
    sa = apply_chart_operator_rbac(helm, kubectl, ns, f"op{ns[-8:]}")
    monkeypatch.setenv("KUBECONFIG", str(sa_kubeconfig(ns, sa)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    from warmserve_operator.gateway_demand import GatewaySources

    token = gws[0][0].config.demand_token_file
    demand = GatewaySources(service=(ns, "gw-demand"), token_file=str(token)).build()
    assert demand is not None
    async with aiohttp.ClientSession() as s:
        tasks = []
        for (gw, _), n in zip(gws, (2, 3), strict=True):
            for _ in range(n):
                body = {"model": "cold", **CHAT}
                tasks.append(
                    asyncio.create_task(s.post(f"{gw.urls['api']}/v1/chat/completions", json=body))
                )
        await asyncio.sleep(0.5)
        got = await demand.poll()
        assert got.held == {"cold": 5} and got.replicas == 2 and not got.failed
        for t in tasks:
            t.cancel()
    await demand.close()
