"""Helpers of the end-to-end tests: agent processes with fault hooks, reading the agents, holding
requests open (child processes, waiting with a bound and seeding load history are in
``warmserve.testing``)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from warmserve_agent.testing import write_model

from warmserve.testing.procs import Procs

REPO = Path(__file__).resolve().parents[2]


def write_models(root: Path) -> None:
    slow = {"decode_tok_s": 20.0, "max_batch": 8, "kv_bytes_per_token": 256}
    write_model(root, "tiny-chat", layers=4, hidden=64, seed=1, profile=slow)
    write_model(root, "tiny-code", layers=4, hidden=64, seed=2, profile=slow)
    write_model(root, "tiny-big", layers=2, hidden=32, seed=3, profile=slow)


def get_json(kubectl: Any, *args: str) -> Any:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def describe_agents(addresses: dict[str, str]) -> dict[str, Any]:
    from warmserve_operator.snapshot import snapshot_from_pb

    from warmserve.api.agent.client import SyncAgentClient

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


def start_sim_agent(
    procs: Procs, tmp: Path, node: str, env: dict[str, str], *extra: str
) -> str:
    """Start ``agent_proc.py`` for ``node`` (4 simulated 64 MiB GPUs, models under
    ``tmp/models``; ``extra``: more of its flags) and return its address once it serves."""
    import sys

    addr = tmp / f"{node}-{time.monotonic_ns()}.addr"
    argv = [
        sys.executable, str(REPO / "tests/e2e/agent_proc.py"), "--models", str(tmp / "models"),
        "--gpus", "4x64MiB", "--node", node, "--address-file", str(addr),
        "--memory-dir", str(tmp / f"mem-{addr.stem}"), *extra,
    ]  # fmt: skip
    procs.start(node, argv, env)
    deadline = time.monotonic() + 60
    while not (addr.exists() and addr.read_text()):
        assert time.monotonic() < deadline, procs.log(node)
        time.sleep(0.1)
    return addr.read_text()


def register_gpu_node(kubectl: Any, name: str, address: str) -> None:
    """The GPUNode of an agent run by hand (no discovery)."""
    import json

    body = {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "GPUNode",
        "metadata": {"name": name},
        "spec": {"agentAddress": address},
    }
    kubectl("apply", "-f", "-", input=json.dumps(body))


def install_for_operator(
    kubectl: Any, helm: Any, sa_kubeconfig: Any, ns: str, release: str
) -> tuple[Path, dict[str, str]]:
    """CRDs (established), the chart's operator ServiceAccount and RBAC for a release in ``ns``;
    returns the operator's kubeconfig (that ServiceAccount's token) and a clean environment for
    child processes (no KUBECONFIG, no POD_NAMESPACE)."""
    import os

    from warmserve.testing.k8s import apply_chart_operator_rbac

    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/modeldeployments.warmserve.io", "crd/gpunodes.warmserve.io",
        "crd/clusterkopfpeerings.kopf.dev",
    )  # fmt: skip
    sa = apply_chart_operator_rbac(helm, kubectl, ns, release)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE")}
    return sa_kubeconfig(ns, sa), env
