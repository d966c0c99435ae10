"""The ModelDeployment's scale subresource: ``.spec.minInstances`` (what ``kubectl scale``, an
HPA or KEDA sets), ``.status.instanceCount`` and ``.status.selector`` (what the operator writes).

* On a real kube-apiserver: the CRD serves ``/scale`` with those paths, refuses a scale above
  ``maxInstances`` by its CEL rule with a message that says why, and ``-o wide`` shows the bounds.
* On the operator's loop with in-memory agents and API: the floor is kept and both status
  fields are written, also for a deployment the operator does not serve.

``tests/e2e/test_scale_e2e.py`` runs it all together: the operator, an agent, ``kubectl scale``
and kube-controller-manager's HPA controller.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from warmserve_operator.status import SELECTOR_KEY, scale_selector

from tests.operator.test_reconciler import Harness

REPO = Path(__file__).resolve().parents[2]

# Kubernetes label syntax (apimachinery validation): a qualified key, a value of at most 63.
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


@given(st.uuids())
def test_the_selector_is_one_valid_equality_term_for_any_uid(u: uuid.UUID) -> None:
    key, value = scale_selector(str(u)).split("=")
    prefix, name = SELECTOR_KEY.split("/")
    assert key == SELECTOR_KEY and re.fullmatch(_PREFIX, prefix) and len(prefix) <= 253
    assert re.fullmatch(_NAME, name)
    assert re.fullmatch(_NAME, value) and value == str(u)


async def test_the_floor_is_kept_and_reported_with_the_selector() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4, minInstances=2)
    await h.tick(4)
    assert len(h.instances("llama-a")) == 2, "the floor runs at zero load"
    st_a = h.status("a")
    assert st_a["instanceCount"] == 2
    assert st_a["selector"] == scale_selector("uid-a") == f"{SELECTOR_KEY}=uid-a"
    owners = {i.owner for a in h.agents.values() for i in a.instances.values()}
    assert owners == {"uid-a"}, "the selector names the owner the agents record"

    # What `kubectl scale --replicas=0` (or an HPA) writes: only spec.minInstances changes.
    body = h.kube.mds[("default", "a")]
    body["spec"]["minInstances"] = 0
    body["metadata"]["generation"] += 1
    await h.tick(20)  # scale-down delay 1 s, then grace until idle
    assert h.instances("llama-a") == []
    assert h.status("a")["instanceCount"] == 0
    assert h.status("a")["selector"] == scale_selector("uid-a")


async def test_a_deployment_the_operator_does_not_serve_still_reports_its_selector() -> None:
    """A duplicate owns nothing; its scale subresource reads 0 with a selector, so an HPA
    aimed at it reports the metric rather than a missing selector."""
    h = Harness()
    h.kube.add_md("a", "llama-a", created="2026-01-01T00:00:00Z")
    h.kube.add_md("a2", "llama-a", created="2026-01-02T00:00:00Z")
    await h.tick()
    assert h.cond("a2", "Degraded")["reason"] == "DuplicateModel"
    assert h.status("a2")["selector"] == scale_selector("uid-a2")
    assert h.status("a2").get("instanceCount", 0) == 0


def test_the_api_server_serves_the_scale_subresource(kubectl: Any, k8s_namespace: str) -> None:
    ns = k8s_namespace
    kubectl("apply", "-f", str(REPO / "crds" / "warmserve.io_modeldeployments.yaml"))
    kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/modeldeployments.warmserve.io"
    )
    body = {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "s", "namespace": ns},
        "spec": {"model": {"name": "tiny-chat"}, "maxInstances": 3},
    }
    kubectl("create", "-f", "-", input=json.dumps(body))

    def scale() -> dict[str, Any]:
        return json.loads(
            kubectl("get", "wsmd/s", "-n", ns, "--subresource=scale", "-o", "json").stdout
        )

    kubectl("scale", "wsmd/s", "-n", ns, "--replicas=2")
    got = json.loads(kubectl("get", "wsmd/s", "-n", ns, "-o", "json").stdout)
    assert got["spec"]["minInstances"] == 2 and got["spec"]["maxInstances"] == 3
    assert scale()["spec"] == {"replicas": 2}
    # What the operator writes (here as admin): the scale subresource reads it back.
    uid = got["metadata"]["uid"]
    status = {"status": {"instanceCount": 1, "selector": scale_selector(uid)}}
    kubectl("patch", "wsmd/s", "-n", ns, "--subresource=status", "--type=merge",
            "-p", json.dumps(status))  # fmt: skip
    assert scale()["status"] == {"replicas": 1, "selector": f"{SELECTOR_KEY}={uid}"}

    # Above maxInstances: refused (not clamped), with the reason, and nothing changes.
    refused = kubectl("scale", "wsmd/s", "-n", ns, "--replicas=4", check=False)
    assert refused.returncode != 0
    assert "spec.minInstances must be <= spec.maxInstances" in refused.stderr, refused.stderr
    assert "scale subresource" in refused.stderr
    assert scale()["spec"] == {"replicas": 2}
    kubectl("scale", "wsmd/s", "-n", ns, "--replicas=0")
    assert scale()["spec"] == {}  # autoscaling/v1 omits a zero

    wide = kubectl("get", "wsmd", "-n", ns, "-o", "wide").stdout.splitlines()
    header = wide[0].split()
    assert header[3:6] == ["INSTANCES", "MIN", "MAX"], header
    assert wide[1].split()[3:6] == ["1", "0", "3"], wide
    kubectl("delete", "wsmd", "--all", "-n", ns, "--wait=false")
