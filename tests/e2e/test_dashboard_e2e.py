"""The chart's Grafana dashboard against a real Prometheus: no dead panel.

A local installation as the chart wires it (tests/e2e/gateway_stack.py: real kube-apiserver, the
operator and a gateway under their chart ServiceAccounts, two agents with simulated GPUs, a model
fetched from a local Hub-protocol server) is driven through what the panels show — a forecast
and prewarmed replicas, a cold start, requests held at the gateway until a prewarm hit serves
them (streamed and whole answers under two API keys: the token panels), a model download —
while Prometheus (built from the Go module proxy, tests/e2e/dashboard_support.py) scrapes the
operator's, the agents' and the gateway's /metrics every second.  Then every query of every
panel (Grafana macros filled in as Grafana would) must return finite data over the test's range.

``WARMSERVE_DASHBOARD_PNG=docs/dashboard.png WARMSERVE_DASHBOARD_SECONDS=150 pytest
tests/e2e/test_dashboard_e2e.py`` also draws the dashboard from the same queries (matplotlib) into
that file, after letting load come and go for that many more seconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from warmserve_agent.testing import write_model

from tests.e2e.dashboard_support import (
    finite_points,
    free_port,
    panels,
    promql,
    render_png,
    start_prometheus,
)
from tests.e2e.e2e_support import REPO, Load, instances_of, write_models
from tests.model_sources_support import HubServer, repo_from_dir
from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import WINDOW_S as W
from warmserve.testing.stack import Stack, seed_history
from warmserve.testing.testbin import built_server

SETTLE_S = 60.0


def _chat(api: str, model: str, n: int, key: str, stream: bool = True) -> None:
    """``n`` chat requests through the gateway with the API key ``key``, in threads (held
    while no instance has room)."""

    def one() -> None:
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
             "stream": stream}
        ).encode()  # fmt: skip
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        req = urllib.request.Request(f"{api}/v1/chat/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                while r.read(256):
                    pass
        except OSError:
            pass

    for _ in range(n):
        threading.Thread(target=one, daemon=True).start()


def test_every_dashboard_panel_has_data_on_a_real_prometheus(
    k8s_control_plane: Any,
    k8s_namespace: str,
    procs: Procs,
    tmp_path: Path,
) -> None:
    prom_bin = built_server("prometheus")
    st = Stack(k8s_control_plane, k8s_namespace, tmp_path, procs)
    ns = st.ns
    st.install()
    models = tmp_path / "models"
    write_models(models)
    up = write_model(tmp_path / "up", "fresh", layers=2, hidden=256)

    with HubServer({"acme/fresh": repo_from_dir(up)}, rate=2e6) as hub:
        st.start_agents(
            models,
            {"node-a": "4x64MiB", "node-b": "4x64MiB"},
            extra=("--hf-endpoint", hub.url, "--metrics-port", "0",
                   "--store-budget", str(64 * 1024**2)),
        )  # fmt: skip
        targets = {
            f"agent-{n}": f"127.0.0.1:{(tmp_path / f'{n}.metrics').read_text()}"
            for n in ("node-a", "node-b")
        }
        st.kubectl(
            "apply", "-n", ns,
            "-f", str(REPO / "examples/modeldeployment-chat.yaml"),
            "-f", str(REPO / "examples/modeldeployment-code.yaml"),
        )  # fmt: skip
        fresh = {
            "apiVersion": "warmserve.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": "fresh", "namespace": ns},
            "spec": {"model": {"name": "acme/fresh", "source": "hf://acme/fresh"}},
        }  # fmt: skip
        st.kubectl("apply", "-f", "-", input=json.dumps(fresh))
        seed_history(st.kubectl, ns, "chat", "tiny-chat", avg=6.0, peak=10.0)
        seed_history(st.kubectl, ns, "code", "tiny-code", avg=5.0, peak=5.0)
        seed_history(st.kubectl, ns, "fresh", "acme/fresh", avg=2.0, peak=2.0)
        op_port = free_port()
        targets["operator"] = f"127.0.0.1:{op_port}"
        prom = None
        t0 = time.time()
        try:
            st.start_operator(
                "operator", 100, poll_s=0.5, window_s=W,
                extra=("--metrics-port", str(op_port), "--metrics-address", "127.0.0.1"),
            )  # fmt: skip
            keys = tmp_path / "api-keys"  # the token panels show tokens per key id
            keys.mkdir()
            (keys / f"{ns}.alice").write_text("sk-dashboard-alice")
            (keys / f"{ns}.bob").write_text("sk-dashboard-bob")
            gw = st.start_gateway("gw-a", "--api-keys", str(keys))
            targets["gateway"] = gw.admin.removeprefix("http://")
            prom = start_prometheus(prom_bin, tmp_path, targets)
            logs = st.logs
            wait_for(
                lambda: (
                    len(prom.targets_up()) == len(targets)
                    and all(h == "up" for h in prom.targets_up().values())
                ),
                "Prometheus scrapes the operator, both agents and the gateway",
                SETTLE_S,
                logs,
            )

            # Forecast, prewarmed replicas, a cold start (code: minInstances 1), a download.
            def settled() -> Any:
                sts = {n: st.get("wsmd", n).get("status") or {} for n in ("chat", "code", "fresh")}
                return (
                    sts["chat"].get("prewarmedCount") == 3
                    and sts["code"].get("instanceCount") == 1
                    and sts["fresh"].get("prewarmedCount", 0) >= 1
                )

            wait_for(settled, "replicas prewarmed, code started, fresh fetched", SETTLE_S, logs)
            # Requests for chat (no instance: minInstances 0) through the gateway: held, then a
            # start on a prewarmed replica (a hit) serves them; the gateway measures TTFT, and
            # counts the tokens of streamed and whole answers per key.
            _chat(gw.api, "tiny-chat", 3, "sk-dashboard-alice")
            _chat(gw.api, "tiny-chat", 3, "sk-dashboard-bob", stream=False)
            wait_for(
                lambda: (st.get("wsmd", "chat").get("status") or {}).get("instanceCount"),
                "chat started for the held requests",
                SETTLE_S,
                logs,
            )
            # The held requests all finish at once, so the GenAI histograms' series are born
            # with their final counts and their rate is 0 (a NaN quantile) unless more requests
            # land after Prometheus has their first sample: a second round, served directly.
            wait_for(
                lambda: prom.get("/api/v1/query", query="gen_ai_client_token_usage_count")[
                    "result"
                ],
                "Prometheus holds the gateway's GenAI histograms",
                SETTLE_S,
                logs,
            )
            time.sleep(2.5)  # past the next scrape (every second)
            _chat(gw.api, "tiny-chat", 2, "sk-dashboard-alice")
            _chat(gw.api, "tiny-chat", 2, "sk-dashboard-bob", stream=False)
            from tests.e2e.e2e_support import describe_agents

            (inst,) = instances_of(describe_agents(st.agents), "tiny-code")
            Load(inst.endpoint, "tiny-code", 6)  # and a second start for code
            # For the picture (docs/dashboard.png): a while longer, with load coming and going.
            extra = float(os.environ.get("WARMSERVE_DASHBOARD_SECONDS", "0"))
            waves = [3, 8, 1, 10, 4, 0]
            for i in range(int(extra // 15)):
                if waves[i % len(waves)]:
                    Load(inst.endpoint, "tiny-code", waves[i % len(waves)], max_tokens=250)
                    _chat(gw.api, "tiny-chat", waves[i % len(waves)], "sk-dashboard-alice")
                    _chat(gw.api, "tiny-chat", 1, "sk-dashboard-bob", stream=False)
                time.sleep(15)
            time.sleep(8)  # a few more scrapes after the last change
            end = time.time()
            checked, dead = 0, []
            for p in panels():
                for t in p["targets"]:
                    series = prom.range(promql(t["expr"], end - t0), t0, end)
                    checked += 1
                    if not finite_points(series):
                        dead.append(f"{p['title']} / {t['legendFormat']}: {t['expr']}")
            assert not dead, "panels without data:\n" + "\n".join(dead)
            assert checked == sum(len(p["targets"]) for p in panels()) >= 30, checked
            if os.environ.get("WARMSERVE_DASHBOARD_PNG"):
                render_png(prom, t0, end, Path(os.environ["WARMSERVE_DASHBOARD_PNG"]))
        finally:
            if prom is not None:
                prom.stop()
            # GPUNodes are cluster-scoped: never leave them to the tests after this one.
            st.kubectl("delete", "gpunode", *st.agents, "--ignore-not-found", "--wait=false",
                       check=False)  # fmt: skip
