"""kopf runs unmodified against the test control plane, as a ServiceAccount with minimal RBAC.

A reference for operator tests: the RBAC kopf itself needs (CRD + namespace list/watch, patch on
the status subresource, events) and what a missing rule looks like.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from warmserve.testing.k8s import ControlPlane

HANDLERS = textwrap.dedent(
    """
    import kopf

    @kopf.on.startup()
    def configure(settings, **_):
        settings.posting.level = 20  # INFO events
        settings.watching.server_timeout = 10

    @kopf.on.create("{group}", "v1", "gadgets")
    def created(spec, **_):
        return {{"doubled": spec["size"] * 2}}
    """
)


def _crd(group: str) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"gadgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": "Gadget", "plural": "gadgets", "singular": "gadget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def _rbac(group: str, namespace: str, sa: str, *, status_patch: bool) -> list[dict]:
    rules = [
        # kopf's scanning: which resources exist, which namespaces.
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": [group], "resources": ["gadgets"], "verbs": ["list", "watch", "patch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    ]
    if status_patch:
        rules.append({"apiGroups": [group], "resources": ["gadgets/status"], "verbs": ["patch"]})
    name = f"{namespace}-{sa}"
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
        },
    ]


def _run_kopf_until(
    plane: ControlPlane,
    kubeconfig: Path,
    handlers: Path,
    done: Callable[[], bool],
    timeout_s: float = 60.0,
) -> tuple[bool, str]:
    """Run `kopf run` as a subprocess until ``done()`` or the timeout; return (done, log)."""
    log = handlers.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "-A", "--standalone", str(handlers)],
            env=plane.env(kubeconfig),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout_s
            ok = False
            while time.monotonic() < deadline and proc.poll() is None:
                if done():
                    ok = True
                    break
                time.sleep(0.3)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return ok, log.read_text()


def test_kopf_handles_a_resource_as_a_service_account(
    k8s_control_plane: ControlPlane, k8s_namespace: str, sa_kubeconfig, tmp_path: Path
) -> None:
    kc = k8s_control_plane.kubectl
    group = f"{k8s_namespace}.kopf.test.warmserve.io"
    kc("apply", "-f", "-", input=json.dumps(_crd(group)))
    kc("wait", "--for=condition=Established", f"crd/gadgets.{group}", "--timeout=60s")
    kc("create", "serviceaccount", "op", "-n", k8s_namespace)
    rbac = {
        "apiVersion": "v1",
        "kind": "List",
        "items": _rbac(group, k8s_namespace, "op", status_patch=True),
    }
    kc("apply", "-f", "-", input=json.dumps(rbac))
    gadget = {
        "apiVersion": f"{group}/v1",
        "kind": "Gadget",
        "metadata": {"name": "g1", "namespace": k8s_namespace},
        "spec": {"size": 21},
    }
    kc("apply", "-f", "-", input=json.dumps(gadget))
    handlers = tmp_path / "handlers.py"
    handlers.write_text(HANDLERS.format(group=group))

    def status() -> dict:
        out = kc("get", f"gadgets.{group}", "g1", "-n", k8s_namespace, "-o", "json").stdout
        return json.loads(out).get("status", {})

    ok, log = _run_kopf_until(
        k8s_control_plane,
        sa_kubeconfig(k8s_namespace, "op"),
        handlers,
        lambda: status().get("created") == {"doubled": 42},
    )
    assert ok, f"kopf did not write the handler result into status; kopf log:\n{log[-3000:]}"
    assert "Forbidden" not in log and "forbidden" not in log, log[-3000:]


def test_kopf_without_status_rbac_is_refused(
    k8s_control_plane: ControlPlane, k8s_namespace: str, sa_kubeconfig, tmp_path: Path
) -> None:
    # The same operator minus `patch gadgets/status`: the API server refuses kopf's status
    # patch, which is how a missing rule in the chart's RBAC shows up in a test.
    kc = k8s_control_plane.kubectl
    group = f"{k8s_namespace}.kopf.test.warmserve.io"
    kc("apply", "-f", "-", input=json.dumps(_crd(group)))
    kc("wait", "--for=condition=Established", f"crd/gadgets.{group}", "--timeout=60s")
    kc("create", "serviceaccount", "op", "-n", k8s_namespace)
    items = _rbac(group, k8s_namespace, "op", status_patch=False)
    kc("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    gadget = {
        "apiVersion": f"{group}/v1",
        "kind": "Gadget",
        "metadata": {"name": "g1", "namespace": k8s_namespace},
        "spec": {"size": 21},
    }
    kc("apply", "-f", "-", input=json.dumps(gadget))
    handlers = tmp_path / "handlers.py"
    handlers.write_text(HANDLERS.format(group=group))
    log_path = handlers.with_suffix(".log")

    def refused() -> bool:
        return log_path.exists() and "gadgets/status" in log_path.read_text()

    ok, log = _run_kopf_until(
        k8s_control_plane, sa_kubeconfig(k8s_namespace, "op"), handlers, refused
    )
    assert ok, f"expected a refused status patch; kopf log:\n{log[-3000:]}"
    assert "forbidden" in log.lower()
