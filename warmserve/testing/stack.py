"""warmserve as the Helm chart wires it, on a real kube-apiserver, minus the container runtime:
node agents with simulated GPUs (``python -m warmserve_agent.testing``), the operator and gateway
replicas as local processes, each under its chart ServiceAccount's token (so a missing RBAC rule
fails), and the gateway's demand Service whose EndpointSlices list the gateway replicas (written
here, as the EndpointSlice controller would for the pods).

Used by the end-to-end tests (``tests/e2e``) and ``bench/gateway_bench.py`` (cold-start burst).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmserve.testing.k8s import host_ip
from warmserve.testing.procs import Procs

REPO = Path(__file__).resolve().parents[2]
DEMAND_SERVICE = "gw-demand"
WINDOW_S = 5.0  # the operator's window here (divides a day)


@dataclass
class GatewayProc:
    name: str
    api: str
    admin: str


class Stack:
    """Processes and objects of one warmserve installation in namespace ``ns``."""

    def __init__(self, plane: Any, ns: str, tmp: Path, procs: Procs) -> None:
        self.plane = plane
        self.ns = ns
        self.tmp = tmp
        self.procs = procs
        self.env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE")}
        self.gateways: dict[str, GatewayProc] = {}
        self.agents: dict[str, str] = {}
        self.ip = host_ip()
        self.op_kubeconfig: Path | None = None
        self.gw_kubeconfig: Path | None = None
        # the chart's <release>-demand-token: the gateways' /demand needs it from the operator
        self.demand_token = tmp / "demand-token"
        self.demand_token.write_text(os.urandom(24).hex())

    def kubectl(self, *args: str, **kw: Any) -> Any:
        return self.plane.kubectl(*args, **kw)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-n", self.ns, "-o", "json").stdout)

    # ---- cluster objects --------------------------------------------------------------------

    def install(self) -> None:
        """CRDs, the chart's operator and gateway ServiceAccounts + RBAC, the demand Service."""
        from warmserve.testing.k8s import apply_chart_gateway_rbac, apply_chart_operator_rbac

        self.kubectl("apply", "-f", str(REPO / "crds"))
        self.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s",
            "crd/modeldeployments.warmserve.io", "crd/gpunodes.warmserve.io",
            "crd/clusterkopfpeerings.kopf.dev",
        )  # fmt: skip
        release = f"e2e{self.ns[-8:]}"
        op_sa = apply_chart_operator_rbac(self.plane.helm, self.kubectl, self.ns, release)
        gw_sa = apply_chart_gateway_rbac(self.plane.helm, self.kubectl, self.ns, release)
        self.op_kubeconfig = self.plane.sa_kubeconfig(self.ns, op_sa)
        self.gw_kubeconfig = self.plane.sa_kubeconfig(self.ns, gw_sa)
        svc = {  # the chart's <release>-gateway-demand Service (headless)
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": DEMAND_SERVICE, "namespace": self.ns},
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "ports": [{"name": "admin", "port": 9092, "targetPort": "admin"}],
            },
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(svc))

    # ---- agents -----------------------------------------------------------------------------

    def start_agents(
        self,
        models: Path,
        nodes: dict[str, str],
        copy_gbps: float = 0.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        """One agent process per node (``{"node-a": "4x64MiB"}``), registered as GPUNodes;
        ``copy_gbps`` > 0 paces weight loads like a host-to-GPU link of that speed; ``extra``:
        more ``python -m warmserve_agent.testing`` flags (e.g. ``--metrics-port 0``)."""
        files = {}
        for node, gpus in nodes.items():
            files[node] = self.tmp / f"{node}.addr"
            self.procs.start(
                node,
                [
                    sys.executable, "-m", "warmserve_agent.testing",
                    "--models", str(models), "--gpus", gpus, "--node", node,
                    "--address-file", str(files[node]),
                    "--memory-dir", str(self.tmp / f"mem-{node}"),
                    "--sim-copy-gbps", str(copy_gbps), *extra,
                ],
                self.env,
            )  # fmt: skip
        for node, f in files.items():
            self.agents[f"{self.ns}-{node}"] = self.procs.wait_for(
                lambda f=f: f.exists() and f.read_text(), f"agent {node} up", 90, names=(node,)
            )
        items = [
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "GPUNode",
                "metadata": {"name": name},
                "spec": {"agentAddress": addr},
            }
            for name, addr in self.agents.items()
        ]
        self.kubectl(
            "apply", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )  # fmt: skip

    # ---- operator ---------------------------------------------------------------------------

    def start_operator(
        self,
        name: str,
        priority: int,
        *,
        poll_s: float = 5.0,
        window_s: float = WINDOW_S,
        extra: tuple[str, ...] = (),
    ) -> None:
        assert self.op_kubeconfig is not None
        self.procs.start(
            name,
            [
                sys.executable, "-m", "warmserve", "operator",
                "--window-seconds", str(window_s), "--poll-seconds", str(poll_s),
                "--predictor", "seasonal", "--peering", f"{self.ns}-peering",
                "--priority", str(priority), "--metrics-port", "0",
                "--scale-down-delay", "600", "--namespace", self.ns,
                "--gateway-service", f"{self.ns}/{DEMAND_SERVICE}",
                "--gateway-token-file", str(self.demand_token), *extra,
            ],
            {**self.env, "KUBECONFIG": str(self.op_kubeconfig)},
        )  # fmt: skip

    # ---- gateways ---------------------------------------------------------------------------

    def start_gateway(self, name: str, *extra: str) -> GatewayProc:
        """A gateway replica; its EndpointSlice in the demand Service is written once it serves."""
        assert self.gw_kubeconfig is not None
        addr = self.tmp / f"{name}.urls"
        addr.unlink(missing_ok=True)
        self.procs.start(
            name,
            [
                sys.executable, "-m", "warmserve", "gateway",
                "--port", "0", "--admin-port", "0", "--namespace", self.ns,
                "--anonymous-namespace", self.ns, "--demand-token-file", str(self.demand_token),
                "--replica", name, "--address-file", str(addr), "--drain-seconds", "1",
                # No Service endpoints to leave here: the default 5 s delay would outlast the
                # teardown's 3 s wait for SIGTERM and end every gateway with SIGKILL.
                "--drain-delay", "0.1", *extra,
            ],
            {**self.env, "KUBECONFIG": str(self.gw_kubeconfig)},
        )  # fmt: skip
        urls = json.loads(
            self.procs.wait_for(
                lambda: addr.exists() and addr.read_text(), f"gateway {name} up", 60, names=(name,)
            )
        )
        gw = GatewayProc(name, urls["api"], urls["admin"])
        self.procs.wait_for(
            lambda: _get_status(gw.api + "/healthz") == 200,
            f"gateway {name} ready (ModelDeployments listed)",
            60,
            names=(name,),
        )
        self._endpoint_slice(name, int(gw.admin.rsplit(":", 1)[1]))
        self.gateways[name] = gw
        return gw

    def _endpoint_slice(self, name: str, port: int) -> None:
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{DEMAND_SERVICE}-{name}",
                "namespace": self.ns,
                "labels": {"kubernetes.io/service-name": DEMAND_SERVICE},
            },
            "addressType": "IPv4",
            "ports": [{"name": "admin", "port": port, "protocol": "TCP"}],
            "endpoints": [
                {
                    "addresses": [self.ip],
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "name": name, "namespace": self.ns},
                }
            ],
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(body))

    def kill_gateway(self, name: str) -> None:
        """SIGKILL: the pod dies; its EndpointSlice entry stays until a controller would notice."""
        self.procs.kill(name, signal.SIGKILL)
        self.gateways.pop(name, None)

    def logs(self) -> str:
        return "\n".join(self.procs.log(n) for n in list(self.procs.procs))


def _get_status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def demand_of(admin_url: str, token_file: Path) -> dict[str, Any]:
    """A replica's /demand, read with the operator's token."""
    import urllib.request

    token = token_file.read_text().strip()
    req = urllib.request.Request(
        admin_url + "/demand", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def metric(admin_url: str, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{" + want + "}") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def now() -> float:
    return time.time()


def seed_history(kubectl: Any, ns: str, md: str, model: str, avg: float, peak: float) -> None:
    """A day and a bit of constant load, as if the operator had watched the model for a day.

    Stored where the operator keeps it: in its own namespace (here the same ``ns``), named by
    the deployment's UID."""
    import warmserve.api.history as history_io
    from warmserve.api.history import OWNER_LABEL, configmap_name
    from warmserve.control.history import LoadHistory

    uid = json.loads(kubectl("get", "wsmd", md, "-n", ns, "-o", "json").stdout)["metadata"]["uid"]
    h = LoadHistory(WINDOW_S)
    end = math.floor(time.time() / WINDOW_S)
    per_day = round(86400 / WINDOW_S)
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
