"""The CRDs and the chart's RBAC on a real kube-apiserver.

* Invalid ModelDeployments are refused by the API server itself (OpenAPI ranges, enums,
  patterns, CEL rules) with a message naming the field; defaults are filled in.
* The chart's ClusterRole/Role grant exactly the calls the operator makes (a table checked with
  ``kubectl auth can-i`` as the operator's ServiceAccount), and agent discovery works under it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from warmserve.testing.k8s import apply_chart_operator_rbac

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def crds(kubectl: Any) -> None:
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/modeldeployments.warmserve.io",
        "crd/gpunodes.warmserve.io",
    )


def md(name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "tiny-chat"}, **spec}
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": body,
    }


BAD = [
    (md("tp0", tensorParallel=0), "spec.tensorParallel"),
    (md("tp-big", tensorParallel=65), "spec.tensorParallel"),
    (md("batch0", maxBatchSize=0), "spec.maxBatchSize"),
    (
        md("minmax", minInstances=5, maxInstances=2),
        "spec.minInstances must be <= spec.maxInstances",
    ),
    (md("neg", minInstances=-1), "spec.minInstances"),
    (md("ttft", ttftObjectiveSeconds=0), "spec.ttftObjectiveSeconds"),
    (
        md("layers", model={"name": "m", "numLayers": 4}, prewarm={"layers": 10}),
        "spec.prewarm.layers must be <= spec.model.numLayers",
    ),
    (
        md("layers-word", prewarm={"layers": "most"}),
        'spec.prewarm.layers must be an integer in [1, 1024] or "auto"',
    ),
    (md("layers-zero", prewarm={"layers": 0}), "spec.prewarm.layers must be an integer"),
    (md("layers-big", prewarm={"layers": 1025}), "spec.prewarm.layers must be an integer"),
    (md("layers-digits", prewarm={"layers": "12"}), "spec.prewarm.layers must be an integer"),
    (md("badname", model={"name": "Bad Name!"}), "spec.model.name"),
    (md("args", engine={"args": [1, 2]}), "spec.engine.args"),
    (md("prewarm-type", prewarm={"enabled": "yes"}), "spec.prewarm.enabled"),
    (md("queue-neg", gateway={"maxQueue": -1}), "spec.gateway.maxQueue"),
    (md("hold-zero", gateway={"maxHoldSeconds": 0}), "spec.gateway.maxHoldSeconds"),
    (
        {
            "apiVersion": "warmserve.io/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "nomodel"},
            "spec": {"tensorParallel": 1},
        },
        "spec.model",
    ),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[b["metadata"]["name"] for b, _ in BAD])
def test_api_server_refuses_invalid_model_deployments(
    crds: None, kubectl: Any, k8s_namespace: str, body: dict[str, Any], field: str
) -> None:
    proc = kubectl("create", "-n", k8s_namespace, "-f", "-", input=json.dumps(body), check=False)
    assert proc.returncode != 0, f"{body['metadata']['name']} was accepted"
    assert field in proc.stderr, proc.stderr
    assert "is invalid" in proc.stderr


def test_defaults_and_printer_columns(crds: None, kubectl: Any, k8s_namespace: str) -> None:
    kubectl("apply", "-n", k8s_namespace, "-f", str(REPO / "examples/modeldeployment-chat.yaml"))
    kubectl("create", "-n", k8s_namespace, "-f", "-", input=json.dumps(md("minimal")))
    got = json.loads(kubectl("get", "wsmd", "minimal", "-n", k8s_namespace, "-o", "json").stdout)
    spec = got["spec"]
    assert spec["tensorParallel"] == 1 and spec["maxBatchSize"] == 32
    assert spec["minInstances"] == 0 and spec["maxInstances"] == 8
    assert spec["prewarm"] == {"enabled": True, "layers": "auto"}
    assert spec["ttftObjectiveSeconds"] == 1.0
    assert spec["gateway"] == {"maxQueue": 100, "maxHoldSeconds": 120}
    header = kubectl("get", "warmserve", "-n", k8s_namespace).stdout.splitlines()[0].split()
    assert header == [
        "NAME",
        "MODEL",
        "TP",
        "INSTANCES",
        "PREWARMED",
        "PRED-PEAK",
        "LOAD",
        "READY",
        "AGE",
    ]
    # No namespace controller here: delete what this test made so no operator sees it later.
    kubectl("delete", "wsmd", "--all", "-n", k8s_namespace, "--wait=false")


def test_prewarm_layers_takes_auto_or_an_integer(
    crds: None, kubectl: Any, k8s_namespace: str
) -> None:
    for name, layers in (("auto", "auto"), ("two", 2), ("all", 4)):
        body = md(
            f"layers-{name}", model={"name": "m", "numLayers": 4}, prewarm={"layers": layers}
        )
        doc = json.dumps(body)
        kubectl("create", "--dry-run=server", "-n", k8s_namespace, "-f", "-", input=doc)


def test_every_example_is_accepted(crds: None, kubectl: Any, k8s_namespace: str) -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        kubectl("apply", "--dry-run=server", "-n", k8s_namespace, "-f", str(path))


def test_gpunode_address_is_validated(crds: None, kubectl: Any) -> None:
    bad = {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "GPUNode",
        "metadata": {"name": "bad-node"},
        "spec": {"agentAddress": "no port here"},
    }
    proc = kubectl("create", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0 and "spec.agentAddress" in proc.stderr


def _chart_rbac(helm: Any, kubectl: Any, ns: str) -> str:
    return apply_chart_operator_rbac(helm, kubectl, ns, f"rbac{ns[-8:]}")


# Every call the operator makes (kopf + window loop + discovery), and what must stay forbidden.
ALLOWED = [
    ("list", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("watch", "namespaces", None),
    ("patch", "clusterkopfpeerings.kopf.dev", None),
    ("create", "clusterkopfpeerings.kopf.dev", None),
    ("watch", "modeldeployments.warmserve.io", None),
    ("patch", "modeldeployments.warmserve.io", "other"),
    ("patch", "modeldeployments.warmserve.io/status", "other"),
    ("list", "gpunodes.warmserve.io", None),
    ("create", "gpunodes.warmserve.io", None),
    ("patch", "gpunodes.warmserve.io/status", None),
    ("get", "configmaps", "self"),
    ("list", "configmaps", "self"),
    ("create", "configmaps", "self"),
    ("update", "configmaps", "self"),
    ("delete", "configmaps", "self"),
    ("create", "events", "other"),
    ("create", "events.events.k8s.io", "other"),
    ("list", "pods", "self"),
    ("get", "leases.coordination.k8s.io", "self"),
    ("create", "leases.coordination.k8s.io", "self"),
    ("update", "leases.coordination.k8s.io", "self"),
    ("list", "endpointslices.discovery.k8s.io", "self"),  # gateway replicas (held demand)
]
FORBIDDEN = [
    # Issue 16 H3: no ConfigMap outside the operator's namespace (e.g. kube-system/aws-auth).
    ("get", "configmaps", "other"),
    ("create", "configmaps", "other"),
    ("update", "configmaps", "other"),
    ("patch", "configmaps", "other"),
    ("delete", "configmaps", "other"),
    ("update", "configmaps", "kube-system"),
    ("delete", "configmaps", "kube-system"),
    ("list", "configmaps", None),
    ("update", "leases.coordination.k8s.io", "kube-system"),
    ("list", "secrets", "other"),
    ("delete", "modeldeployments.warmserve.io", "other"),
    ("update", "modeldeployments.warmserve.io/scale", "other"),  # the floor is not the operator's
    ("patch", "modeldeployments.warmserve.io/scale", "other"),
    ("list", "pods", "other"),
    ("list", "endpointslices.discovery.k8s.io", "other"),
    ("create", "pods", "self"),
    ("delete", "gpunodes.warmserve.io", None),
    ("*", "*", None),
]


def test_chart_rbac_grants_exactly_what_the_operator_uses(
    crds: None, kubectl: Any, helm: Any, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    sa = _chart_rbac(helm, kubectl, ns)
    who = f"system:serviceaccount:{ns}:{sa}"

    def can(verb: str, resource: str, where: str | None) -> bool:
        named = {"self": ns, "other": "default"}
        scope = ["-A"] if where is None else ["-n", named.get(where, where)]
        # "R/S" is subresource S of R (can-i reads "R/S" as the object named S)
        resource, _, sub = resource.partition("/")
        subresource = [f"--subresource={sub}"] if sub else []
        proc = kubectl(
            "auth", "can-i", verb, resource, *subresource, "--as", who, *scope, check=False
        )
        return proc.stdout.strip() == "yes"

    missing = [r for r in ALLOWED if not can(*r)]
    extra = [r for r in FORBIDDEN if can(*r)]
    assert not missing, f"the chart's RBAC lacks {missing}"
    assert not extra, f"the chart's RBAC grants more than needed: {extra}"


def test_agent_pods_are_discovered_as_gpunodes_under_chart_rbac(
    crds: None,
    kubectl: Any,
    helm: Any,
    k8s_namespace: str,
    sa_kubeconfig: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = k8s_namespace
    sa = _chart_rbac(helm, kubectl, ns)
    node = f"{ns}-gpu"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "agent-x",
            "labels": {
                "app.kubernetes.io/part-of": "warmserve",
                "app.kubernetes.io/component": "agent",
            },
        },
        "spec": {"nodeName": node, "containers": [{"name": "a", "image": "x"}]},
    }
    kubectl("create", "-n", ns, "-f", "-", input=json.dumps(pod))
    kubectl(
        "patch",
        "pod",
        "agent-x",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"phase": "Running", "podIP": "10.1.2.3"}}),
    )
    monkeypatch.setenv("KUBECONFIG", str(sa_kubeconfig(ns, sa)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    from warmserve_operator.kube import AgentDiscovery, KubeApi

    api = KubeApi(peering=None, identity="t", priority=1, discovery=AgentDiscovery(ns, port=7000))
    try:
        asyncio.run(api.sync_agent_nodes())
        got = json.loads(kubectl("get", "gpunode", node, "-o", "json").stdout)
        assert got["spec"]["agentAddress"] == "10.1.2.3:7000"
        kubectl(
            "patch",
            "pod",
            "agent-x",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"podIP": "10.1.2.4"}}),
        )
        asyncio.run(api.sync_agent_nodes())
        got = json.loads(kubectl("get", "gpunode", node, "-o", "json").stdout)
        assert got["spec"]["agentAddress"] == "10.1.2.4:7000", "a moved agent is followed"
    finally:
        kubectl("delete", "gpunode", node, "--ignore-not-found", "--wait=false", check=False)


def test_history_lives_in_the_operators_namespace_and_writes_elsewhere_are_refused(
    crds: None,
    kubectl: Any,
    helm: Any,
    k8s_namespace: str,
    sa_kubeconfig: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 16 H3, on the real apiserver as the chart's ServiceAccount."""
    ns = k8s_namespace
    sa = _chart_rbac(helm, kubectl, ns)
    who = f"system:serviceaccount:{ns}:{sa}"
    victim = json.dumps(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"aws-auth-{ns[-8:]}", "namespace": "kube-system"},
            "data": {"mapRoles": "[]"},
        }
    )
    kubectl("apply", "-f", "-", input=victim)
    try:
        for verb in (("apply", "-f", "-"), ("delete", "-f", "-")):
            proc = kubectl(*verb, "--as", who, input=victim, check=False)
            assert proc.returncode != 0 and "forbidden" in proc.stderr.lower(), proc
        for where in ("kube-system", "default"):
            proc = kubectl(
                "auth", "can-i", "update", "configmaps", "-n", where, "--as", who, check=False
            )
            assert proc.stdout.strip() == "no", where
        monkeypatch.setenv("KUBECONFIG", str(sa_kubeconfig(ns, sa)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.delenv("POD_NAMESPACE", raising=False)
        from warmserve_operator.kube import KubeApi

        api = KubeApi(peering=None, identity="t", priority=1)
        assert api.history_namespace == ns, "the SA kubeconfig's namespace is the operator's"

        async def round_trip() -> None:
            await api.write_history("uid-1", {"format": "x"}, "demo/code")
            await api.write_history("uid-1", {"format": "y"}, "demo/code")
            assert await api.read_histories(["uid-1", "uid-x"]) == {"uid-1": {"format": "y"}}
            assert await api.list_history_uids() == ["uid-1"]
            await api.delete_history("uid-1")
            assert await api.read_histories(["uid-1"]) == {}
            foreign = KubeApi(peering=None, identity="t", priority=1, history_namespace="default")
            from kubernetes.client import ApiException

            with pytest.raises(ApiException) as info:
                await foreign.write_history("uid-2", {"format": "x"}, "demo/code")
            assert info.value.status == 403

        asyncio.run(round_trip())
    finally:
        kubectl("delete", "-f", "-", input=victim, check=False)


def test_the_lease_is_renewed_on_its_own_and_a_stalled_leader_fences(k8s_namespace: str) -> None:
    """Two replicas on the real API server: the leader keeps the Lease through a long stretch
    without polls (renewal is its own task); when its renewals stall it stops acting (leader-only
    writes refused) within the renew deadline, and only after that does the other take over."""
    from warmserve_operator.kube import KubeApi
    from warmserve_operator.leader import ElectionTiming, NotLeader

    timing = ElectionTiming(4, 3, 0.5)
    ns = k8s_namespace

    def replica(name: str) -> KubeApi:
        return KubeApi(
            peering="fence", identity=name, priority=1, history_namespace=ns, election=timing
        )

    async def until(pred: Any, within: float) -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while not pred():
            assert loop.time() - t0 < within
            await asyncio.sleep(0.02)
        return loop.time() - t0

    async def scenario() -> None:
        a, b = replica("a"), replica("b")
        assert a.elector is not None and b.elector is not None
        stop = asyncio.Event()
        ta = asyncio.create_task(a.run_election(stop))
        await until(a.leading, 10)
        tb = asyncio.create_task(b.run_election(stop))
        await asyncio.sleep(timing.lease_s + 1)  # longer than the Lease, no poll at all
        assert a.leading() and not b.leading()
        await a.write_history("uid-f", {"format": "x"}, "demo/m")

        async def stalled() -> bool:
            await asyncio.sleep(3600)
            return True

        a.elector.round = stalled  # its API calls hang from now on
        fenced = await until(lambda: not a.leading(), timing.renew_deadline_s + 1)
        with pytest.raises(NotLeader):
            await a.write_history("uid-f", {"format": "y"}, "demo/m")
        assert not b.leading(), "the other waits for the Lease to expire"
        took = await until(b.leading, timing.lease_s + 2 * timing.retry_s + 2)
        assert not a.leading()
        # Fencing tokens: (creationTimestamp, leaseTransitions) of the Lease; the next term +1.
        from kubernetes import client
        from warmserve_operator.lease import fencing_token

        lease = client.CoordinationV1Api().read_namespaced_lease("fence-loop", ns)
        created = int(lease.metadata.creation_timestamp.timestamp())
        assert b.elector.token() == fencing_token(created, lease.spec.lease_transitions)
        assert b.elector.token() == a.elector.token() + 1 and created > 0
        print(f"leader fenced after {fenced:.2f} s; the other took over {took:.2f} s later")
        stop.set()
        await asyncio.gather(ta, tb)
        assert not a.leading() and not b.leading()

    asyncio.run(scenario())


def test_a_cleanly_stopped_leader_hands_the_lease_over_at_once(k8s_namespace: str) -> None:
    """Real API server: a leader that stops cleanly (a rolling update) empties the Lease, so the
    standby takes over on its next round, well before the Lease would have expired; a replica
    that never held it leaves the Lease alone."""
    from kubernetes import client
    from warmserve_operator.kube import KubeApi
    from warmserve_operator.leader import ElectionTiming

    timing = ElectionTiming(6, 4, 0.3)
    ns = k8s_namespace

    def replica(name: str) -> KubeApi:
        return KubeApi(
            peering="handover", identity=name, priority=1, history_namespace=ns, election=timing
        )

    def holder() -> str:
        lease = client.CoordinationV1Api().read_namespaced_lease("handover-loop", ns)
        return lease.spec.holder_identity or ""

    async def scenario() -> float:
        a, b = replica("a"), replica("b")
        stop_a, stop_b, stop_c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        ta = asyncio.create_task(a.run_election(stop_a))
        for _ in range(500):
            if a.leading():
                break
            await asyncio.sleep(0.02)
        assert a.leading()
        tb = asyncio.create_task(b.run_election(stop_b))
        c = replica("c")  # stops without ever holding it: writes nothing
        tc = asyncio.create_task(c.run_election(stop_c))
        await asyncio.sleep(2 * timing.retry_s)
        stop_c.set()
        await tc
        assert holder() == "a" and not b.leading()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stop_a.set()
        await ta
        assert not a.leading()
        while not b.leading():
            assert loop.time() - t0 < timing.lease_s, "the standby waited for expiry"
            await asyncio.sleep(0.02)
        took = loop.time() - t0
        assert holder() == "b"
        assert b.elector is not None and a.elector is not None
        assert b.elector.token() == a.elector.token() + 1, "a hand-over starts a new term"
        stop_b.set()
        await tb
        return took

    took = asyncio.run(scenario())
    print(f"standby leads {took:.2f} s after the leader's clean stop (Lease {timing.lease_s} s)")
    assert took < timing.lease_s / 2
