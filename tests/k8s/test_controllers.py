"""The optional controllers plane: kube-controller-manager, kube-scheduler and kwok fake nodes.

With these, what never progresses on a bare apiserver does: namespaces finish deleting, new
namespaces get a ``default`` ServiceAccount, and Deployments become Running Pods on kwok Nodes.
"""

from __future__ import annotations

import json
import time

from warmserve.testing.k8s import ControlPlane, fake_node


def _wait(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_namespace_deletion_completes_and_default_service_account_appears(
    k8s_controllers_plane: ControlPlane,
) -> None:
    kc = k8s_controllers_plane.kubectl
    ns = k8s_controllers_plane.create_namespace("ns-lifecycle")

    def has_default_sa() -> bool:
        return kc("get", "sa", "default", "-n", ns, check=False).returncode == 0

    _wait(has_default_sa, what="the default ServiceAccount")
    kc("create", "configmap", "c", "-n", ns)
    kc("delete", "namespace", ns, "--timeout=60s")  # returns once it is really gone
    gone = kc("get", "namespace", ns, "--ignore-not-found", "-o", "name").stdout
    assert gone == ""


def test_deployment_pods_run_on_a_kwok_node(k8s_controllers_plane: ControlPlane) -> None:
    kc = k8s_controllers_plane.kubectl
    ns = k8s_controllers_plane.create_namespace("kwok-deploy")
    node = f"{ns}-node"
    kc("apply", "-f", "-", input=fake_node(node, labels={"pool": ns}))
    try:
        kc("create", "deployment", "web", "-n", ns, "--image=example.invalid/web:1", "--replicas=2")
        kc(
            "patch", "deployment", "web", "-n", ns, "--type=merge",
            "-p", json.dumps({"spec": {"template": {"spec": {"nodeSelector": {"pool": ns}}}}}),
        )  # fmt: skip
        kc("rollout", "status", "deployment/web", "-n", ns, "--timeout=60s")
        pods = json.loads(kc("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
        assert len(pods) == 2
        assert {p["spec"]["nodeName"] for p in pods} == {node}
        assert {p["status"]["phase"] for p in pods} == {"Running"}
    finally:
        kc("delete", "node", node, "--wait=false")
        k8s_controllers_plane.delete_namespace(ns)
