"""``warmserve status`` (also ``kubectl warmserve status``): the cluster at a glance.

Reads the GPUNode and ModelDeployment custom resources (their ``status`` is what the operator
mirrored from the agents and decided), so it needs only read access to the API, no gRPC.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from warmserve.api.crd import GROUP, VERSION  # the CRDs' one home
from warmserve.textfmt import columns
from warmserve.units import format_size


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="show GPU nodes, workers and models (prediction vs load, instances, prewarm)",
        description=(
            "Per node and GPU: the worker state and the models resident or serving; per model: "
            "predicted versus observed load, instances, prewarmed replicas and the prewarm hit "
            "ratio. Reads the GPUNode and ModelDeployment resources the operator keeps up to "
            "date. Also available as `kubectl warmserve status`."
        ),
    )
    p.add_argument(
        "-n",
        "--namespace",
        default=None,
        help="only ModelDeployments of this namespace (default: all namespaces)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG)")
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.set_defaults(func=run)


def _client(kubeconfig: str | None, context: str | None) -> Any:
    from kubernetes import client, config

    from warmserve.cli import CliError

    try:
        # $KUBECONFIG read now, not at import time (the client caches its default path).
        config.load_kube_config(
            config_file=kubeconfig or os.environ.get("KUBECONFIG") or None, context=context
        )
    except (config.ConfigException, FileNotFoundError, TypeError) as exc:
        if kubeconfig or context:
            raise CliError(f"cannot use kubeconfig {kubeconfig or ''}: {exc}") from exc
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise CliError(
                f"no Kubernetes cluster configured (kubeconfig: {exc}; not running in a pod); "
                "set KUBECONFIG or pass --kubeconfig"
            ) from None
    return client.CustomObjectsApi()


def fetch(api: Any, namespace: str | None) -> dict[str, list[dict[str, Any]]]:
    """GPUNodes and ModelDeployments as the API returns them."""
    from kubernetes.client import ApiException
    from urllib3.exceptions import HTTPError

    from warmserve.cli import CliError

    try:
        nodes = api.list_cluster_custom_object(GROUP, VERSION, "gpunodes")["items"]
        if namespace:
            mds = api.list_namespaced_custom_object(GROUP, VERSION, namespace, "modeldeployments")
        else:
            mds = api.list_cluster_custom_object(GROUP, VERSION, "modeldeployments")
    except ApiException as exc:
        if exc.status == 404:
            raise CliError("the warmserve CRDs are not installed (kubectl apply -f crds/)") from exc
        raise CliError(f"the API server refused: {exc.status} {exc.reason}") from exc
    except HTTPError as exc:
        raise CliError(f"cannot reach the API server: {exc}") from exc
    return {"nodes": nodes, "models": mds["items"]}


def _gib(n: Any) -> str:
    if n is None:
        return "-"
    n = int(n)
    return f"{n / 1024**3:.1f}Gi" if n >= 1024**3 or n == 0 else f"{n / 1024**2:.0f}Mi"


def _num(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1f}"


def _cond(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def summarize(data: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The machine-readable view (``--json``), also what the table is printed from."""
    nodes = []
    for n in sorted(data["nodes"], key=lambda o: o["metadata"]["name"]):
        st = n.get("status") or {}
        by_gpu: dict[int, str] = {}
        for inst in st.get("instances") or []:
            for g in inst.get("gpus") or []:
                by_gpu[g] = (
                    f"{inst.get('model')} ({inst.get('phase')}, {inst.get('running', 0)} "
                    f"in flight{', hit' if inst.get('prewarmHit') else ''})"
                )
        gpus = []
        for g in st.get("gpus") or []:
            gpus.append(
                {
                    "index": g.get("index"),
                    "state": g.get("state"),
                    "memoryBytes": g.get("memoryBytes"),
                    "freeBytes": g.get("freeBytes"),
                    "serving": by_gpu.get(g.get("index"), ""),
                    "resident": [
                        {
                            "model": s.get("model"),
                            "layers": s.get("layersResident"),
                            "layersTotal": s.get("layersTotal"),
                            "state": s.get("state"),
                        }
                        for s in g.get("slots") or []
                        if s.get("state") != "active"
                    ],
                }
            )
        nodes.append(
            {
                "name": n["metadata"]["name"],
                "address": (n.get("spec") or {}).get("agentAddress"),
                "reachable": _cond(st, "Reachable").get("status", "Unknown"),
                "gpus": gpus,
                "store": st.get("store") or {},
                "fetches": [
                    {
                        k: f.get(k)
                        for k in (
                            "model",
                            "source",
                            "state",
                            "bytesDone",
                            "bytesTotal",
                            "bytesPerSecond",
                            "etaSeconds",
                            "attempt",
                            "message",
                        )
                    }
                    for f in st.get("fetches") or []
                ],
            }
        )
    models = []
    for m in sorted(
        data["models"], key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"])
    ):
        st = m.get("status") or {}
        spec = m.get("spec") or {}
        load = st.get("load") or {}
        pre = st.get("prewarm") or {}
        problems = [
            {"type": c.get("type"), "reason": c.get("reason"), "message": c.get("message")}
            for c in st.get("conditions") or []
            if (c.get("type") == "Degraded" and c.get("status") == "True")
            or (c.get("type") == "Prewarmed" and c.get("reason") == "Unplaced")
        ]
        models.append(
            {
                "name": f"{m['metadata']['namespace']}/{m['metadata']['name']}",
                "model": (spec.get("model") or {}).get("name"),
                "tp": spec.get("tensorParallel", 1),
                "predicted": {
                    "avg": load.get("predictedAverage"),
                    "peak": load.get("predictedPeak"),
                },
                "observed": {"avg": load.get("observedAverage"), "peak": load.get("observedPeak")},
                "instances": [
                    {
                        "node": i.get("node"),
                        "gpus": i.get("gpus"),
                        "phase": i.get("phase"),
                        "running": i.get("running"),
                        "endpoint": i.get("endpoint"),
                    }
                    for i in st.get("instances") or []
                ],
                "prewarmed": [
                    {
                        "node": r.get("node"),
                        "gpus": r.get("gpus"),
                        "kind": r.get("kind"),
                        "score": r.get("score"),
                        "layers": r.get("layersResident"),
                        "state": r.get("state"),
                    }
                    for r in st.get("prewarmedReplicas") or []
                ],
                "hits": pre.get("hits", 0),
                "misses": pre.get("misses", 0),
                "hitRatio": pre.get("hitRatio"),
                "ready": _cond(st, "Ready").get("status", "Unknown"),
                "problems": problems,
            }
        )
    return {"nodes": nodes, "models": models}



def render(view: Mapping[str, Any]) -> str:
    out = []
    rows = [["NODE", "REACHABLE", "GPU", "STATE", "FREE", "SERVING", "RESIDENT (layers)"]]
    for n in view["nodes"]:
        first = True
        for g in n["gpus"] or [{}]:
            resident = ", ".join(
                f"{s['model']}[{s['layers']}/{s['layersTotal']}]"
                + ("" if s.get("state") == "ready" else f" {s.get('state')}")
                for s in g.get("resident", [])
            )
            rows.append(
                [
                    n["name"] if first else "",
                    n["reachable"] if first else "",
                    str(g.get("index", "-")),
                    str(g.get("state", "-")),
                    _gib(g.get("freeBytes")),
                    g.get("serving") or "-",
                    resident or "-",
                ]
            )
            first = False
    out.append(columns(rows))
    fetches = [(n["name"], f) for n in view["nodes"] for f in n.get("fetches") or []]
    if fetches:
        rows = [["NODE", "FETCHING", "FROM", "STATE", "PROGRESS", "RATE", "ETA", "TRY"]]
        for node, f in fetches:
            done, total = f.get("bytesDone") or 0, f.get("bytesTotal") or 0
            pct = f" {100 * done / total:.0f}%" if total else ""
            eta = f.get("etaSeconds") or 0
            rows.append(
                [
                    node,
                    str(f.get("model")),
                    str(f.get("source")),
                    str(f.get("state")) + (f" ({f['message']})" if f.get("message") else ""),
                    f"{format_size(done)}/{format_size(total)}{pct}",
                    f"{format_size(f.get('bytesPerSecond') or 0)}/s",
                    f"{eta:.0f}s" if eta and f.get("state") == "downloading" else "-",
                    str(f.get("attempt") or "-"),
                ]
            )
        out += ["", columns(rows)]
    rows = [
        [
            "MODELDEPLOYMENT",
            "MODEL",
            "TP",
            "PREDICTED avg/peak",
            "OBSERVED avg/peak",
            "INSTANCES",
            "PREWARMED",
            "HITS",
            "READY",
        ]
    ]
    for m in view["models"]:
        inst = (
            ", ".join(
                f"{i['node']}:{i['gpus']}" + ("" if i["phase"] == "serving" else f" {i['phase']}")
                for i in m["instances"]
            )
            or "0"
        )
        pre = ", ".join(f"{r['node']}:{r['gpus']} {r['kind']}" for r in m["prewarmed"]) or "0"
        ratio = "-" if m["hitRatio"] is None else f"{100 * m['hitRatio']:.0f}%"
        rows.append(
            [
                m["name"],
                str(m["model"]),
                str(m["tp"]),
                f"{_num(m['predicted']['avg'])}/{_num(m['predicted']['peak'])}",
                f"{_num(m['observed']['avg'])}/{_num(m['observed']['peak'])}",
                inst,
                pre,
                f"{ratio} ({m['hits']}/{m['hits'] + m['misses']})",
                m["ready"],
            ]
        )
    out.append("")
    out.append(columns(rows))
    problems = [(m["name"], p) for m in view["models"] for p in m["problems"]]
    if problems:
        out.append("")
        for name, p in problems:
            out.append(f"! {name}: {p['type']} {p['reason']}: {p['message']}")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    api = _client(args.kubeconfig, args.context)
    view = summarize(fetch(api, args.namespace))
    if args.json:
        json.dump(view, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(view))
    return 0


def kubectl_main() -> None:
    """Entry point of the ``kubectl-warmserve`` plugin: ``kubectl warmserve status ...``."""
    from warmserve.cli import main

    sys.exit(main(sys.argv[1:]))
