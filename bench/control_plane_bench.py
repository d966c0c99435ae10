"""Control-plane scale: the operator on a real kube-apiserver with 1,000 ModelDeployments.

    python bench/control_plane_bench.py [--models 1000] [--delete 100] [--nodes 4] [--gpus 8]
                                        [--poll 5] [--json bench/results/control_plane.json]
    python bench/control_plane_bench.py --smoke      # seconds: tiny sizes, JSON to a temp dir

What it measures, on the real kube-apiserver + etcd that ``hack/k8s/build.sh`` builds, with the
operator as its own process under the Helm chart's ServiceAccount and RBAC:

1. **place**: ``--models`` ModelDeployments, each with a day of load history asking for one
   prewarm replica, exist when the operator starts; seconds until every status shows its
   replica resident (``Prewarmed=True``, one ready replica) — the goal is <= 30 s;
2. **delete**: ``--delete`` of them deleted at once; seconds until every object is gone (the
   finalizer removed its replica), and how many agent calls timed out — goals: <= 30 s, 0;
3. **new**: one more deployment created afterwards; seconds until its replica is resident, in
   polls — the goal is <= 2 polls (not the next window);
4. the operator's CPU seconds and peak memory (RSS) over the run.

The agents are simulated in the operator process (``python -m warmserve_operator.testing``:
the real operator whose agent pool reaches ``warmserve_operator.testing.FakeAgents``, the fake
whose contract ``tests/operator/test_agent_contract.py`` checks against the real agent),
``--nodes`` x ``--gpus`` GPUs of 80 GiB, every model 1 GiB of 8 layers: the bench measures the
control plane (API, statuses, Events, the loop), not gRPC or weight loading.  Prints a table and
saves JSON.  Absolute times depend on the machine (2 shared cores here): compare runs on one.
The operator or the control plane failing ends the bench at once with its last log lines
(status 1); SIGTERM/SIGINT stop everything it started.  (Over 400 lines: one script, its setup,
its measures and their table, read top to bottom.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from warmserve_operator.testing import FakeAgents

from warmserve.policy.cluster import GiB
from warmserve.testing.k8s import (
    ControlPlane,
    apply_chart_operator_rbac,
    ensure_binaries,
    stop_control_plane,
)
from warmserve.testing.procs import Procs, run_supervised
from warmserve.testing.smoke import add_smoke_flag, apply_smoke

ROOT = Path(__file__).resolve().parent.parent

W = 300.0  # the operator's default window: a replica that appears fast is not a window's doing
SMOKE = {"models": 6, "delete": 3, "nodes": 1, "gpus": 8, "poll": 2.0}


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


def _api_counts(plane: Any) -> dict[str, float]:
    """The API server's request counters (``apiserver_request_total`` by verb and resource,
    429s included) and API Priority and Fairness' rejections, from ``/metrics``."""
    out: dict[str, float] = {}
    for line in plane.get_raw("/metrics").decode().splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(
                kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(",")
            )
            lab = {k: v.strip('"') for k, v in labels.items()}
            if lab.get("verb") in ("WATCH", "CONNECT"):
                continue
            sub = f"/{lab['subresource']}" if lab.get("subresource") else ""
            key = f"{lab.get('verb')} {lab.get('resource')}{sub}"
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
            if lab.get("code") == "429":
                out["429 " + key] = out.get("429 " + key, 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("apiserver_flowcontrol_rejected_requests_total{"):
            pl = line.split('priority_level="', 1)[1].split('"', 1)[0]
            key = f"APF rejected ({pl})"
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v - before.get(k, 0)}


def _plane_cpu(plane: Any) -> dict[str, float]:
    """CPU seconds of the API server and etcd (their pid files are in the plane's workdir)."""
    out = {}
    for name in ("kube-apiserver", "etcd"):
        pid = int((plane.workdir / f"{name}.pid").read_text().split()[0])
        out[name] = _proc_stats(pid)[0]
    return out


def _md(i: int, ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": f"m-{i:04d}", "namespace": ns},
        "spec": {"model": {"name": f"m-{i:04d}"}, "maxBatchSize": 4},
    }


def _history_cm(ns: str, uid: str, model: str) -> dict[str, Any]:
    import warmserve.api.history as history_io
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


def _is_placed(md: dict[str, Any]) -> bool:
    st = md.get("status") or {}
    reps = st.get("prewarmedReplicas") or []
    conds = {c["type"]: c for c in st.get("conditions") or []}
    pre = conds.get("Prewarmed", {})
    return len(reps) == 1 and reps[0].get("state") == "ready" and pre.get("status") == "True"


class Tracker:
    """Which ModelDeployments of a namespace exist and are placed, from one watch stream (polling
    ``kubectl get`` of 1,000 objects every second loaded the API server the bench measures)."""

    def __init__(self, kubeconfig: Path, ns: str) -> None:
        import threading

        from kubernetes import client, config

        self.api = client.CustomObjectsApi(config.new_client_from_config(str(kubeconfig)))
        self.ns = ns
        self.placed: dict[str, bool] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._guarded, daemon=True)
        self.thread.start()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # read by check(): the bench ends at once, not at a timeout
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the bench's watch stream failed: {self.error!r}")

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        args = ("warmserve.io", "v1alpha1", self.ns, "modeldeployments")
        while not self.stopped.is_set():
            listed = self.api.list_namespaced_custom_object(*args)
            with self.lock:
                self.placed = {m["metadata"]["name"]: _is_placed(m) for m in listed["items"]}
            rv = listed["metadata"]["resourceVersion"]
            try:
                for ev in watch.Watch().stream(
                    self.api.list_namespaced_custom_object,
                    *args,
                    resource_version=rv,
                    timeout_seconds=30,
                ):
                    obj, name = ev["object"], ev["object"]["metadata"]["name"]
                    with self.lock:
                        if ev["type"] == "DELETED":
                            self.placed.pop(name, None)
                        elif ev["type"] in ("ADDED", "MODIFIED"):
                            self.placed[name] = _is_placed(obj)
                    if self.stopped.is_set():
                        return
            except ApiException as exc:
                if exc.status != 410:  # expired: list again
                    raise
            except Exception:
                if self.stopped.is_set():  # the control plane stopped under the stream
                    return
                raise

    def count(self, names: set[str]) -> int:
        with self.lock:
            return sum(1 for n in names if self.placed.get(n))

    def present(self) -> set[str]:
        with self.lock:
            return set(self.placed)


def _wait(
    procs: Procs, what: str, pred: Any, timeout: float, step: float = 0.5, fatal: bool = True
) -> float:
    """Seconds until ``pred()``; past ``timeout`` the bench stops (``fatal``) or the measure
    reads ``inf`` and the table says so.  A child or the control plane failing ends it at once
    (:meth:`Procs.check`)."""
    t0 = time.monotonic()
    while True:
        procs.check()
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            if not fatal:
                print(f"bench: {what} not within {timeout:.0f} s", flush=True)
                return math.inf
            raise TimeoutError(f"{what} not within {timeout:.0f} s")
        time.sleep(step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--delete", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--poll", type=float, default=5.0)
    ap.add_argument("--json", help="result file (default: bench/results/control_plane.json)")
    add_smoke_flag(ap, SMOKE, "any unmet wait is an error")
    args = ap.parse_args(argv)
    apply_smoke(args, SMOKE, {"json": str(ROOT / "bench/results/control_plane.json")})
    if not 0 < args.delete <= args.models:
        ap.error("--delete must be in 1..--models")
    return run_supervised(lambda: _run(args), "control_plane_bench")


def _run(args: argparse.Namespace) -> int:
    limit = 120.0 if args.smoke else 600.0  # a wait's bound; a failing child ends it at once
    load0 = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="cp-bench-"))
    print(f"control plane in {work / 'plane'} (building the binaries first if needed)", flush=True)
    procs = Procs(work)
    tracker: Tracker | None = None
    try:
        plane = ControlPlane.start(work / "plane", bin_dir=ensure_binaries())
        procs.also_check(plane.check)
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

        env = {k: v for k, v in os.environ.items() if k != "POD_NAMESPACE"}
        env["KUBECONFIG"] = str(kubeconfig)
        agents = work / "agents.json"
        agents.write_text(
            FakeAgents(
                {f"bench-{i}": (args.gpus, 80 * GiB) for i in range(args.nodes)},
                {f"m-{i:04d}": (GiB, 8) for i in range(args.models + 1)},
            ).to_json()
        )
        tracker = Tracker(plane.kubeconfig, ns)
        procs.also_check(tracker.check)
        api0 = _api_counts(plane)
        plane_cpu0 = _plane_cpu(plane)
        t_start = time.monotonic()
        op = procs.start(
            "operator",
            [
                sys.executable, "-m", "warmserve_operator.testing",
                "--agents", str(agents),
                "--", "--poll-seconds", str(args.poll), "--window-seconds", str(int(W)),
                "--metrics-port", "0", "--namespace", ns, "--peering", "bench", "--priority", "1",
            ],
            env,
        )  # fmt: skip
        log = work / "operator.log"
        print(f"operator started (pid {op.pid}, log {log})", flush=True)
        names = set(uids)
        place_s = _wait(
            procs, "every replica placed", lambda: tracker.count(names) == len(names), limit, 0.2
        )
        cpu_place, _ = _proc_stats(op.pid)
        api_place = _diff(_api_counts(plane), api0)
        plane_cpu_place = {k: v - plane_cpu0[k] for k, v in _plane_cpu(plane).items()}
        print(f"placed and reported in {place_s:.1f} s", flush=True)

        victims = [f"m-{i:04d}" for i in range(args.delete)]
        t_del = time.monotonic()  # kubectl's 100 DELETEs take a while on a busy machine
        plane.kubectl("delete", "wsmd", "-n", ns, "--wait=false", *victims, timeout=300)

        _wait(procs, "deletions", lambda: not tracker.present() & set(victims), limit, 0.2)
        delete_s = time.monotonic() - t_del
        print(f"{args.delete} deletions done in {delete_s:.1f} s", flush=True)

        new = f"m-{args.models:04d}"
        t_new = time.monotonic()
        # Its history right after it (one API round trip, not two kubectl runs): the operator
        # reads a deployment's stored history once, when it first sees the deployment.
        created = tracker.api.create_namespaced_custom_object(
            "warmserve.io", "v1alpha1", ns, "modeldeployments", _md(args.models, ns)
        )
        from kubernetes import client

        client.CoreV1Api(tracker.api.api_client).create_namespaced_config_map(
            ns, _history_cm(ns, created["metadata"]["uid"], new)
        )
        new_s = _wait(
            procs,
            "the new deployment's replica",
            lambda: tracker.count({new}) == 1,
            120,
            0.2,
            fatal=args.smoke,
        )
        new_total = time.monotonic() - t_new if math.isfinite(new_s) else math.inf
        cpu, rss = _proc_stats(op.pid)
        text = log.read_text(errors="replace")
        timeouts = text.count("event=action_error") + text.count("agent unreachable")
        wall = time.monotonic() - t_start
    finally:
        if tracker is not None:
            tracker.stopped.set()
        procs.stop_all(grace=20)
        stop_control_plane(work / "plane")

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
        (
            "kube-apiserver / etcd CPU while placing",
            f"{plane_cpu_place['kube-apiserver']:.1f} s / {plane_cpu_place['etcd']:.1f} s",
            "-",
        ),
        ("load average (1 min) at start / end", f"{load0:.1f} / {os.getloadavg()[0]:.1f}", "-"),
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
    print("\nAPI requests while placing (all clients; WATCH not counted):")
    for key, n in api_place.items():
        print(f"  {key:<50} {n:>7}")
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
        "api_requests_placing": api_place,
        "plane_cpu_place_s": plane_cpu_place,
        "load_avg_1m": [load0, os.getloadavg()[0]],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
