"""End to end on a real kube-apiserver: the operator (under the chart's ServiceAccount token, so
a missing RBAC rule fails here) drives two node agents with simulated GPUs (local processes
standing in for two GPU nodes).

What it shows, each within a stated bound:

1. ``kubectl apply`` of the repository's examples leads to statuses whose prewarmed replicas are
   exactly where the policy core plans them (recomputed here from the agents' own reports);
2. raising a model's load (real streaming requests to the instance, so the agent reports more
   requests in flight) starts a second instance on a prewarmed GPU group — a hit, visible in
   the status and as an Event;
3. killing the operator (SIGKILL) and starting another replica leaves no duplicate instance or
   slot;
4. a valid but unplaceable deployment (tensorParallel larger than any node) is reported in a
   condition and an Event;
5. deleting a ModelDeployment leaves no slot or instance of its model;
6. ``warmserve status`` shows it all.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e_support import REPO, Load, describe_agents, get_json, instances_of, slots_of, write_models

from warmserve.testing.k8s import apply_chart_operator_rbac
from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import WINDOW_S as W
from warmserve.testing.stack import seed_history

SETTLE_S = 40.0  # bound for each convergence below


def policy_replicas(kubectl: Any, ns: str, snaps: dict[str, Any]) -> tuple[Any, Any]:
    """Recompute the placement with the policy core from the agents' reports and the statuses.

    Returns (plan on the current state, plan from scratch: same state without any replica).
    """
    from dataclasses import replace

    from warmserve_operator.model_spec import merged_catalog, resolve_model
    from warmserve_operator.observe import observation

    from warmserve.api.crd import parse_model_deployment
    from warmserve.control.snapshot import build_state
    from warmserve.policy.cluster import LoadForecast, WorkerState
    from warmserve.policy.evict_aware_placement import plan_prewarm

    catalog = merged_catalog(snap.models for snap in snaps.values())
    specs, forecasts, owners = {}, {}, {}
    for body in get_json(kubectl, "wsmd", "-n", ns)["items"]:
        md = parse_model_deployment(body)
        owners[md.model] = md.uid
        specs[md.model] = resolve_model(md, catalog)
        load = body["status"]["load"]
        forecasts[md.model] = LoadForecast(load["predictedAverage"], load["predictedPeak"])
    obs = observation(time.time(), snaps, owners, set(owners.values()))
    state = build_state(obs, specs, forecasts)
    idle = (WorkerState.IDLE, WorkerState.UNIVERSAL)
    bare_nodes = tuple(
        replace(
            n,
            gpus=tuple(
                replace(g, free_bytes=g.memory_bytes, state=WorkerState.IDLE)
                if g.state in idle
                else g
                for g in n.gpus
            ),
        )
        for n in state.nodes
    )
    scratch = replace(state, nodes=bare_nodes, replicas=())
    return plan_prewarm(state), plan_prewarm(scratch)


def test_operator_end_to_end(
    k8s_control_plane: Any,
    k8s_namespace: str,
    kubectl: Any,
    helm: Any,
    sa_kubeconfig: Any,
    procs: Procs,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    t_start = time.monotonic()
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/modeldeployments.warmserve.io",
        "crd/gpunodes.warmserve.io",
        "crd/clusterkopfpeerings.kopf.dev",
    )
    # The chart's operator ServiceAccount and RBAC, rendered by helm, for a release in `ns`.
    sa = apply_chart_operator_rbac(helm, kubectl, ns, f"e2e{ns[-8:]}")
    op_kubeconfig = sa_kubeconfig(ns, sa)

    # Two "GPU nodes": agent processes with 4 simulated GPUs each.
    models = tmp_path / "models"
    write_models(models)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE")}
    addresses = {}
    for node in ("node-a", "node-b"):
        addr_file = tmp_path / f"{node}.addr"
        procs.start(
            node,
            [
                sys.executable,
                str(REPO / "tests/e2e/agent_proc.py"),
                "--models",
                str(models),
                "--gpus",
                "4x64MiB",
                "--node",
                node,
                "--address-file",
                str(addr_file),
                "--memory-dir",
                str(tmp_path / f"mem-{node}"),
            ],
            env,
        )
        addresses[node] = wait_for(
            lambda f=addr_file: f.exists() and f.read_text(),
            f"agent {node} up",
            60,
            lambda n=node: procs.log(n),
        )
    nodes_yaml = [
        {
            "apiVersion": "warmserve.io/v1alpha1",
            "kind": "GPUNode",
            "metadata": {"name": f"{ns}-{n}"},
            "spec": {"agentAddress": a},
        }
        for n, a in addresses.items()
    ]
    kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes_yaml}),
    )
    addresses = {f"{ns}-{n}": a for n, a in addresses.items()}
    # The deployments first (their UIDs name the histories), then the operators.
    kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        str(REPO / "examples/modeldeployment-chat.yaml"),
        "-f",
        str(REPO / "examples/modeldeployment-code.yaml"),
    )
    seed_history(kubectl, ns, "chat", "tiny-chat", avg=6.0, peak=10.0)  # B=4: 2 basic + 1 burst
    seed_history(kubectl, ns, "code", "tiny-code", avg=5.0, peak=5.0)  # 2 instances, 1 serving

    def start_operator(name: str, priority: int) -> None:
        procs.start(
            name,
            [
                sys.executable,
                "-m",
                "warmserve",
                "operator",
                "--window-seconds",
                str(W),
                "--poll-seconds",
                "0.5",
                "--predictor",
                "seasonal",
                "--peering",
                "warmserve",
                "--priority",
                str(priority),
                "--lease-seconds",
                "6",
                "--metrics-port",
                "0",
                "--scale-down-delay",
                "600",
                "--namespace",
                ns,
            ],
            {**env, "KUBECONFIG": str(op_kubeconfig)},
        )

    def logs() -> str:
        return "\n".join(procs.log(n) for n in list(procs.procs) if n.startswith("operator"))

    try:
        # Two replicas: the loop's leader Lease lets one act at a time, and a lower priority
        # never takes it from a live leader; the standby (priority 50) starts second and must not
        # touch an agent while operator-1 lives.
        start_operator("operator-1", 100)
        wait_for(
            lambda: "event=action" in (tmp_path / "operator-1.log").read_text(),
            "operator-1 leads",
            SETTLE_S,
            logs,
        )
        start_operator("operator-standby", 50)

        # 1. Prewarmed replicas placed as the policy core plans them.
        def placed() -> bool:
            chat = get_json(kubectl, "wsmd", "chat", "-n", ns)["status"]
            code = get_json(kubectl, "wsmd", "code", "-n", ns)["status"]
            return (
                chat["prewarmedCount"] == 3
                and all(r["state"] == "ready" for r in chat["prewarmedReplicas"])
                and code["instanceCount"] == 1
                and code["prewarmedCount"] == 1
                and all(r["state"] == "ready" for r in code["prewarmedReplicas"])
            )

        wait_for(
            placed,
            "examples prewarmed (chat: 3 replicas, code: 1 instance + 1 replica)",
            SETTLE_S,
            logs,
        )
        snaps = describe_agents(addresses)
        on_state, from_scratch = policy_replicas(kubectl, ns, snaps)
        assert not on_state.place and not on_state.evict and not on_state.unplaced, on_state
        want = sorted((r.model, r.node, r.gpus) for r in from_scratch.place)
        have = sorted((m, n, g) for m in ("tiny-chat", "tiny-code") for n, g in slots_of(snaps, m))
        assert have == want, f"agents hold {have}, the policy plans {want}"
        chat = get_json(kubectl, "wsmd", "chat", "-n", ns)
        assert [r["kind"] for r in chat["status"]["prewarmedReplicas"]] == [
            "basic",
            "basic",
            "burst",
        ]
        assert all(r["layersResident"] == 2 for r in chat["status"]["prewarmedReplicas"])
        ready = {c["type"]: c for c in chat["status"]["conditions"]}
        assert ready["Prewarmed"]["status"] == "True" and ready["Ready"]["reason"] == "ScaledToZero"
        facts = chat["status"]["model"]
        assert (facts["prewarmLayers"], facts["prewarmLayersSource"]) == (2, "spec")

        # code's depth is `auto`: once its instance ran, its agent had measured the profile
        # (the loader's rate, a timed forward, the activation) and the operator took the rule
        def profiled() -> dict[str, Any] | None:
            facts = get_json(kubectl, "wsmd", "code", "-n", ns)["status"]["model"]
            return facts if facts.get("prewarmLayersSource") == "profiled" else None

        facts = wait_for(profiled, "code's prewarm depth from the measured profile", SETTLE_S, logs)
        assert 1 <= facts["prewarmLayers"] <= 4, facts
        assert facts["prewarmLayersReason"].startswith("auto: "), facts

        # 3. Kill the operator mid-way; another replica takes over without duplicating anything.
        wait_for(
            lambda: "event=operator_started" in (tmp_path / "operator-standby.log").read_text(),
            "the standby runs beside the leader",
            SETTLE_S,
            logs,
        )
        time.sleep(2.0)  # a few of its polls beside a live leader
        standby_before_kill = (tmp_path / "operator-standby.log").read_text()
        procs.kill("operator-1")
        start_operator("operator-2", 200)

        # 2. Raise code's load beyond one instance's batch (B=4): a start on the prewarmed group.
        (inst,) = instances_of(snaps, "tiny-code")
        replica_groups = [(n, g) for n, g in slots_of(snaps, "tiny-code")]
        Load(inst.endpoint, "tiny-code", 6)

        def scaled() -> Any:
            st = get_json(kubectl, "wsmd", "code", "-n", ns)["status"]
            return st if st["instanceCount"] == 2 and st["prewarm"]["hits"] >= 1 else None

        st = wait_for(scaled, "code scaled to 2 instances with a prewarm hit", SETTLE_S, logs)
        new = [i for i in st["instances"] if i["id"] != inst.instance_id]
        assert len(new) == 1 and new[0]["prewarmHit"] is True
        assert (new[0]["node"], tuple(new[0]["gpus"])) in replica_groups
        events = get_json(kubectl, "events", "-n", ns)["items"]
        accepted = {e["involvedObject"]["name"] for e in events if e["reason"] == "Accepted"}
        assert {"chat", "code"} <= accepted, "the loop posts Accepted (issue 16)"
        hits = [
            e
            for e in events
            if e["reason"] == "PrewarmHit" and e["involvedObject"]["name"] == "code"
        ]
        assert hits, "a PrewarmHit Event for the code deployment"

        # No duplicates after the restart: a few more polls change nothing.
        time.sleep(3)
        snaps = describe_agents(addresses)
        assert len(instances_of(snaps, "tiny-code")) == 2
        chat_slots = slots_of(snaps, "tiny-chat")
        assert len(chat_slots) == 3 and len(set(chat_slots)) == 3, chat_slots

        # The load history is persisted by the operator (here: under the chart's RBAC).
        import warmserve.api.history as history_io

        code_uid = get_json(kubectl, "wsmd", "code", "-n", ns)["metadata"]["uid"]
        chat_uid = get_json(kubectl, "wsmd", "chat", "-n", ns)["metadata"]["uid"]

        def history_written() -> bool:
            cm = get_json(kubectl, "configmap", f"warmserve-history-{code_uid}", "-n", ns)
            hist = history_io.from_data(cm["data"], W)
            return hist.end > math.floor(time.time() / W) - 3 and max(hist.peak[-3:]) >= 6

        wait_for(history_written, "code's observed windows persisted", SETTLE_S, logs)

        # 4. Valid but unplaceable: tensorParallel 8 on 4-GPU nodes.
        big = {
            "apiVersion": "warmserve.io/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "big", "namespace": ns},
            "spec": {"model": {"name": "tiny-big"}, "tensorParallel": 8, "minInstances": 1},
        }
        kubectl("apply", "-f", "-", input=json.dumps(big))

        def unplaceable() -> Any:
            st = get_json(kubectl, "wsmd", "big", "-n", ns)["status"]
            cond = {c["type"]: c for c in st["conditions"]}["Degraded"]
            return cond if cond["status"] == "True" and cond["reason"] == "Unplaceable" else None

        cond = wait_for(unplaceable, "big reported Unplaceable", SETTLE_S, logs)
        assert "tensorParallel=8" in cond["message"]
        wait_for(
            lambda: [
                e
                for e in get_json(kubectl, "events", "-n", ns)["items"]
                if e["reason"] == "Unplaceable" and e["type"] == "Warning"
            ],
            "an Unplaceable Warning Event",
            SETTLE_S,
            logs,
        )

        # 5. Delete chat: the finalizer removes every slot/instance before the object goes.
        kubectl("delete", "wsmd", "chat", "-n", ns, "--wait=false")
        wait_for(
            lambda: kubectl("get", "wsmd", "chat", "-n", ns, check=False).returncode != 0,
            "chat deleted (finalizer done)",
            SETTLE_S,
            logs,
        )
        snaps = describe_agents(addresses)
        assert not slots_of(snaps, "tiny-chat") and not instances_of(snaps, "tiny-chat")
        assert (
            kubectl(
                "get", "configmap", f"warmserve-history-{chat_uid}", "-n", ns, check=False
            ).returncode
            != 0
        ), "its load history went with it"

        # 6. warmserve status shows nodes, workers and models.
        admin_env = {**env, "KUBECONFIG": str(k8s_control_plane.kubeconfig)}
        out = subprocess.run(
            [sys.executable, "-m", "warmserve", "status", "-n", ns, "--json"],
            capture_output=True,
            text=True,
            env=admin_env,
            check=True,
            timeout=60,
        )
        view = json.loads(out.stdout)
        code_view = next(m for m in view["models"] if m["name"] == f"{ns}/code")
        assert len(code_view["instances"]) == 2 and code_view["hits"] >= 1
        assert {n["name"] for n in view["nodes"]} >= set(addresses)
        text = subprocess.run(
            [sys.executable, "-m", "warmserve", "status", "-n", ns],
            capture_output=True,
            text=True,
            env=admin_env,
            check=True,
            timeout=60,
        ).stdout
        assert "tiny-code" in text and "Unplaceable" in text
        print(text)
        assert "event=operator_started" in standby_before_kill
        assert "event=action" not in standby_before_kill, "the standby acted beside a leader"
        assert "event=action" in (tmp_path / "operator-1.log").read_text()
        print(f"e2e wall time: {time.monotonic() - t_start:.1f}s")
    finally:
        kubectl("delete", "gpunode", *addresses, "--ignore-not-found", "--wait=false", check=False)
