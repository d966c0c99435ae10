"""End to end: a ModelDeployment whose weights are only at ``hf://`` gets prewarmed on a node
that did not have them (real kube-apiserver, the operator under the chart's RBAC, a real agent
process, the real huggingface_hub client against a local server speaking the Hub's protocol —
tests/model_sources_support.py; no Hub server software can be installed here).

Shown, each within a bound:

1. the operator sizes the model from its source (InspectModel: no node holds it) and prewarms
   it; the agent fetches it into its store while ``warmserve status`` shows the fetch's bytes,
   rate and ETA;
2. the first download of one shard is corrupted (same size, one byte flipped): it is refused by
   its sha256 and fetched again;
3. the store's disk budget forces an eviction: the least recently used *cold* model goes; a
   model with a serving instance (and a more recently used cold one) stays;
4. the model's name has a '/' and the CRD's maximum length (200): prewarm, start (a prewarm hit)
   and an OpenAI request under that name work;
5. Events ``Fetching``/``Fetched`` on the deployment, the store's usage and evictions in the
   GPUNode status.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_support import REPO, get_json, install_for_operator
from warmserve_agent.testing import write_model

from tests.model_sources_support import HubServer, repo_from_dir
from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import WINDOW_S as W
from warmserve.testing.stack import seed_history

CHAT = "acme/" + "tiny-chat-" * 19 + "x" * 5  # 200 characters: the CRD's maxLength
SHARD = "model-00001-of-00002.safetensors"
SETTLE_S = 60.0


def _write(root: Path, name: str, **kw: Any) -> Path:
    return write_model(root, name, **kw)


def _total(repo: Any) -> int:
    return sum(len(v) for v in repo.files.values())


def test_hf_source_prewarm_with_progress_corruption_retry_and_lru_budget(
    k8s_control_plane: Any,
    k8s_namespace: str,
    kubectl: Any,
    helm: Any,
    sa_kubeconfig: Any,
    procs: Procs,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    assert len(CHAT) == 200
    ns = k8s_namespace
    up = tmp_path / "upstream"
    slow = {"decode_tok_s": 50.0, "max_batch": 4, "kv_bytes_per_token": 256}
    repos = {
        # ~5.7 MB in two shards: at 450 KB/s per stream a download takes several seconds.
        "acme/chat": repo_from_dir(_write(up, "chat", layers=4, hidden=256, seed=1, profile=slow)),
        "acme/filler": repo_from_dir(_write(up, "filler", layers=2, hidden=64, seed=2)),
        "acme/cold-old": repo_from_dir(_write(up, "cold-old", layers=2, hidden=64, seed=3)),
        "acme/cold-new": repo_from_dir(_write(up, "cold-new", layers=2, hidden=64, seed=4)),
    }
    sizes = {k: _total(v) for k, v in repos.items()}
    # Room for everything but one of the cold models (each ~22 KB of safetensors + config).
    budget = sum(sizes.values()) - 1

    op_kubeconfig, env = install_for_operator(kubectl, helm, sa_kubeconfig, ns, f"src{ns[-8:]}")

    with HubServer(repos) as hub:
        store = tmp_path / "store"
        store.mkdir()
        addr_file = tmp_path / "node.addr"
        procs.start(
            "agent",
            [
                sys.executable,
                str(REPO / "tests/e2e/agent_proc.py"),
                "--models",
                str(store),
                "--gpus",
                "4x64MiB",
                "--node",
                "node-a",
                "--address-file",
                str(addr_file),
                "--memory-dir",
                str(tmp_path / "mem"),
                "--hf-endpoint",
                hub.url,
                "--store-budget",
                str(budget),
                "--fetch-attempts",
                "3",
            ],
            env,
        )
        addr = wait_for(
            lambda: addr_file.exists() and addr_file.read_text(),
            "agent up",
            60,
            lambda: procs.log("agent"),
        )

        # The node's store before the operator comes: two cold models (fetched, then their slots
        # evicted; cold-old used first) and a model serving an instance.
        from warmserve.api.agent.client import SyncAgentClient

        with SyncAgentClient(addr) as c:
            for name in ("cold-old", "cold-new"):
                last = list(c.prewarm(f"acme/{name}", [0], 0, source=f"hf://acme/{name}"))[-1]
                c.evict(last.slot.slot_id)
                time.sleep(1.1)  # distinct last-use times (file mtimes)
            c.activate("acme/filler", [3], source="hf://acme/filler", request_id="filler-1")
            assert sorted(m.name for m in c.describe().models) == [
                "acme/cold-new",
                "acme/cold-old",
                "acme/filler",
            ]
        node = f"{ns}-node-a"
        request.addfinalizer(  # GPUNodes are cluster-scoped: never leave them behind
            lambda: kubectl("delete", "gpunode", node, "--ignore-not-found", "--wait=false",
                            check=False)
        )  # fmt: skip
        kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(
                {
                    "apiVersion": "warmserve.io/v1alpha1",
                    "kind": "GPUNode",
                    "metadata": {"name": node},
                    "spec": {"agentAddress": addr},
                }
            ),
        )
        mds = [
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": "filler", "namespace": ns},
                "spec": {
                    "model": {"name": "acme/filler", "source": "hf://acme/filler"},
                    "minInstances": 1,
                    "maxInstances": 1,
                },
            },
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": "chat", "namespace": ns},
                "spec": {
                    "model": {"name": CHAT, "source": "hf://acme/chat@main"},
                    "maxBatchSize": 4,
                    "prewarm": {"layers": 2},
                },
            },
        ]
        # The deployments first (their UIDs name the load histories), then the operator.
        kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": mds})
        )
        seed_history(kubectl, ns, "chat", CHAT, avg=6.0, peak=6.0)  # B=4: 2 basic replicas
        hub.rate = 450e3  # from here on downloads are slow enough to watch
        hub.corrupt[SHARD] = 1  # and the first download of this shard is corrupt
        procs.start(
            "operator",
            [
                sys.executable,
                "-m",
                "warmserve",
                "operator",
                "--window-seconds",
                str(W),
                "--poll-seconds",
                "0.5",
                "--predictor",
                "seasonal",
                "--standalone",
                "--metrics-port",
                "0",
                "--scale-down-delay",
                "600",
                "--namespace",
                ns,
            ],
            {**env, "KUBECONFIG": str(op_kubeconfig)},
        )

        def logs() -> str:
            return procs.log("operator") + "\n" + procs.log("agent")

        admin_env = {**env, "KUBECONFIG": str(k8s_control_plane.kubeconfig)}

        def status(*extra: str) -> str:
            return subprocess.run(
                [sys.executable, "-m", "warmserve", "status", "-n", ns, *extra],
                capture_output=True,
                text=True,
                env=admin_env,
                check=True,
                timeout=60,
            ).stdout

        # 1. While the agent downloads: bytes, rate and ETA in `warmserve status`.
        def downloading() -> Any:
            view = json.loads(status("--json"))
            n = next((n for n in view["nodes"] if n["name"] == node), None)
            f = next((f for f in (n or {}).get("fetches", []) if f["model"] == CHAT), None)
            ok = f and f["state"] == "downloading" and 0 < f["bytesDone"] < f["bytesTotal"]
            return f if ok and f["etaSeconds"] > 0 and f["bytesPerSecond"] > 0 else None

        seen = wait_for(downloading, "the fetch in progress in warmserve status", SETTLE_S, logs)
        assert seen["source"] == "hf://acme/chat@main" and seen["bytesTotal"] == sizes["acme/chat"]
        # A sane ETA: ~6 MB at ~0.9 MB/s (two streams at 450 KB/s) is seconds, not hours.
        assert 0 < seen["etaSeconds"] < 60, seen
        text = status()
        assert "FETCHING" in text and "hf://acme/chat@main" in text and "%" in text, text
        print(text)

        # Prewarmed replicas of the 200-character model, on the node that did not have it.
        def prewarmed() -> Any:
            st = get_json(kubectl, "wsmd", "chat", "-n", ns).get("status") or {}
            reps = st.get("prewarmedReplicas") or []
            return st if len(reps) == 2 and all(r["state"] == "ready" for r in reps) else None

        st = wait_for(prewarmed, "chat's 2 replicas prewarmed", SETTLE_S, logs)
        assert all(r["layersResident"] == 2 and r["node"] == node for r in st["prewarmedReplicas"])

        # 2. The corrupted shard was refused and fetched again; the rest once.
        assert hub.downloads[SHARD] >= 2
        assert hub.downloads["model-00002-of-00002.safetensors"] >= 1
        agent_log = (tmp_path / "agent.log").read_text()
        assert "event=model_file_rejected" in agent_log and "sha256" in agent_log

        # 3. Budget: cold-old (the least recently used cold model) evicted; cold-new and filler
        # (serving an instance) kept.
        with SyncAgentClient(addr) as c:
            d = c.describe()
        names = sorted(m.name for m in d.models)
        assert names == sorted(["acme/cold-new", "acme/filler", CHAT]), names
        assert d.store.evictions == 1 and d.store.used_bytes <= budget
        assert any(i.model == "acme/filler" for i in d.instances)
        node_st = get_json(kubectl, "gpunode", node)["status"]
        assert node_st["store"]["evictions"] == 1 and node_st["store"]["budgetBytes"] == budget
        assert {m["name"]: m.get("source") for m in node_st["models"]}[CHAT] == (
            "hf://acme/chat@main"
        )

        # 5. Events on the deployment.
        def fetch_events() -> Any:
            evs = get_json(kubectl, "events", "-n", ns)["items"]
            rs = {e["reason"] for e in evs if e["involvedObject"]["name"] == "chat"}
            return rs if {"Fetching", "Fetched"} <= rs else None

        wait_for(fetch_events, "Fetching and Fetched Events", SETTLE_S, logs)

        # 4. Start it (a prewarm hit) and serve a request under the 200-character name.
        kubectl(
            "patch",
            "wsmd",
            "chat",
            "-n",
            ns,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"minInstances": 1}}),
        )

        def started() -> Any:
            st = get_json(kubectl, "wsmd", "chat", "-n", ns)["status"]
            return st if st["instanceCount"] == 1 and st["prewarm"]["hits"] == 1 else None

        st = wait_for(started, "chat started on a prewarmed replica", SETTLE_S, logs)
        endpoint = st["instances"][0]["endpoint"]
        body = json.dumps({"model": CHAT, "prompt": "hi", "max_tokens": 3}).encode()
        req = urllib.request.Request(
            f"{endpoint}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.loads(r.read())
        assert out["model"] == CHAT and out["choices"][0]["text"]
