"""Control-plane scale: the operator on a real kube-apiserver with 1,000 ModelDeployments.

    python bench/control_plane_bench.py [--models 1000] [--delete 100] [--nodes 4] [--gpus 8]
                                        [--poll 5] [--json bench/results/control_plane.json]

What it measures (issue 16, "done when" 3), on the real kube-apiserver + etcd that
``hack/k8s/build.sh`` builds, with the operator as its own process under the Helm chart's
ServiceAccount and RBAC:

1. **place**: ``--models`` ModelDeployments, each with a day of load history asking for one
   prewarm replica, exist when the operator starts; seconds until every status shows its
   replica resident (``Prewarmed=True``, one ready replica) — the goal is <= 30 s;
2. **delete**: ``--delete`` of them deleted at once; seconds until every object is gone (the
   finalizer removed its replica), and how many agent calls timed out — goals: <= 30 s, 0;
3. **new**: one more deployment created afterwards; seconds until its replica is resident, in
   polls — the goal is <= 2 polls (not the next window);
4. the operator's CPU seconds and peak memory (RSS) over the run.

The agents are simulated in the operator process (``tests/operator/operator_fakes.FakeAgent``,
the fake whose contract ``tests/operator/test_agent_contract.py`` checks against the real agent),
``--nodes`` x ``--gpus`` GPUs of 80 GiB, every model 1 GiB of 8 layers: the bench measures the
control plane (API, statuses, Events, the loop), not gRPC or weight loading.  Prints a table and
saves JSON.  Absolute times depend on the machine (2 shared cores here): compare runs on one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

W = 300.0  # the operator's default window: a replica that appears fast is not a window's doing

OPERATOR = """
import sys
sys.path[:0] = [{root!r}, {root!r} + "/tests/operator"]
from operator_fakes import FakeAgent
from warmserve.policy.cluster import GiB
import warmserve_operator.agents as agents
catalog = {{f"m-{{i:04d}}": (GiB, 8) for i in range({models} + 1)}}
fakes = {{
    f"bench-{{i}}": FakeAgent(f"bench-{{i}}", {gpus}, 80 * GiB, catalog) for i in range({nodes})
}}
_init = agents.AgentPool.__init__
def init(self, auth=None, factory=None):
    _init(self, auth, factory=lambda node, addr: fakes[node])
agents.AgentPool.__init__ = init
from warmserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak RSS bytes) of a live process, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(stat[11]) + int(stat[12])) / ticks
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return cpu, hwm


def _md(i: int, ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": f"m-{i:04d}", "namespace": ns},
        "spec": {"model": {"name": f"m-{i:04d}"}, "maxBatchSize": 4},
    }


def _history_cm(ns: str, uid: str, model: str) -> dict[str, Any]:
    import warmserve_operator.history as history_io

    from warmserve.control.history import LoadHistory

    h = LoadHistory(W)
    end = math.floor(time.time() / W)
    for i in range(end - 300, end):
        h.record(i, 1.0, 1.0)  # B = 4: one basic replica
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": history_io.configmap_name(uid),
            "namespace": ns,
            "labels": {
                "app.kubernetes.io/managed-by": "warmserve-operator",
                history_io.OWNER_LABEL: uid,
            },
        },
        "data": history_io.to_data(h, model),
    }


def _apply(plane: Any, items: list[dict[str, Any]], batch: int = 50) -> None:
    """Create objects in batches; a batch the (busy) API server times out is retried."""
    for k in range(0, len(items), batch):
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items[k : k + batch]})
        for attempt in range(5):
            proc = plane.kubectl(
                "apply", "--server-side", "-f", "-", input=body, timeout=300, check=False
            )
            if proc.returncode == 0:
                break
            print(f"  retrying a batch ({proc.stderr.strip()[:120]})", flush=True)
            time.sleep(2 * (attempt + 1))
        else:
            raise SystemExit(f"bench: cannot create objects: {proc.stderr.strip()}")


def _placed(plane: Any, ns: str, names: set[str]) -> int:
    out = plane.kubectl("get", "wsmd", "-n", ns, "-o", "json", timeout=120).stdout
    done = 0
    for md in json.loads(out)["items"]:
        if md["metadata"]["name"] not in names:
            continue
        st = md.get("status") or {}
        reps = st.get("prewarmedReplicas") or []
        conds = {c["type"]: c for c in st.get("conditions") or []}
        pre = conds.get("Prewarmed", {})
        if len(reps) == 1 and reps[0].get("state") == "ready" and pre.get("status") == "True":
            done += 1
    return done


def _wait(what: str, pred: Any, timeout: float, step: float = 0.5) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"bench: {what} not within {timeout:.0f} s")
        time.sleep(step)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--delete", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--poll", type=float, default=5.0)
    ap.add_argument("--json", default=str(ROOT / "bench/results/control_plane.json"))
    args = ap.parse_args(argv)
    if not 0 < args.delete <= args.models:
        ap.error("--delete must be in 1..--models")

    from k8s_support import ControlPlane, apply_chart_operator_rbac, ensure_binaries

    work = Path(tempfile.mkdtemp(prefix="cp-bench-"))
    print(f"control plane in {work} (building the binaries first if needed)", flush=True)
    plane = ControlPlane.start(work / "plane", bin_dir=ensure_binaries())
    op: subprocess.Popen[bytes] | None = None
    try:
        ns = plane.create_namespace("bench")
        plane.kubectl("apply", "-f", str(ROOT / "crds"))
        plane.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/modeldeployments.warmserve.io",
            "crd/gpunodes.warmserve.io",
        )
        sa = apply_chart_operator_rbac(plane.helm, plane.kubectl, ns, "bench")
        kubeconfig = plane.sa_kubeconfig(ns, sa)
        nodes = [
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "GPUNode",
                "metadata": {"name": f"bench-{i}"},
                "spec": {"agentAddress": f"127.0.0.1:{50000 + i}"},
            }
            for i in range(args.nodes)
        ]
        _apply(plane, nodes)
        t0 = time.monotonic()
        _apply(plane, [_md(i, ns) for i in range(args.models)])
        listed = json.loads(plane.kubectl("get", "wsmd", "-n", ns, "-o", "json").stdout)
        uids = {m["metadata"]["name"]: m["metadata"]["uid"] for m in listed["items"]}
        _apply(plane, [_history_cm(ns, uid, name) for name, uid in uids.items()])
        setup_s = time.monotonic() - t0
        print(f"{args.models} deployments + histories created in {setup_s:.1f} s", flush=True)

        log = work / "operator.log"
        env = {k: v for k, v in os.environ.items() if k != "POD_NAMESPACE"}
        env["KUBECONFIG"] = str(kubeconfig)
        script = OPERATOR.format(
            root=str(ROOT), models=args.models, gpus=args.gpus, nodes=args.nodes
        )
        t_start = time.monotonic()
        op = subprocess.Popen(
            [
                sys.executable,
                "-c",
                script,
                "operator",
                "--poll-seconds",
                str(args.poll),
                "--window-seconds",
                str(int(W)),
                "--metrics-port",
                "0",
                "--namespace",
                ns,
                "--peering",
                "bench",
                "--priority",
                "1",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        names = set(uids)
        place_s = _wait(
            "every replica placed", lambda: _placed(plane, ns, names) == len(names), 600, 1.0
        )
        cpu_place, _ = _proc_stats(op.pid)
        print(f"placed and reported in {place_s:.1f} s", flush=True)

        victims = [f"m-{i:04d}" for i in range(args.delete)]
        plane.kubectl("delete", "wsmd", "-n", ns, "--wait=false", *victims, timeout=300)

        def gone() -> bool:
            out = plane.kubectl("get", "wsmd", "-n", ns, "-o", "name", timeout=120).stdout
            left = {line.split("/")[-1] for line in out.split()}
            return not left & set(victims)

        delete_s = _wait("deletions", gone, 600, 0.5)
        print(f"{args.delete} deletions done in {delete_s:.1f} s", flush=True)

        new = f"m-{args.models:04d}"
        t_new = time.monotonic()
        _apply(plane, [_md(args.models, ns)])
        uid = json.loads(plane.kubectl("get", "wsmd", new, "-n", ns, "-o", "json").stdout)[
            "metadata"
        ]["uid"]
        _apply(plane, [_history_cm(ns, uid, new)])
        new_s = _wait("the new deployment's replica", lambda: _placed(plane, ns, {new}) == 1, 600)
        new_total = time.monotonic() - t_new
        cpu, rss = _proc_stats(op.pid)
        text = log.read_text(errors="replace")
        timeouts = text.count("event=action_error") + text.count("agent unreachable")
        wall = time.monotonic() - t_start
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                op.kill()
        plane.stop()

    rows = [
        (
            "deployments with a prewarm replica, placed + statuses correct",
            f"{place_s:.1f} s",
            "<= 30 s",
        ),
        (f"{args.delete} deletions finished", f"{delete_s:.1f} s", "<= 30 s"),
        ("agent calls timed out", str(timeouts), "0"),
        (
            "new deployment's replica resident",
            f"{new_total:.1f} s = {new_total / args.poll:.1f} polls",
            "<= 2 polls",
        ),
        ("operator CPU (whole run / placing)", f"{cpu:.1f} s / {cpu_place:.1f} s", "-"),
        ("operator peak memory (RSS)", f"{rss / 2**20:.0f} MiB", "-"),
    ]
    print()
    print(
        f"{args.models} ModelDeployments, {args.nodes} agents x {args.gpus} GPUs (simulated), "
        f"poll {args.poll:g} s, real kube-apiserver; operator wall {wall:.0f} s"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':>22}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:>22}  {goal}")
    result = {
        "models": args.models,
        "delete": args.delete,
        "nodes": args.nodes,
        "gpus": args.gpus,
        "poll_s": args.poll,
        "setup_s": setup_s,
        "place_s": place_s,
        "delete_s": delete_s,
        "agent_timeouts": timeouts,
        "new_replica_s": new_total,
        "new_replica_polls": new_total / args.poll,
        "new_after_history_s": new_s,
        "operator_cpu_s": cpu,
        "operator_cpu_place_s": cpu_place,
        "operator_peak_rss_bytes": rss,
        "wall_s": wall,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
