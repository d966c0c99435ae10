"""Deleting ModelDeployments on a real kube-apiserver with a real agent: ownership by UID,
removal drains.

The operator runs as a process under the chart's ServiceAccount token and serves two
namespaces; one agent process with simulated GPUs stands in for a GPU node.

* Ownership: ``bad/b16`` names the same model as ``demo/code`` (a ``DuplicateModel``); deleting it
  finishes and touches nothing of ``demo/code``: same instance, its slots kept, none for the
  duplicate.
* Removal drains: deleting ``demo/code`` while its instance serves requests finishes within
  the grace period + 30 s: the teardown drains the instance through grace (the agent refuses
  to end a serving instance) and leaves nothing of it on the agent.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.e2e.e2e_support import (
    REPO,
    Load,
    describe_agents,
    get_json,
    register_gpu_node,
    write_models,
)
from warmserve.testing.k8s import apply_chart_operator_rbac
from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import WINDOW_S as W

MAX_GRACE_S = 8.0


def _md(name: str, ns: str, model: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"model": {"name": model}, **spec},
    }


def test_delete_drains_through_grace_and_a_duplicate_owns_nothing(
    k8s_control_plane: Any,
    k8s_namespace: str,
    kubectl: Any,
    helm: Any,
    sa_kubeconfig: Any,
    procs: Procs,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace  # the operator's namespace and the owner's ("demo")
    bad = k8s_control_plane.create_namespace("bad")
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/modeldeployments.warmserve.io",
        "crd/gpunodes.warmserve.io",
    )
    sa = apply_chart_operator_rbac(helm, kubectl, ns, f"td{ns[-8:]}")
    op_kubeconfig = sa_kubeconfig(ns, sa)
    models = tmp_path / "models"
    write_models(models)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE")}
    addr_file = tmp_path / "node.addr"
    procs.start(
        "agent",
        [
            sys.executable,
            str(REPO / "tests/e2e/agent_proc.py"),
            "--models",
            str(models),
            "--gpus",
            "4x64MiB",
            "--node",
            "node-a",
            "--address-file",
            str(addr_file),
            "--memory-dir",
            str(tmp_path / "mem"),
        ],
        env,
    )
    address = wait_for(
        lambda: addr_file.exists() and addr_file.read_text(), "agent up", 60, procs.log
    )
    node = f"{ns}-node-a"
    register_gpu_node(kubectl, node, address)

    def logs() -> str:
        return procs.log("operator", 60) + "\n" + procs.log("agent", 20)

    try:
        kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(_md("code", ns, "tiny-code", maxBatchSize=4, minInstances=1)),
        )
        time.sleep(1.1)  # creationTimestamp has 1 s resolution: b16 is the younger one
        kubectl("apply", "-f", "-", input=json.dumps(_md("b16", bad, "tiny-code")))
        procs.start(
            "operator",
            [
                sys.executable,
                "-m",
                "warmserve",
                "operator",
                "--window-seconds",
                str(W),
                "--poll-seconds",
                "0.5",
                "--standalone",
                "--metrics-port",
                "0",
                "--scale-down-delay",
                "600",
                "--max-grace",
                str(MAX_GRACE_S),
                "--namespace",
                ns,
                "--namespace",
                bad,
            ],
            {**env, "KUBECONFIG": str(op_kubeconfig)},
        )
        code_uid = get_json(kubectl, "wsmd", "code", "-n", ns)["metadata"]["uid"]

        def serving() -> Any:
            snaps = describe_agents({node: address})
            insts = [i for i in snaps[node].instances if i.phase.value == "serving"]
            dup = get_json(kubectl, "wsmd", "b16", "-n", bad).get("status", {})
            reasons = {c["reason"] for c in dup.get("conditions", [])}
            return insts[0] if len(insts) == 1 and "DuplicateModel" in reasons else None

        inst = wait_for(serving, "code serving and b16 reported DuplicateModel", 60, logs)
        assert inst.owner == code_uid, "the agent records the owning deployment's UID"
        before = describe_agents({node: address})[node]
        assert all(s.owner == code_uid for s in before.slots), before.slots

        # Ownership: deleting the duplicate in another namespace touches nothing of the owner.
        dup_uid = get_json(kubectl, "wsmd", "b16", "-n", bad)["metadata"]["uid"]
        kubectl("delete", "wsmd", "b16", "-n", bad, "--wait=false")
        wait_for(
            lambda: kubectl("get", "wsmd", "b16", "-n", bad, check=False).returncode != 0,
            "b16 deleted",
            30,
            logs,
        )
        time.sleep(2.0)  # a few polls after the delete
        after = describe_agents({node: address})[node]
        assert [(i.instance_id, i.phase) for i in after.instances] == [
            (inst.instance_id, inst.phase)
        ], "the owner's instance still serves"
        # The owner's planner may place a prewarm replica meanwhile (a new slot, its owner's);
        # what the delete must not do is end, take over or add a slot for the duplicate.
        kept = {s.slot_id: s.owner for s in after.slots}
        assert all(kept.get(s.slot_id) == code_uid for s in before.slots), (
            before.slots,
            after.slots,
        )
        assert all(s.owner == code_uid for s in after.slots), (dup_uid, after.slots)

        # Removal drains: delete the owner while its instance serves requests: drained, then gone.
        Load(inst.endpoint, "tiny-code", 2, max_tokens=4000)  # ~200 s of decoding each
        wait_for(
            lambda: describe_agents({node: address})[node].instances[0].running >= 2,
            "requests in flight",
            30,
            logs,
        )
        t0 = time.monotonic()
        kubectl("delete", "wsmd", "code", "-n", ns, "--wait=false")
        wait_for(
            lambda: kubectl("get", "wsmd", "code", "-n", ns, check=False).returncode != 0,
            "code deleted (finalizer done)",
            MAX_GRACE_S + 30,
            logs,
        )
        took = time.monotonic() - t0
        left = describe_agents({node: address})[node]
        assert not left.instances and not [s for s in left.slots if s.model == "tiny-code"]
        assert took >= MAX_GRACE_S - 1, f"requests in flight: it waited out the grace ({took})"
        print(f"deleted a serving deployment in {took:.1f}s (max grace {MAX_GRACE_S}s)")
        op_log = (tmp_path / "operator.log").read_text()
        assert "FAILED_PRECONDITION" not in op_log, "no call the agent refuses"
    finally:
        kubectl("delete", "gpunode", node, "--ignore-not-found", "--wait=false", check=False)
        k8s_control_plane.delete_namespace(bad)
