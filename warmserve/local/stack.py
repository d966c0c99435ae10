"""Starting and stopping the local stack (``warmserve up`` setup, ``warmserve down``).

Order of ``start``: control plane (``hack/k8s/start.sh``) → ``helm install`` of the chart (CRDs,
RBAC, Services, TLS secrets, peering, the workloads) → Nodes → the agents' pods (one per GPU
node) → the gateway's pods.  The operator's pod starts later (:mod:`.run`), once the
ModelDeployments and their seeded history exist, so its first look at a deployment already
finds the history.  Every process is recorded in ``stack.json`` as soon as it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import procs
from .controlplane import CHART, ControlPlane
from .kubelet import Kubelet, Pod, marker_env, pod_network
from .model_mix import ModelMix, simulated_gpus_flag, write_weights
from .realengine import source_path
from .state import Stack, StackError
from .workload import ReplayPlan
from .workload_controllers import endpoint_slices, workload_status

NAMESPACE = "warmserve"
RELEASE = "warmserve"
CPU_NODE = "cpu-node-1"


@dataclass
class Running:
    """Handles on a started stack."""

    stack: Stack
    plane: ControlPlane
    kubelet: Kubelet
    agents: list[Pod]
    gateways: list[Pod]
    operator: Pod
    gateway_urls: list[str]


def values(
    mix: ModelMix, plan: ReplayPlan, gpus_per_node: int, gib: float, models: Path
) -> dict[str, Any]:
    """The chart values of the local stack: the time-compressed operator, simulated GPUs at the
    byte scale, the stand-in model cache (real models linked in); everything else is the
    chart's default.  ``engine: vllm`` scenarios: the agents host vllm too, with 2 MiB pages."""
    speed = plan.speed
    pages = [] if mix.engine == "vllm" else ["--page-size=64KiB"]
    return {
        "operator": {
            "windowSeconds": plan.window_s,
            "pollSeconds": 1,
            "extraArgs": [
                f"--day-seconds={plan.day_s:g}",
                f"--scale-down-delay={mix.scale_down_delay_s / speed:g}",
                f"--max-grace={mix.max_grace_s / speed:g}",
            ],
        },
        "agent": {
            "simulateGpus": simulated_gpus_flag(gpus_per_node, gib, mix.byte_scale),
            "gpuResource": {"count": 0},
            "modelCache": {"hostPath": str(models)},
            "extraArgs": [f"--sim-copy-gbps={mix.copy_bytes_per_s / 1e9:.6g}", *pages],
            "engines": "simulated,vllm" if mix.engine == "vllm" else "simulated",
        },
        "gateway": {"replicas": 2},
    }


def _wait(pred: Callable[[], Any], what: str, timeout: float, hint: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            v = pred()
            if v:
                return v
        time.sleep(0.5)
    raise StackError(f"{what} did not happen within {timeout:.0f} s{hint}")


def _tcp_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)


def start(
    stack: Stack,
    bin_dir: Path,
    mix: ModelMix,
    plan: ReplayPlan,
    nodes: int,
    gpus_per_node: int,
    gib: float,
    port: int,
    say: Callable[[str], None],
    *,
    real: dict[str, Path] | None = None,
    agent_python: str = "",
) -> Running:
    """``real``: the real models' directories; ``agent_python``: the agents' interpreter (the
    vLLM venv's under ``--engine vllm``)."""
    env = marker_env(stack)
    t0 = time.monotonic()
    say("starting the control plane (etcd + kube-apiserver)")
    plane = ControlPlane.start(stack.controlplane_dir, bin_dir, env)
    for name, pid in plane.pids().items():
        stack.add(procs.record_of(name, pid, str(stack.controlplane_dir / f"{name}.log")))
    plane.kubeconfig_for(None, NAMESPACE, stack.kubeconfig)
    say(f"control plane ready in {time.monotonic() - t0:.0f}s at {plane.server}")

    models = write_weights(mix, stack.dir / "models", real)
    vals = values(mix, plan, gpus_per_node, gib, models)
    vfile = stack.dir / "helm" / "values.yaml"
    vfile.parent.mkdir(parents=True, exist_ok=True)
    vfile.write_text(yaml.safe_dump(vals, sort_keys=False))
    say(f"helm install {RELEASE} {CHART.relative_to(CHART.parents[1])} -n {NAMESPACE} -f {vfile}")
    plane.helm(
        stack.dir / "helm",
        "install",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "--create-namespace",
        "-f",
        str(vfile),
    )

    kubelet = Kubelet(plane, stack, NAMESPACE, stack.dir / "pods", env, log=say)
    if agent_python:
        kubelet.python_for["agent"] = (agent_python, source_path())
    workloads = plane.get("-n", NAMESPACE, "deployments,daemonsets")["items"]
    by_comp = {
        w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: w
        for w in workloads
    }
    ds = by_comp["agent"]
    node_names = [f"gpu-node-{i + 1}" for i in range(nodes)]
    kubelet.create_nodes(
        node_names, ds["spec"]["template"]["spec"].get("nodeSelector") or {}, gpus_per_node
    )
    kubelet.create_nodes([CPU_NODE], {}, 0)
    ips = pod_network(stack.id, nodes + 1, [50051, 9091, 9090, 8080])
    stack.info.update(
        {"namespace": NAMESPACE, "podNetwork": ips, "kubeconfig": str(stack.kubeconfig)}
    )

    agents = [
        Pod(
            f"{ds['metadata']['name']}-{n}",
            "DaemonSet",
            ds["metadata"]["name"],
            n,
            ip,
            ds["spec"]["template"],
        )
        for n, ip in zip(node_names, ips, strict=False)
    ]
    say(f"starting {nodes} node agents ({gpus_per_node} simulated GPUs each, worker processes)")
    for a in agents:
        kubelet.run(a)
    gw = by_comp["gateway"]
    gateways = [
        Pod(
            f"{gw['metadata']['name']}-{k}",
            "Deployment",
            gw["metadata"]["name"],
            CPU_NODE,
            kubelet.host_ip,
            gw["spec"]["template"],
            port_overrides={"http": port} if k == 0 else {},
        )
        for k in range(int(gw["spec"].get("replicas", 1)))
    ]
    for g in gateways:
        kubelet.run(g)
    op = by_comp["operator"]
    operator = Pod(
        f"{op['metadata']['name']}-0",
        "Deployment",
        op["metadata"]["name"],
        CPU_NODE,
        ips[-1],
        op["spec"]["template"],
    )
    for a in agents:
        _wait(
            lambda a=a: _tcp_open(a.ip, 50051),
            f"agent {a.name} serving",
            240,
            f" (log: {stack.dir / 'pods' / a.name / 'log'})",
        )
        kubelet.mark_running(a)
    urls = [f"http://127.0.0.1:{g.ports['http']}" for g in gateways]
    for g, url in zip(gateways, urls, strict=True):
        _wait(
            lambda url=url: _http_ok(url + "/healthz"),
            f"gateway {g.name} ready",
            120,
            f" (log: {stack.dir / 'pods' / g.name / 'log'})",
        )
        kubelet.mark_running(g)
    endpoint_slices(plane, kubelet.ns, kubelet.pods.values())
    admin = [f"http://127.0.0.1:{g.ports['admin']}" for g in gateways]
    stack.info.update({"gateway": urls[0], "gatewayReplicas": urls, "gatewayAdmin": admin})
    stack.state = "running"
    stack.save()
    say(f"agents and gateways up in {time.monotonic() - t0:.0f}s")
    return Running(stack, plane, kubelet, agents, gateways, operator, urls)


def start_operator(run: Running, say: Callable[[str], None]) -> None:
    """Run (or re-run) the operator's pod; it registers the agents from their pods itself."""
    run.kubelet.run(run.operator)
    run.kubelet.mark_running(run.operator)
    workload_status(run.plane, run.kubelet.ns, run.kubelet.pods.values())


def stop_pod(run: Running, pod: Pod) -> None:
    recs = [p for p in run.stack.processes if p.name == pod.name]
    procs.stop(recs, timeout_s=20)
    run.stack.processes = [p for p in run.stack.processes if p.name != pod.name]
    run.stack.save()


def restart_agents(run: Running, say: Callable[[str], None]) -> None:
    """Fresh agent processes (empty GPUs) on the same pods, as after a node restart."""
    for a in run.agents:
        stop_pod(run, a)
    for a in run.agents:
        run.kubelet.run(a)
    for a in run.agents:
        _wait(lambda a=a: _tcp_open(a.ip, 50051), f"agent {a.name} serving", 240)
    say("agents restarted (all GPUs idle)")


# ---- down ----------------------------------------------------------------------------------------


def _remove_agent_memory(node_names: list[str]) -> None:
    """Simulated GPU memory of our agents left in /dev/shm by a SIGKILL (unlocked dirs only)."""
    for name in node_names:
        for d in Path("/dev/shm").glob(f"warmserve-{name}-*"):
            lock = d / ".owner"
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue  # a live agent's
            shutil.rmtree(d, ignore_errors=True)
            os.close(fd)


def down(directory: Path, say: Callable[[str], None]) -> int:
    """Stop everything ``stack.json`` records (and anything else carrying its marker)."""
    st = Stack.load(directory)
    if st is None:
        say(f"no warmserve stack recorded in {directory}: nothing to stop")
        return 0
    stopped = 0
    if st.up_pid != os.getpid() and procs.start_ticks(st.up_pid) is not None:
        cmd = Path(f"/proc/{st.up_pid}/cmdline").read_bytes().split(b"\0")
        if b"up" in cmd:
            say(f"stopping the running `warmserve up` (pid {st.up_pid})")
            with contextlib.suppress(ProcessLookupError):
                os.kill(st.up_pid, 15)
            for _ in range(150):
                if procs.start_ticks(st.up_pid) is None:
                    break
                time.sleep(0.1)
            st = Stack.load(directory) or st
    cp = {"etcd", "kube-apiserver"}
    pods = [p for p in st.processes if p.name not in cp]
    live = [p for p in st.processes if procs.alive(p)]
    killed = procs.stop(list(reversed(pods)), timeout_s=20)
    ControlPlane.stop(st.controlplane_dir)
    killed += procs.stop([p for p in st.processes if p.name in cp], timeout_s=15)
    stopped = len(live)
    leftovers = procs.kill_marked(st.id)
    _remove_agent_memory([f"gpu-node-{i + 1}" for i in range(16)])
    st.path.unlink(missing_ok=True)
    note = f"; needed SIGKILL: {', '.join(killed)}" if killed else ""
    extra = f"; {len(leftovers)} stray processes of the stack killed" if leftovers else ""
    say(f"warmserve down: stopped {stopped} processes (and their children){note}{extra}")
    remaining = procs.marked(st.id)
    if remaining:
        raise StackError(f"processes of the stack survived: {remaining}")
    return 0


def describe(run: Running) -> dict[str, Any]:
    return json.loads(json.dumps(run.stack.info))
