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

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_support import apply_chart_operator_rbac

REPO = Path(__file__).resolve().parents[2]

W = 5.0  # window seconds (divides a day)
SETTLE_S = 40.0  # bound for each convergence below


def _agent_test_helpers() -> Any:
    """tests/agent/conftest.py (real safetensors test models), loaded under a private name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "warmserve_agent_test_models", REPO / "tests" / "agent" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_models(root: Path) -> None:
    write_model = _agent_test_helpers().write_model

    slow = {"decode_tok_s": 20.0, "max_batch": 8, "kv_bytes_per_token": 256}
    write_model(root, "tiny-chat", layers=4, hidden=64, seed=1, profile=slow)
    write_model(root, "tiny-code", layers=4, hidden=64, seed=2, profile=slow)
    write_model(root, "tiny-big", layers=2, hidden=32, seed=3, profile=slow)


def wait_for(pred: Callable[[], Any], what: str, timeout: float, logs: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:  # the API may answer 404 until the operator catches up
            last_exc = exc
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout:.0f}s: {what} (last error: {last_exc})\n{logs()}")


class Procs:
    """Processes this test starts; all are stopped at the end, whatever happens."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.procs[name] = p
        return p

    def log(self, name: str, lines: int = 40) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name} log (last {lines} lines) ---\n" + "\n".join(text.splitlines()[-lines:])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name)
        p.send_signal(sig)
        p.wait(timeout=20)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:  # an agent still streaming long completions may take a while: not worth waiting
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def seed_history(kubectl: Any, ns: str, md: str, model: str, avg: float, peak: float) -> None:
    """A day and a bit of constant load, as if the operator had watched the model for a day."""
    from warmserve_operator.history import LoadHistory, configmap_name

    h = LoadHistory(W)
    end = math.floor(time.time() / W)
    per_day = round(86400 / W)
    for i in range(end - per_day - 30, end):
        h.record(i, avg, peak)
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": configmap_name(md), "namespace": ns},
        "data": h.to_data(model),
    }
    kubectl("apply", "-f", "-", input=json.dumps(cm))


def get_json(kubectl: Any, *args: str) -> Any:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def describe_agents(addresses: dict[str, str]) -> dict[str, Any]:
    from warmserve_agent.client import SyncAgentClient
    from warmserve_operator.agents import snapshot_from_pb

    out = {}
    for node, addr in addresses.items():
        with SyncAgentClient(addr) as c:
            out[node] = snapshot_from_pb(node, c.describe())
    return out


def slots_of(snaps: dict[str, Any], model: str) -> list[tuple[str, tuple[int, ...]]]:
    return sorted(
        (n, s.gpus)
        for n, snap in snaps.items()
        for s in snap.slots
        if s.model == model and s.state != "active"
    )


def instances_of(snaps: dict[str, Any], model: str) -> list[Any]:
    return [i for snap in snaps.values() for i in snap.instances if i.model == model]


def policy_replicas(kubectl: Any, ns: str, snaps: dict[str, Any]) -> tuple[Any, Any]:
    """Recompute the placement with the policy core from the agents' reports and the statuses.

    Returns (plan on the current state, plan from scratch: same state without any replica).
    """
    from dataclasses import replace

    from warmserve_operator.planning import build_state
    from warmserve_operator.spec import parse_model_deployment, resolve_model

    from warmserve.policy.cluster import LoadForecast, WorkerState
    from warmserve.policy.placement import plan_prewarm

    catalog = {}
    for snap in snaps.values():
        catalog.update(snap.models)
    specs, forecasts = {}, {}
    for body in get_json(kubectl, "wsmd", "-n", ns)["items"]:
        md = parse_model_deployment(body)
        specs[md.model] = resolve_model(md, catalog)
        load = body["status"]["load"]
        forecasts[md.model] = LoadForecast(load["predictedAverage"], load["predictedPeak"])
    built = build_state(specs, snaps, forecasts)
    state = built.state
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


class Load:
    """Streaming completions held open against one endpoint (requests in flight)."""

    def __init__(self, endpoint: str, model: str, n: int, max_tokens: int = 400) -> None:
        self.threads = [
            threading.Thread(target=self._one, args=(endpoint, model, max_tokens), daemon=True)
            for _ in range(n)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _one(endpoint: str, model: str, max_tokens: int) -> None:
        body = json.dumps(
            {"model": model, "prompt": "hello", "max_tokens": max_tokens, "stream": True}
        ).encode()
        req = urllib.request.Request(
            f"{endpoint}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with contextlib.suppress(Exception), urllib.request.urlopen(req, timeout=60) as resp:
            while resp.read(256):
                pass


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
        # Two replicas from the start: kopf peering + the loop's leader check let only the one
        # with the higher priority act; the standby (priority 50) must never touch an agent.
        start_operator("operator-standby", 50)
        start_operator("operator-1", 100)
        kubectl(
            "apply",
            "-n",
            ns,
            "-f",
            str(REPO / "examples/modeldeployment-chat.yaml"),
            "-f",
            str(REPO / "examples/modeldeployment-code.yaml"),
        )

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

        # 3. Kill the operator mid-way; another replica takes over without duplicating anything.
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
        from warmserve_operator.history import LoadHistory

        def history_written() -> bool:
            cm = get_json(kubectl, "configmap", "warmserve-history-code", "-n", ns)
            hist = LoadHistory.from_data(cm["data"], W)
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
            kubectl("get", "configmap", "warmserve-history-chat", "-n", ns, check=False).returncode
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
        standby = (tmp_path / "operator-standby.log").read_text()
        assert "event=operator_started" in standby
        assert "event=action" not in standby, "the standby replica acted"
        for leader in ("operator-1", "operator-2"):
            assert "event=action" in (tmp_path / f"{leader}.log").read_text(), leader
        print(f"e2e wall time: {time.monotonic() - t_start:.1f}s")
    finally:
        kubectl("delete", "gpunode", *addresses, "--ignore-not-found", "--wait=false", check=False)
