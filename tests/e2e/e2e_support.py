"""Helpers of the end-to-end tests: agent processes, waiting with a bound, reading the agents,
seeding load history, holding requests open."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
W = 5.0  # window seconds (divides a day)


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


def seed_history(kubectl: Any, ns: str, md: str, model: str, avg: float, peak: float) -> None:
    """A day and a bit of constant load, as if the operator had watched the model for a day.

    Stored where the operator keeps it: in its own namespace (here the same ``ns``), named by
    the deployment's UID."""
    import warmserve.api.history as history_io
    from warmserve.api.history import OWNER_LABEL, configmap_name
    from warmserve.control.history import LoadHistory

    uid = get_json(kubectl, "wsmd", md, "-n", ns)["metadata"]["uid"]
    h = LoadHistory(W)
    end = math.floor(time.time() / W)
    per_day = round(86400 / W)
    for i in range(end - per_day - 30, end):
        h.record(i, avg, peak)
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(uid),
            "namespace": ns,
            "labels": {"app.kubernetes.io/managed-by": "warmserve-operator", OWNER_LABEL: uid},
        },
        "data": history_io.to_data(h, model),
    }
    kubectl("apply", "-f", "-", input=json.dumps(cm))


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

    from k8s_support import apply_chart_operator_rbac

    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/modeldeployments.warmserve.io", "crd/gpunodes.warmserve.io",
        "crd/clusterkopfpeerings.kopf.dev",
    )  # fmt: skip
    sa = apply_chart_operator_rbac(helm, kubectl, ns, release)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE")}
    return sa_kubeconfig(ns, sa), env
