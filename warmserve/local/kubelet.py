"""The chart's pods as local processes: what a kubelet (and the Deployment, DaemonSet and
EndpointSlice controllers) would do, for the three workloads of ``helm/warmserve``.

``helm install`` puts the chart's Deployments and DaemonSet into the API server like on any
cluster; nothing runs them here (no kubelet, no container runtime).  This module reads their pod
templates back from the API and, per pod:

* creates the Pod object (bound to its node) and, once the process runs, its status
  (``Running``, ready, ``podIP``) — so the operator's agent discovery (it lists the agent pods)
  works unchanged, and ``kubectl get pods`` shows them;
* runs the container's ``command`` + ``args`` with the template's environment: ``value`` and
  downward-API ``fieldRef`` variables (``POD_IP``, ``NODE_NAME``, ``POD_NAMESPACE``,
  ``POD_NAME``), ``$(VAR)`` expanded in the arguments as the kubelet does;
* mounts volumes as directories: Secrets are written out (the chart's TLS certificates),
  ``hostPath`` is used as is (the model cache), ``emptyDir`` is a fresh directory, except
  ``/dev/shm``, which stays the host's (the agents' simulated GPU memory lives there);
* gives the process its ServiceAccount's identity: a TokenRequest token in a kubeconfig
  (``KUBECONFIG``), so it has exactly the chart's RBAC, no more; none where the pod sets
  ``automountServiceAccountToken: false`` (the agents).

Networking, the one translation: pods have no network namespace here, so each gets an
address of its own.  Agents and the operator get a loopback address of their own
(``127.X.0.N``): the chart's ports stay as they are, ``0.0.0.0`` in their arguments (bind
every interface of the pod) becomes that address, and the operator dials every agent at
``podIP:50051`` exactly as in a cluster.  Gateway pods are listed in EndpointSlices, which
refuse loopback addresses, so they use the host's address and the host's ports: their
``--port`` / ``--admin-port`` become free ports (replica 0 serves the API on ``--port`` of
``warmserve up``, 8000 by default).  Then the EndpointSlices of the chart's Services are
written as the EndpointSlice controller would (one per pod, since their ports differ;
:mod:`warmserve.local.workload_controllers`).
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .controlplane import ControlPlane
from .procs import MARKER_ENV, ProcRecord, free_port, spawn
from .state import Stack, StackError

COMPONENT = "app.kubernetes.io/component"


@dataclass
class Pod:
    """One pod to run: where, as what, and with which (re-mapped) ports."""

    name: str
    owner_kind: str
    owner: str
    node: str
    ip: str
    template: dict[str, Any]
    port_overrides: dict[str, int] = field(default_factory=dict)  # container port name -> port
    ports: dict[str, int] = field(default_factory=dict)  # resolved container ports by name

    @property
    def component(self) -> str:
        return str(self.template["metadata"]["labels"].get(COMPONENT, ""))


def host_ip() -> str:
    """This machine's non-loopback IPv4 address (EndpointSlices refuse loopback ones)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("198.51.100.1", 9))  # no packet is sent: this only picks the route
        ip = str(s.getsockname()[0])
    if ip.startswith("127."):
        ip = socket.gethostbyname(socket.gethostname())
    if ip.startswith("127."):
        raise StackError("this machine has no non-loopback IPv4 address for the gateway pods")
    return ip


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$(VAR)`` stays literal, unknown names stay)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(0)[1:]
        return env.get(m.group(2), m.group(0))

    return re.sub(r"(\$)?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def translate_arg(
    arg: str, pod_ip: str, mounts: Mapping[str, str], remap: Mapping[str, str]
) -> str:
    """One container argument as the local process needs it: mount paths -> local directories,
    ``0.0.0.0`` (every interface of the pod) -> the pod's address, ``--flag=PORT`` of a
    re-mapped container port -> its local port."""
    moved = {m: d for m, d in mounts.items() if m != d}
    if moved:  # one pass, longest mount first, so a replaced path is never matched again
        alt = "|".join(re.escape(m) for m in sorted(moved, key=len, reverse=True))
        arg = re.sub(rf"(?<![\w/])({alt})(?=/|$)", lambda x: moved[x.group(1)], arg)
    arg = arg.replace("0.0.0.0", pod_ip)
    m = re.fullmatch(r"(--[\w-]+)=(\d+)", arg)
    if m and m.group(2) in remap:
        arg = f"{m.group(1)}={remap[m.group(2)]}"
    return arg


class Kubelet:
    """Runs pods of the release in ``namespace``; records every process in ``stack``."""

    def __init__(
        self,
        plane: ControlPlane,
        stack: Stack,
        namespace: str,
        pods_dir: Path,
        env: Mapping[str, str],
        log: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.plane = plane
        self.stack = stack
        self.ns = namespace
        self.dir = pods_dir
        self.env = dict(env)
        self.log = log
        self.pods: dict[str, Pod] = {}
        self.host_ip = host_ip()
        # The image of a component, where it is not this python: its interpreter and the
        # PYTHONPATH that finds the checkout (the agents under --engine vllm: realengine.py).
        self.python_for: dict[str, tuple[str, str]] = {}

    # ---- nodes ------------------------------------------------------------------------------

    def create_nodes(self, names: list[str], labels: Mapping[str, str], gpus: int) -> None:
        cap = {"cpu": "64", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
        self.plane.apply(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": n,
                        "labels": {"kubernetes.io/hostname": n, **labels},
                    },
                    "status": {"capacity": cap, "allocatable": cap},
                }
                for n in names
            ]
        )

    # ---- pods -------------------------------------------------------------------------------

    def run(self, pod: Pod) -> ProcRecord:
        """Create the Pod, start its container as a process, mark it Running."""
        spec = pod.template["spec"]
        (c,) = spec["containers"]  # the chart's pods have one container each
        for p in c.get("ports") or []:
            name, port = p.get("name", str(p["containerPort"])), int(p["containerPort"])
            if name in pod.port_overrides:
                port = pod.port_overrides[name]
            elif not ipaddress.ip_address(pod.ip).is_loopback:  # shared host address
                port = free_port("0.0.0.0")
            pod.ports[name] = port
        remap = {
            str(p["containerPort"]): str(pod.ports[p.get("name", str(p["containerPort"]))])
            for p in c.get("ports") or []
        }
        self._create_pod_object(pod, c)
        pdir = self.dir / pod.name
        mounts = self._volumes(pod, pdir, spec, c)
        env = self._env(pod, c)
        component = pod.template["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        python, pythonpath = self.python_for.get(str(component), (sys.executable, ""))
        argv = [python, "-m", "warmserve"] if c["command"] == ["warmserve"] else list(c["command"])
        for arg in c.get("args") or []:
            argv.append(translate_arg(_expand(str(arg), env), pod.ip, mounts, remap))
        proc_env = {**self.env, **env}
        if pythonpath:
            proc_env["PYTHONPATH"] = pythonpath
        if spec.get("automountServiceAccountToken", True):  # as the kubelet: no token if off
            sa = spec.get("serviceAccountName", "default")
            kcfg = self.plane.kubeconfig_for(
                self.plane.token(self.ns, sa), self.ns, pdir / "serviceaccount" / "kubeconfig"
            )
            proc_env["KUBECONFIG"] = str(kcfg)
        (pdir / "argv").write_text("\n".join(argv) + "\n")
        _, rec = spawn(pod.name, argv, env=proc_env, cwd=pdir, log=pdir / "log")
        self.stack.add(rec)
        self.pods[pod.name] = pod
        self.log(f"pod {pod.name}: pid {rec.pid}, {pod.ip} {_ports_text(pod)}")
        return rec

    def _create_pod_object(self, pod: Pod, container: dict[str, Any]) -> None:
        spec = {k: v for k, v in pod.template["spec"].items() if k not in ("affinity",)}
        c = dict(container)
        c["ports"] = [
            {**p, "containerPort": pod.ports[p.get("name", str(p["containerPort"]))]}
            for p in container.get("ports") or []
        ]
        spec = {**spec, "containers": [c], "nodeName": pod.node}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": self.ns,
                "labels": pod.template["metadata"].get("labels") or {},
                "annotations": {
                    **(pod.template["metadata"].get("annotations") or {}),
                    "warmserve.io/run-by": "warmserve up (a local process; logs in "
                    f"{self.dir / pod.name / 'log'})",
                },
            },
            "spec": spec,
        }
        self.plane.apply([body])

    def mark_running(self, pod: Pod, ready: bool = True) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        rec = next(p for p in self.stack.processes if p.name == pod.name)
        status = {
            "phase": "Running",
            "hostIP": self.host_ip,
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "startTime": now,
            "conditions": [
                {"type": t, "status": "True" if ready else "False", "lastTransitionTime": now}
                for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
            ],
            "containerStatuses": [
                {
                    "name": pod.template["spec"]["containers"][0]["name"],
                    "ready": ready,
                    "started": True,
                    "restartCount": 0,
                    "image": pod.template["spec"]["containers"][0]["image"],
                    "imageID": "",
                    "containerID": f"local://{rec.pid}",
                    "state": {"running": {"startedAt": now}},
                }
            ],
        }
        import json

        self.plane.kubectl(
            "-n",
            self.ns,
            "patch",
            "pod",
            pod.name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )

    def _volumes(
        self, pod: Pod, pdir: Path, spec: dict[str, Any], c: dict[str, Any]
    ) -> dict[str, str]:
        """mountPath -> local directory."""
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        out: dict[str, str] = {}
        for m in c.get("volumeMounts") or []:
            v = vols[m["name"]]
            path = m["mountPath"]
            if "secret" in v:
                d = pdir / "volumes" / m["name"]
                d.mkdir(parents=True, exist_ok=True)
                secret = self.plane.get("-n", self.ns, "secret", v["secret"]["secretName"])
                for key, b64 in (secret.get("data") or {}).items():
                    f = d / key
                    f.write_bytes(base64.b64decode(b64))
                    f.chmod(0o600)
                out[path] = str(d)
            elif "hostPath" in v:
                out[path] = v["hostPath"]["path"]
            elif path == "/dev/shm":
                out[path] = "/dev/shm"
            else:
                d = pdir / "volumes" / m["name"]
                d.mkdir(parents=True, exist_ok=True)
                out[path] = str(d)
        return out

    def _env(self, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": self.ns,
            "spec.nodeName": pod.node,
            "status.podIP": pod.ip,
            "status.hostIP": self.host_ip,
        }
        env: dict[str, str] = {}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = _expand(str(e["value"]), env)
            elif "fieldRef" in (e.get("valueFrom") or {}):
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                if path not in fields:
                    raise StackError(f"pod {pod.name}: env {e['name']} uses unsupported {path}")
                env[e["name"]] = fields[path]
            else:
                raise StackError(f"pod {pod.name}: env {e['name']} has an unsupported source")
        return env


def _ports_text(pod: Pod) -> str:
    return " ".join(f"{k}={v}" for k, v in pod.ports.items())


def pod_network(stack_id: str, count: int, ports: list[int]) -> list[str]:
    """``count`` loopback addresses ``127.X.0.N`` on which ``ports`` are free (X from the id)."""
    from .procs import port_free

    seed = int(stack_id[:6], 16)
    for attempt in range(40):
        x = 64 + (seed + attempt * 37) % 190
        ips = [f"127.{x}.0.{n + 2}" for n in range(count)]
        if all(port_free(ip, p) for ip in ips for p in ports):
            return ips
    raise StackError("no free loopback address range for the pods (127.64-253.0.x all busy)")


def marker_env(stack: Stack) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "POD_"))}
    env[MARKER_ENV] = stack.id
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env
