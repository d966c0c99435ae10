"""The chart's Grafana dashboard against a real Prometheus: no dead panel.

A local installation (real kube-apiserver, the operator under the chart's RBAC, two agents with
simulated GPUs, a model fetched from a local Hub-protocol server) is driven through what the
panels show — a forecast and prewarmed replicas, a cold start and a prewarm hit, a model
download — while Prometheus (built from the Go module proxy, tests/e2e/dashboard_support.py)
scrapes the operator's and the agents' /metrics every second.  Then every query of every panel
(Grafana macros filled in as Grafana would) must return finite data over the test's range.

``WARMSERVE_DASHBOARD_PNG=docs/dashboard.png WARMSERVE_DASHBOARD_SECONDS=150 pytest
tests/e2e/test_dashboard_e2e.py`` also draws the dashboard from the same queries (matplotlib) into
that file, after letting load come and go for that many more seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dashboard_support import finite_points, free_port, panels, promql, render_png, start_prometheus
from e2e_support import (
    REPO,
    Load,
    Procs,
    W,
    _agent_test_helpers,
    get_json,
    install_for_operator,
    instances_of,
    seed_history,
    wait_for,
    write_models,
)

from tests.model_sources_support import HubServer, built_server, repo_from_dir

SETTLE_S = 60.0
GATEWAY_METRIC = "warmserve_gateway_"


def gateway_started() -> bool:
    """Whether this test runs a gateway. Not yet: the gateway (issue 9) was not in main when
    this test was written; its panels use the metric names of its branch and are listed as not
    checked (printed) until this test starts one."""
    return False


def test_every_dashboard_panel_has_data_on_a_real_prometheus(
    k8s_control_plane: Any,
    k8s_namespace: str,
    kubectl: Any,
    helm: Any,
    sa_kubeconfig: Any,
    procs: Procs,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    prom_bin = built_server("prometheus")
    op_kubeconfig, env = install_for_operator(kubectl, helm, sa_kubeconfig, ns, f"dash{ns[-8:]}")
    models = tmp_path / "models"
    write_models(models)
    up = _agent_test_helpers().write_model(tmp_path / "up", "fresh", layers=2, hidden=256)

    with HubServer({"acme/fresh": repo_from_dir(up)}, rate=2e6) as hub:
        targets, addresses = {}, {}
        for node in ("node-a", "node-b"):
            f = tmp_path / f"{node}.addr"
            procs.start(
                node,
                [
                    sys.executable, str(REPO / "tests/e2e/agent_proc.py"),
                    "--models", str(models), "--gpus", "4x64MiB", "--node", node,
                    "--address-file", str(f), "--memory-dir", str(tmp_path / f"mem-{node}"),
                    "--hf-endpoint", hub.url, "--metrics-port", "0",
                    "--store-budget", str(64 * 1024**2),
                ],
                env,
            )  # fmt: skip
            addresses[f"{ns}-{node}"] = wait_for(
                lambda f=f: f.exists() and f.read_text(), f"{node} up", 60,
                lambda n=node: procs.log(n),
            )  # fmt: skip
            targets[f"agent-{node}"] = f"127.0.0.1:{f.with_suffix('.metrics').read_text()}"
        kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "List", "items": [
                {"apiVersion": "warmserve.io/v1alpha1", "kind": "GPUNode",
                 "metadata": {"name": n}, "spec": {"agentAddress": a}}
                for n, a in addresses.items()
            ],
        }))  # fmt: skip
        kubectl(
            "apply", "-n", ns,
            "-f", str(REPO / "examples/modeldeployment-chat.yaml"),
            "-f", str(REPO / "examples/modeldeployment-code.yaml"),
        )  # fmt: skip
        fresh = {
            "apiVersion": "warmserve.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": "fresh", "namespace": ns},
            "spec": {"model": {"name": "acme/fresh", "source": "hf://acme/fresh"}},
        }  # fmt: skip
        kubectl("apply", "-f", "-", input=json.dumps(fresh))
        seed_history(kubectl, ns, "chat", "tiny-chat", avg=6.0, peak=10.0)
        seed_history(kubectl, ns, "code", "tiny-code", avg=5.0, peak=5.0)
        seed_history(kubectl, ns, "fresh", "acme/fresh", avg=2.0, peak=2.0)
        op_port = free_port()
        targets["operator"] = f"127.0.0.1:{op_port}"
        prom = start_prometheus(prom_bin, tmp_path, targets)
        t0 = time.time()
        try:
            procs.start(
                "operator",
                [
                    sys.executable, "-m", "warmserve", "operator",
                    "--window-seconds", str(W), "--poll-seconds", "0.5",
                    "--predictor", "seasonal", "--standalone",
                    "--metrics-port", str(op_port), "--metrics-address", "127.0.0.1",
                    "--scale-down-delay", "600", "--namespace", ns,
                ],
                {**env, "KUBECONFIG": str(op_kubeconfig)},
            )  # fmt: skip

            def logs() -> str:
                return procs.log("operator") + procs.log("node-a") + procs.log("node-b")

            wait_for(
                lambda: (
                    all(h == "up" for h in prom.targets_up().values())
                    and len(prom.targets_up()) == len(targets)
                ),
                "Prometheus scrapes the operator and both agents",
                SETTLE_S,
                logs,
            )

            # Forecast, prewarmed replicas, a cold start (code: minInstances 1), a download.
            def settled() -> Any:
                st = {
                    n: get_json(kubectl, "wsmd", n, "-n", ns).get("status") or {}
                    for n in ("chat", "code", "fresh")
                }
                return (
                    st["chat"].get("prewarmedCount") == 3
                    and st["code"].get("instanceCount") == 1
                    and st["fresh"].get("prewarmedCount", 0) >= 1
                )

            wait_for(settled, "replicas prewarmed, code started, fresh fetched", SETTLE_S, logs)
            # A prewarm hit: code's load beyond one instance's batch.
            from e2e_support import describe_agents

            (inst,) = instances_of(describe_agents(addresses), "tiny-code")
            Load(inst.endpoint, "tiny-code", 6)
            wait_for(
                lambda: get_json(kubectl, "wsmd", "code", "-n", ns)["status"]["prewarm"]["hits"],
                "a prewarm hit",
                SETTLE_S,
                logs,
            )
            # For the picture (docs/dashboard.png): a while longer, with load coming and going.
            extra = float(os.environ.get("WARMSERVE_DASHBOARD_SECONDS", "0"))
            waves = [3, 8, 1, 10, 4, 0]
            for i in range(int(extra // 15)):
                if waves[i % len(waves)]:
                    Load(inst.endpoint, "tiny-code", waves[i % len(waves)], max_tokens=250)
                time.sleep(15)
            time.sleep(6 * 1.0)  # a few more scrapes after the last change
            end = time.time()
            checked, dead, not_here = 0, [], []
            for p in panels():
                for t in p["targets"]:
                    if GATEWAY_METRIC in t["expr"] and not gateway_started():
                        not_here.append(f"{p['title']} / {t['legendFormat']}")
                        continue
                    series = prom.range(promql(t["expr"], end - t0), t0, end)
                    checked += 1
                    if not finite_points(series):
                        dead.append(f"{p['title']} / {t['legendFormat']}: {t['expr']}")
            assert not dead, "panels without data:\n" + "\n".join(dead)
            assert checked >= 15, checked
            if not_here:  # said out loud, never silently
                print("not checked (no gateway in this test yet):", *not_here, sep="\n  ")
            assert len(not_here) <= 4, "only the gateway's panels may go unchecked"
            if os.environ.get("WARMSERVE_DASHBOARD_PNG"):
                render_png(prom, t0, end, Path(os.environ["WARMSERVE_DASHBOARD_PNG"]))
        finally:
            prom.stop()
            # GPUNodes are cluster-scoped: never leave them to the tests after this one.
            kubectl("delete", "gpunode", *addresses, "--ignore-not-found", "--wait=false",
                    check=False)  # fmt: skip
