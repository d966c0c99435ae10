"""What the Deployment, DaemonSet and EndpointSlice controllers would write for the pods that
:mod:`warmserve.local.kubelet` runs as local processes (see its docstring): one EndpointSlice
per pod behind each Service that selects it (gateway pods; agents and the operator sit on
loopback addresses, which EndpointSlices refuse), and the workloads' status subresource.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable

from .controlplane import ControlPlane
from .kubelet import Pod


def endpoint_slices(plane: ControlPlane, ns: str, pods: Iterable[Pod]) -> None:
    """Write the EndpointSlices of the release's Services for the pods they select."""
    svcs = plane.get("-n", ns, "services")["items"]
    objs = []
    for svc in svcs:
        sel = svc["spec"].get("selector") or {}
        if not sel:
            continue
        name = svc["metadata"]["name"]
        for pod in pods:
            labels = pod.template["metadata"].get("labels") or {}
            if any(labels.get(k) != v for k, v in sel.items()):
                continue
            if ipaddress.ip_address(pod.ip).is_loopback:
                continue
            ports = []
            for sp in svc["spec"]["ports"]:
                target = sp.get("targetPort", sp["port"])
                port = pod.ports.get(str(target)) if isinstance(target, str) else int(target)
                if port is not None:
                    ports.append({"name": sp.get("name", ""), "port": port, "protocol": "TCP"})
            objs.append(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"{name}-{pod.name}"[:63],
                        "namespace": ns,
                        "labels": {
                            "kubernetes.io/service-name": name,
                            "endpointslice.kubernetes.io/managed-by": "warmserve-up",
                        },
                    },
                    "addressType": "IPv4",
                    "ports": ports,
                    "endpoints": [
                        {
                            "addresses": [pod.ip],
                            "conditions": {"ready": True},
                            "nodeName": pod.node,
                            "targetRef": {
                                "kind": "Pod",
                                "name": pod.name,
                                "namespace": ns,
                            },
                        }
                    ],
                }
            )
    if objs:
        plane.apply(objs)

def workload_status(plane: ControlPlane, ns: str, pods: Iterable[Pod]) -> None:
    """Deployment / DaemonSet status as their controllers would report the pods."""
    counts: dict[tuple[str, str], int] = {}
    for p in pods:
        counts[(p.owner_kind, p.owner)] = counts.get((p.owner_kind, p.owner), 0) + 1
    for (kind, name), n in counts.items():
        obj = plane.get("-n", ns, kind.lower(), name)
        gen = obj["metadata"].get("generation", 1)
        if kind == "Deployment":
            st = {
                "observedGeneration": gen,
                "replicas": n,
                "readyReplicas": n,
                "availableReplicas": n,
                "updatedReplicas": n,
            }
        else:
            st = {
                "observedGeneration": gen,
                "desiredNumberScheduled": n,
                "currentNumberScheduled": n,
                "numberReady": n,
                "numberAvailable": n,
                "updatedNumberScheduled": n,
                "numberMisscheduled": 0,
            }
        plane.kubectl(
            "-n",
            ns,
            "patch",
            kind.lower(),
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": st}),
        )
