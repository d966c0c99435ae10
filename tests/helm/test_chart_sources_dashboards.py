"""The chart's model-source wiring, its Grafana dashboards ConfigMap, its images and its closed
values schema (a mistyped key fails), rendered by the real helm and applied with a server-side
dry run to the real kube-apiserver."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_chart import CHART, _env_refs_are_defined, _find, _helm, _parse_cli, _render

from warmserve.testing.k8s import ControlPlane

SOURCES = [
    "--set", "agent.modelCache.budget=500GiB",
    "--set", "agent.modelCache.reserve=20%",
    "--set", "agent.modelSources.huggingface.secretName=hf-token",
    "--set", "agent.modelSources.huggingface.endpoint=https://hf-mirror.example",
    "--set", "agent.modelSources.s3.secretName=s3-creds",
    "--set", "agent.modelSources.s3.endpointUrl=https://minio.example:9000",
    "--set", "agent.modelSources.s3.region=eu-1",
    "--set", "agent.modelSources.pvcs={models-rwx}",
    "--set", "agent.modelSources.hostPaths={/data/models}",
]  # fmt: skip


def _agent(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _find(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]


def test_model_sources_reach_the_agent_as_files_mounts_and_flags(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir, *SOURCES)
    pod = _agent(docs)
    c = pod["containers"][0]
    args = c["args"]
    for flag in (
        "--store-budget=500GiB",
        "--store-reserve=20%",
        "--hf-token-file=/etc/warmserve/hf/token",
        "--hf-endpoint=https://hf-mirror.example",
        "--s3-endpoint-url=https://minio.example:9000",
        "--s3-region=eu-1",
        "--pvc-root=/mnt/warmserve/pvc",
        "--allow-path=/data/models",
    ):
        assert flag in args, flag
    _parse_cli(args)  # every flag is one `warmserve agent` knows
    _env_refs_are_defined(c)
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert "HF_TOKEN" not in env, "the token is a mounted file, not an environment variable"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"]["readOnly"] is False  # the agent fills its cache
    assert mounts["pvc-models-rwx"] == {
        "name": "pvc-models-rwx", "mountPath": "/mnt/warmserve/pvc/models-rwx", "readOnly": True,
    }  # fmt: skip
    assert mounts["node-models-0"]["mountPath"] == "/data/models"
    assert mounts["node-models-0"]["readOnly"] and mounts["hf-token"]["readOnly"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["pvc-models-rwx"]["persistentVolumeClaim"] == {
        "claimName": "models-rwx",
        "readOnly": True,
    }
    assert vols["hf-token"]["secret"]["items"] == [{"key": "token", "path": "token"}]
    # The cache directory is handed to the agent's uid by a root init container with CHOWN only.
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "65532:65532", "/models"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}


def test_read_only_cache_means_no_init_container(k8s_bin_dir: Path) -> None:
    pod = _agent(_render(k8s_bin_dir, "--set", "agent.modelCache.readOnly=true"))
    assert "initContainers" not in pod
    assert pod["containers"][0]["volumeMounts"][0]["readOnly"] is True


def test_dashboards_configmap_is_labelled_for_the_grafana_sidecar(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir, "--set", "dashboards.annotations.grafana_folder=warmserve")
    cm = _find(docs, "ConfigMap", "-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "warmserve"}
    shipped = json.loads(cm["data"]["warmserve.json"])
    assert shipped == json.loads((CHART / "dashboards" / "warmserve.json").read_text())
    titles = [p["title"] for p in shipped["panels"]]
    for want in (
        "Demand vs prediction",
        "Prewarm hit ratio",
        "Instance starts by kind",
        "Gateway time to first token",
        "Held requests",
        "GPU worker states",
        "Load bandwidth",
    ):
        assert want in titles
    off = _render(k8s_bin_dir, "--set", "dashboards.enabled=false")
    assert not [d for d in off if d["kind"] == "ConfigMap"]
    other = _render(k8s_bin_dir, "--set", "dashboards.label=my_dash", "--set",
                    "dashboards.namespace=monitoring")  # fmt: skip
    cm = _find(other, "ConfigMap", "-dashboards")
    assert cm["metadata"]["labels"]["my_dash"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"


def test_dashboard_json_is_what_the_generator_writes() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(CHART.parents[1] / "hack" / "gen-dashboard.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_images_default_to_the_dockerfiles_images(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir)
    op = _find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    ag = _agent(docs)["containers"][0]
    assert op["image"] == "ghcr.io/warmserve/warmserve:0.1.0"
    assert ag["image"] == "ghcr.io/warmserve/warmserve-agent-cuda:0.1.0"
    same = _agent(_render(k8s_bin_dir, "--set", "agent.image.repository="))["containers"][0]
    assert same["image"] == op["image"]


@pytest.mark.parametrize(
    ("set_args", "message"),
    [
        (["--set", "agent.modleCache.budget=1GiB"], "additional properties 'modleCache'"),
        (["--set", "operater.replicas=2"], "additional properties 'operater'"),
        (["--set", "tls.certManager.issuerRef.nmae=x"], "additional properties 'nmae'"),
        (["--set", "dashboards.enable=true"], "additional properties 'enable'"),
        (["--set", "agent.modelCache.budget=lots"], "/agent/modelCache/budget"),
        (["--set", "agent.modelCache.reserve=most"], "/agent/modelCache/reserve"),
        (["--set", "agent.simulateGpus=8x80"], "/agent/simulateGpus"),
        (["--set", "agent.modelSources.pvcs={Bad_Claim}"], "/agent/modelSources/pvcs/0"),
        (["--set", "agent.modelSources.hostPaths={relative}"], "/agent/modelSources/hostPaths/0"),
    ],
)
def test_mistyped_or_bad_values_are_refused_with_their_path(
    k8s_bin_dir: Path, set_args: list[str], message: str
) -> None:
    proc = _helm(k8s_bin_dir, "template", "ws", str(CHART), *set_args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_free_form_maps_still_take_any_key(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set", "agent.podAnnotations.example\\.com/x=y",
        "--set", "operator.resources.limits.cpu=2",
        "--set", "commonLabels.team=ml",
        "--set", "global.imageRegistry=example",
    )  # fmt: skip
    assert _find(docs, "Deployment", "-operator")["metadata"]["labels"]["team"] == "ml"


def test_sources_and_dashboards_pass_server_side_dry_run(
    k8s_control_plane: ControlPlane, k8s_namespace: str, kubectl: Any
) -> None:
    kubectl("apply", "-f", str(CHART.parents[1] / "crds"))
    rendered = k8s_control_plane.helm(
        "template", "ws", str(CHART), "--namespace", k8s_namespace, *SOURCES
    ).stdout
    proc = k8s_control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", k8s_namespace, "-f", "-",
        input=rendered,
    )  # fmt: skip
    assert "configmap/ws-warmserve-dashboards created (server dry run)" in proc.stdout
    assert "daemonset.apps/ws-warmserve-agent created (server dry run)" in proc.stdout
