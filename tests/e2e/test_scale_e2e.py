"""The ModelDeployment's scale subresource end to end: ``kubectl scale`` and a real HPA controller
set the floor of instances (``spec.minInstances``), the operator keeps it and reports the count.

On the controllers plane (kube-apiserver + etcd + kube-controller-manager, whose HPA controller
runs as in a cluster) with the operator under the chart's ServiceAccount token and one node
agent with four simulated GPUs:

1. before any scaling, ``kubectl get --subresource=scale`` reads 0/0 and the selector the
   operator writes (``warmserve.io/owner-uid=<uid>``, which selects no pod: instances are
   processes of the agents);
2. ``kubectl scale --replicas=2`` starts two instances (owned by the deployment's UID) and the
   scale subresource reads 2/2; the operator starts no more at zero load;
3. ``kubectl scale`` above ``maxInstances`` is refused by the CRD's CEL rule, nothing changes;
4. ``kubectl scale --replicas=0`` lets them go: drained through grace, then ended;
5. an ``autoscaling/v2`` HPA on an External metric (the gateway's held requests, served by a
   stand-in for Prometheus + its adapter, ``external_metrics.py``) raises the floor to 3 and the
   operator runs 3 instances; with the metric back at 0 the HPA lowers it to its minimum (1)
   and the operator drains to 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from e2e_support import (
    describe_agents,
    get_json,
    install_for_operator,
    instances_of,
    register_gpu_node,
    start_sim_agent,
    write_models,
)
from external_metrics import serve_external_metrics

from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import WINDOW_S as W

SCALE_DOWN_DELAY_S = 2.0
MAX_GRACE_S = 4.0
SETTLE_S = 40.0  # bound for the operator's convergences below
HPA_SYNC_S = 15.0  # kube-controller-manager's --horizontal-pod-autoscaler-sync-period default
HELD = "warmserve_gateway_held_requests"


def test_kubectl_scale_and_an_hpa_set_the_floor_the_operator_keeps(
    k8s_controllers_plane: Any, procs: Procs, tmp_path: Path
) -> None:
    from warmserve_operator.status import scale_selector

    plane = k8s_controllers_plane
    kubectl = plane.kubectl
    ns = plane.create_namespace("scale")
    t_start = time.monotonic()
    op_kubeconfig, env = install_for_operator(
        kubectl, plane.helm, plane.sa_kubeconfig, ns, f"sc{ns[-8:]}"
    )
    write_models(tmp_path / "models")
    node = f"{ns}-node-a"
    address = start_sim_agent(procs, tmp_path, node, env)
    register_gpu_node(kubectl, node, address)
    md = {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "chat", "namespace": ns},
        "spec": {"model": {"name": "tiny-chat"}, "maxBatchSize": 4, "maxInstances": 3},
    }
    kubectl("apply", "-f", "-", input=json.dumps(md))
    uid = get_json(kubectl, "wsmd", "chat", "-n", ns)["metadata"]["uid"]

    def logs() -> str:
        return procs.log("operator", 60) + "\n" + procs.log(node, 20)

    def scale() -> dict[str, Any]:
        out = get_json(kubectl, "wsmd", "chat", "-n", ns, "--subresource=scale")
        assert out["kind"] == "Scale", out
        return {
            "spec": out["spec"].get("replicas", 0),  # autoscaling/v1 omits a zero
            "status": out["status"].get("replicas", 0),
            "selector": out["status"].get("selector", ""),
        }

    def instances() -> list[Any]:
        return instances_of(describe_agents({node: address}), "tiny-chat")

    def serving(n: int) -> Any:
        """``n`` serving instances, none starting or in grace, reported as ``n`` in status."""
        insts = instances()
        status = get_json(kubectl, "wsmd", "chat", "-n", ns).get("status", {})
        return (
            insts
            if len(insts) == n
            and all(i.phase.value == "serving" for i in insts)
            and status.get("instanceCount") == n
            else None
        )

    procs.start(
        "operator",
        [
            sys.executable, "-m", "warmserve", "operator", "--window-seconds", str(W),
            "--poll-seconds", "0.5", "--standalone", "--metrics-port", "0",
            "--scale-down-delay", str(SCALE_DOWN_DELAY_S), "--max-grace", str(MAX_GRACE_S),
            "--namespace", ns,
        ],
        {**env, "KUBECONFIG": str(op_kubeconfig)},
    )  # fmt: skip
    try:
        # 1. Nothing asked yet: 0 wanted, 0 running, and the selector the operator writes.
        wait_for(lambda: scale()["selector"], "the operator writes status.selector", SETTLE_S, logs)
        assert scale() == {"spec": 0, "status": 0, "selector": scale_selector(uid)}
        assert scale_selector(uid) == f"warmserve.io/owner-uid={uid}"
        pods = kubectl("get", "pods", "-A", "-l", scale_selector(uid), "-o", "json").stdout
        assert json.loads(pods)["items"] == [], "a valid label selector that matches no pod"

        # 2. kubectl scale --replicas=2: the floor is 2, the operator starts 2 and keeps 2.
        kubectl("scale", "wsmd/chat", "-n", ns, "--replicas=2")
        assert get_json(kubectl, "wsmd", "chat", "-n", ns)["spec"]["minInstances"] == 2
        t0 = time.monotonic()
        two = wait_for(lambda: serving(2), "2 instances serving", SETTLE_S, logs)
        print(f"kubectl scale 0 -> 2: 2 instances serving after {time.monotonic() - t0:.1f}s")
        assert {i.owner for i in two} == {uid}, "the selector's UID owns the instances"
        assert scale() == {"spec": 2, "status": 2, "selector": scale_selector(uid)}
        time.sleep(2.0)  # a few polls: at zero load the floor is all the operator runs
        assert len(instances()) == 2

        # 3. Above maxInstances: refused by the CRD's CEL rule (not clamped), nothing changes.
        refused = kubectl("scale", "wsmd/chat", "-n", ns, "--replicas=4", check=False)
        assert refused.returncode != 0, refused.stdout
        assert "spec.minInstances must be <= spec.maxInstances" in refused.stderr, refused.stderr
        assert "scale subresource" in refused.stderr
        assert scale()["spec"] == 2

        # 4. kubectl scale --replicas=0: drained through grace (the policy's delay, then grace
        #    until idle or --max-grace), then ended: nothing runs.
        t0 = time.monotonic()
        kubectl("scale", "wsmd/chat", "-n", ns, "--replicas=0")
        wait_for(
            lambda: not instances(),
            "both instances ended",
            SCALE_DOWN_DELAY_S + MAX_GRACE_S + SETTLE_S,
            logs,
        )
        print(f"kubectl scale 2 -> 0: no instance after {time.monotonic() - t0:.1f}s")
        wait_for(lambda: scale()["status"] == 0, "status.instanceCount 0", SETTLE_S, logs)
        assert scale() == {"spec": 0, "status": 0, "selector": scale_selector(uid)}

        def drained() -> bool:
            reasons = {
                e["reason"]
                for e in get_json(kubectl, "events", "-n", ns)["items"]
                if e["involvedObject"]["name"] == "chat"
            }
            return {"Draining", "InstanceEnded"} <= reasons

        wait_for(drained, "Draining and InstanceEnded Events (through grace)", SETTLE_S, logs)

        # 5. An HPA on the gateway's held requests. Like KEDA's, it acts from 1 up (an HPA leaves
        #    a target at 0 alone; KEDA's own activation does 0 -> 1): first 1 by hand.
        kubectl("scale", "wsmd/chat", "-n", ns, "--replicas=1")
        wait_for(lambda: serving(1), "1 instance serving", SETTLE_S, logs)
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "warmserve.io/v1alpha1",
                    "kind": "ModelDeployment",
                    "name": "chat",
                },
                "minReplicas": 1,
                "maxReplicas": 3,  # <= spec.maxInstances, or its writes are refused
                "metrics": [
                    {
                        "type": "External",
                        "external": {
                            "metric": {
                                "name": HELD,
                                "selector": {"matchLabels": {"model": "tiny-chat"}},
                            },
                            "target": {"type": "AverageValue", "averageValue": "2"},
                        },
                    }
                ],
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}},
            },
        }
        with serve_external_metrics(plane.workdir / "pki", tmp_path / "metrics", kubectl, ns) as m:
            m.set(ns, HELD, {"model": "tiny-chat"}, 5.0)  # 5 held / 2 per instance -> 3
            t0 = time.monotonic()
            kubectl("apply", "-f", "-", input=json.dumps(hpa))
            wait_for(
                lambda: scale()["spec"] == 3,
                "the HPA raises spec.minInstances to 3",
                2 * HPA_SYNC_S + SETTLE_S,
                logs,
            )
            print(f"HPA 1 -> 3: written after {time.monotonic() - t0:.1f}s")
            wait_for(lambda: serving(3), "3 instances serving", SETTLE_S, logs)
            print(f"HPA 1 -> 3: 3 instances serving after {time.monotonic() - t0:.1f}s")
            status = get_json(kubectl, "hpa", "chat", "-n", ns)["status"]
            conds = {c["type"]: c for c in status["conditions"]}
            assert conds["AbleToScale"]["status"] == "True", conds
            assert conds["ScalingActive"]["reason"] == "ValidMetricFound", conds
            assert status["desiredReplicas"] == 3
            assert (ns, HELD, "model=tiny-chat") in m.reads, m.reads

            m.set(ns, HELD, {"model": "tiny-chat"}, 0.0)  # nothing held: down to minReplicas
            t0 = time.monotonic()
            wait_for(
                lambda: scale()["spec"] == 1,
                "the HPA lowers spec.minInstances to 1",
                2 * HPA_SYNC_S + SETTLE_S,
                logs,
            )
            wait_for(
                lambda: serving(1),
                "drained to 1 instance",
                SCALE_DOWN_DELAY_S + MAX_GRACE_S + SETTLE_S,
                logs,
            )
            print(f"HPA 3 -> 1: 1 instance left after {time.monotonic() - t0:.1f}s")
            assert scale() == {"spec": 1, "status": 1, "selector": scale_selector(uid)}
        print(f"scale e2e wall time: {time.monotonic() - t_start:.1f}s")
    finally:
        kubectl("delete", "hpa", "chat", "-n", ns, "--ignore-not-found", check=False)
        # while the operator runs: its finalizer drains what is left, the namespace can go
        kubectl("delete", "wsmd", "chat", "-n", ns, "--timeout=60s", check=False, timeout=90)
        kubectl("delete", "gpunode", node, "--ignore-not-found", "--wait=false", check=False)
        procs.stop_all()
        plane.delete_namespace(ns)
