"""``warmserve up`` end to end, as CI runs it: a short replay (10
trace minutes at 20x: 45 s warm-up + 30 s measured, about 2 minutes with the last answers)
through the whole local stack on the real control plane; then ``warmserve down`` must leave no
process behind."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.local.up_support import warmserve
from warmserve.local import procs


def gateway_count(admin_url: str, code: str) -> float:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("warmserve_gateway_requests_total{") and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_up_replays_through_the_gateway_and_down_leaves_nothing(
    k8s_bin_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    port = procs.free_port("0.0.0.0")
    env = {**os.environ, "WARMSERVE_K8S_BIN": str(k8s_bin_dir)}
    env.pop("KUBECONFIG", None)
    stack: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        up = warmserve(
            "up",
            "--minutes",
            "10",
            "--plain",
            "--port",
            str(port),
            "--state-dir",
            str(state),
            env=env,
            timeout=720,
        )
        wall = time.monotonic() - t0
        print(up.stdout[-4000:])
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr
        stack = json.loads((state / "stack.json").read_text())
        (run_dir,) = sorted((state / "runs").iterdir())
        summary = json.loads((run_dir / "summary.json").read_text())
        results = [json.loads(x) for x in (run_dir / "requests-warmserve.jsonl").open()]
        for png in summary["plots"].values():
            assert Path(png).stat().st_size > 10_000

        # Requests went through the gateway: its own counters saw every answered one.
        ok = [r for r in results if r["outcome"] == "ok"]
        cancelled = [r for r in results if r["outcome"] == "cancelled"]
        assert len(ok) >= 100, len(ok)
        answered = sum(gateway_count(a, "200") for a in stack["info"]["gatewayAdmin"])
        assert len(ok) <= answered <= len(ok) + len(cancelled)
        # Zero requests dropped below the hold caps (a cap is 429 queue_full / 503 after
        # maxHoldSeconds; anything else is a drop).
        dropped = [r for r in results if r["outcome"] == "dropped"]
        assert dropped == [], dropped[:5]
        # At least one instance started as a prewarm hit (the operator's own count).
        kubeconfig = stack["info"]["kubeconfig"]
        kubectl = [str(k8s_bin_dir / "kubectl"), "--kubeconfig", kubeconfig]
        mds = json.loads(
            subprocess.run(
                [*kubectl, "get", "wsmd", "-o", "json"], capture_output=True, text=True, check=True
            ).stdout
        )["items"]
        hits = sum((md.get("status") or {}).get("prewarm", {}).get("hits", 0) for md in mds)
        assert hits >= 1, [md.get("status", {}).get("prewarm") for md in mds]
        assert summary["runs"]["warmserve"]["rows"][-1]["ok"] > 0
        # What the controllers would write (warmserve.local.workload_controllers): every
        # gateway replica is a ready endpoint of a Service, every workload reports ready pods.
        def get(*what: str) -> list[dict[str, Any]]:
            out = subprocess.run([*kubectl, "get", *what, "-o", "json"], capture_output=True,
                                 text=True, check=True).stdout
            return json.loads(out)["items"]

        slices = get("endpointslices", "-l", "endpointslice.kubernetes.io/managed-by=warmserve-up")
        served = {
            p["port"]
            for sl in slices
            if all(e["conditions"]["ready"] for e in sl["endpoints"])
            for p in sl["ports"]
        }
        gateway_ports = {int(u.rsplit(":", 1)[1]) for u in stack["info"]["gatewayReplicas"]}
        assert gateway_ports and gateway_ports <= served, (gateway_ports, served)
        workloads = get("deployments,daemonsets")
        assert {w["kind"] for w in workloads} == {"Deployment", "DaemonSet"}
        for w in workloads:
            status = w["status"]
            if w["kind"] == "Deployment":
                assert status.get("readyReplicas") == w["spec"]["replicas"], w["metadata"]
            else:
                assert status["numberReady"] == status["desiredNumberScheduled"] > 0, status

        # The agents ran as the chart runs them: no API token, only the operator's certificate
        # identity may call them (and it did: the replay above needed it).
        pods = {d.name: d for d in (state / "pods").iterdir() if (d / "argv").exists()}
        agents = [n for n in pods if "-agent-" in n]
        assert agents and len(agents) < len(pods), sorted(pods)
        for name, d in pods.items():
            has_token = (d / "serviceaccount" / "kubeconfig").exists()
            assert has_token == (name not in agents), name
        for name in agents:
            argv = (pods[name] / "argv").read_text().splitlines()
            assert [a for a in argv if a.startswith("--allow-client-id=CN=")], argv
        # `warmserve status` and kubectl work against it from another terminal.
        st = warmserve("status", env={**env, "KUBECONFIG": kubeconfig}, timeout=60)
        assert st.returncode == 0, st.stderr
        assert all(md["metadata"]["name"] in st.stdout for md in mds)
        # `up` refuses to start twice.
        again = warmserve(
            "up", "--port", str(procs.free_port()), "--state-dir", str(state), env=env
        )
        assert again.returncode == 2 and "already running" in again.stderr
        print(
            f"warmserve up wall time: {wall:.0f}s; requests {len(results)}, ok {len(ok)}, "
            f"hits {hits}; {summary['headline']}"
        )
    finally:
        down = warmserve("down", "--state-dir", str(state), env=env, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert stack, "the stack never started"
    assert procs.marked(stack["id"]) == []
    for rec in stack["processes"]:
        assert not procs.alive(procs.ProcRecord.from_json(rec)), rec
    assert procs.port_free("0.0.0.0", port)
    assert not (state / "stack.json").exists()
