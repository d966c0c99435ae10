"""End to end on a real kube-apiserver: engine arguments a tenant may not set stop a
ModelDeployment at the operator's admission, with a clear condition and a Warning Event, and
never reach the node agent; an argument the admin allowed (``--allow-engine-arg`` on the
operator and the agent, as the chart passes ``engineArgs.extraAllowed``) starts an instance.

The operator runs under the chart's ServiceAccount token (its RBAC) against a real agent
process (simulated GPUs, tests/e2e/agent_proc.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    REPO,
    Procs,
    W,
    describe_agents,
    get_json,
    install_for_operator,
    instances_of,
    slots_of,
    wait_for,
    write_models,
)

SETTLE_S = 40.0
WIDENED = "disable_log_stats"  # not a tenant's by default (it changes the node's metrics)


def _md(ns: str, name: str, model: str, args: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "model": {"name": model},
            "minInstances": 1,
            "maxInstances": 1,
            "engine": {"args": args},
        },
    }


def _cond(kubectl: Any, ns: str, name: str, kind: str) -> dict[str, Any]:
    conds = get_json(kubectl, "wsmd", name, "-n", ns).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == kind), {})


def test_disallowed_engine_args_stop_at_admission_and_never_reach_the_agent(
    k8s_control_plane: Any,
    k8s_namespace: str,
    kubectl: Any,
    helm: Any,
    sa_kubeconfig: Any,
    procs: Procs,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    ns = k8s_namespace
    op_kubeconfig, env = install_for_operator(kubectl, helm, sa_kubeconfig, ns, f"ea{ns[-8:]}")
    models = tmp_path / "models"
    write_models(models)
    addr_file = tmp_path / "node.addr"
    agent = [sys.executable, str(REPO / "tests/e2e/agent_proc.py"), "--models", str(models)]
    agent += ["--gpus", "4x64MiB", "--node", "node-a", "--address-file", str(addr_file)]
    agent += ["--memory-dir", str(tmp_path / "mem"), "--allow-engine-arg", WIDENED]
    procs.start("agent", agent, env)
    addr = wait_for(
        lambda: addr_file.exists() and addr_file.read_text(),
        "agent up",
        60,
        lambda: procs.log("agent"),
    )
    node = f"{ns}-node-a"
    request.addfinalizer(  # GPUNodes are cluster-scoped: never leave them behind
        lambda: kubectl("delete", "gpunode", node, "--ignore-not-found", "--wait=false",
                        check=False)
    )  # fmt: skip
    gpunode = {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "GPUNode",
        "metadata": {"name": node},
        "spec": {"agentAddress": addr},
    }
    mds = [
        # the finding: remote code from a repository the tenant names
        _md(ns, "remote-code", "tiny-chat", ["--trust-remote-code", "--tokenizer", "evil/repo"]),
        # a network endpoint: widenable, but this admin did not
        _md(ns, "traces", "tiny-big", ["--otlp-traces-endpoint=http://collector.evil:4317"]),
        # what the admin allowed, beside an argument every tenant may set
        _md(ns, "widened", "tiny-code", ["--max-model-len=256", "--" + WIDENED.replace("_", "-")]),
    ]
    items = {"apiVersion": "v1", "kind": "List", "items": [gpunode, *mds]}
    kubectl("apply", "-f", "-", input=json.dumps(items))
    operator = [sys.executable, "-m", "warmserve", "operator", "--window-seconds", str(W)]
    operator += ["--poll-seconds", "0.5", "--standalone", "--metrics-port", "0", "--namespace", ns]
    operator += ["--allow-engine-arg", WIDENED]
    procs.start("operator", operator, {**env, "KUBECONFIG": str(op_kubeconfig)})
    t0 = time.monotonic()

    def logs() -> str:
        return procs.log("operator") + "\n" + procs.log("agent")

    # The admin-widened deployment is admitted and serves: the operator is acting.
    wait_for(
        lambda: get_json(kubectl, "wsmd", "widened", "-n", ns).get("status", {}).get(
            "instanceCount"
        ) == 1,
        "the widened deployment serves an instance", SETTLE_S, logs,
    )  # fmt: skip

    # The refused ones: Degraded/InvalidSpec naming the argument, Ready False, an Event.
    for name, flag, hint in (
        ("remote-code", "--trust-remote-code", "it can run code on the GPU node"),
        ("traces", "--otlp-traces-endpoint", "--allow-engine-arg otlp_traces_endpoint"),
    ):
        cond = wait_for(
            lambda n=name: _cond(kubectl, ns, n, "Degraded").get("reason") == "InvalidSpec"
            and _cond(kubectl, ns, n, "Degraded"),
            f"{name}: Degraded InvalidSpec", SETTLE_S, logs,
        )  # fmt: skip
        assert cond["status"] == "True"
        assert f"spec.engine.args: {flag}: not allowed for tenants" in cond["message"], cond
        assert hint in cond["message"], cond
        assert _cond(kubectl, ns, name, "Ready").get("status") == "False"
        events = get_json(
            kubectl, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
        )["items"]
        assert any(
            e["type"] == "Warning" and e["reason"] == "InvalidSpec" and flag in e["message"]
            for e in events
        ), events

    # Several polls later the agent has seen neither model: no slot, no instance, no Activate.
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
    snaps = describe_agents({node: addr})
    for model in ("tiny-chat", "tiny-big"):
        assert not instances_of(snaps, model) and not slots_of(snaps, model), snaps
    agent_log = (tmp_path / "agent.log").read_text()
    assert "model=tiny-code" in agent_log  # the widened one was activated here
    assert "model=tiny-chat" not in agent_log and "model=tiny-big" not in agent_log
