"""The chart's tenancy wiring (helm template): the gateway's anonymous namespace is the release's,
admin-claimed global names, caps, the /demand token mounted into the operator and the gateways,
model sources per namespace for the operator, and the gateway's read-only GPUNode access."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helm.test_chart import CHART, _find, _helm, _render


def _args(docs: list[dict[str, Any]], suffix: str) -> list[str]:
    return list(
        _find(docs, "Deployment", suffix)["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def _mounts(docs: list[dict[str, Any]], suffix: str) -> dict[str, str]:
    spec = _find(docs, "Deployment", suffix)["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]]
        for m in spec["containers"][0]["volumeMounts"]
        if m["name"] in secrets
    }


def test_defaults_scope_anonymous_callers_to_the_release_namespace(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir, namespace="serving")
    gw, op = _args(docs, "-gateway"), _args(docs, "-operator")
    assert "--anonymous-namespace=serving" in gw
    assert not any(a.startswith("--global-model") for a in gw)
    assert {"--max-held-per-namespace=2000", "--max-held-per-key=1000"} <= set(gw)
    assert "--max-demand-streams=8" in gw
    assert [a for a in op if a.startswith("--model-source")] == ["--model-source=*=hf://"]
    assert not any(a.startswith("--held-demand-per-namespace") for a in op)
    token = _find(docs, "Secret", "-demand-token")
    assert token["data"]["token"] and token["type"] == "Opaque"
    name = token["metadata"]["name"]
    assert "--demand-token-file=/etc/warmserve/demand-token/token" in gw
    assert "--gateway-token-file=/etc/warmserve/demand-token/token" in op
    assert _mounts(docs, "-gateway")["/etc/warmserve/demand-token"] == name
    assert _mounts(docs, "-operator")["/etc/warmserve/demand-token"] == name


def test_admin_values_reach_the_flags(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set-json", 'gateway.anonymousNamespaces=["team-a","team-b"]',
        "--set-json", 'gateway.globalModels={"chat":"team-a/chat"}',
        "--set", "gateway.maxHeldPerNamespace=50", "--set", "gateway.maxHeldPerKey=5",
        "--set-json",
        'operator.modelSources={"team-a":["s3://models/team-a/","hf://team-a-org/"],"*":[]}',
        "--set", "operator.heldDemandPerNamespace=64",
    )  # fmt: skip
    gw, op = _args(docs, "-gateway"), _args(docs, "-operator")
    assert [a for a in gw if a.startswith("--anonymous-namespace")] == [
        "--anonymous-namespace=team-a",
        "--anonymous-namespace=team-b",
    ]
    assert "--global-model=chat=team-a/chat" in gw
    assert {"--max-held-per-namespace=50", "--max-held-per-key=5"} <= set(gw)
    # "*": [] allows nothing by default (an explicit empty entry, not the CLI's default)
    assert [a for a in op if a.startswith("--model-source")] == [
        "--model-source=*=",
        "--model-source=team-a=s3://models/team-a/",
        "--model-source=team-a=hf://team-a-org/",
    ]
    assert "--held-demand-per-namespace=64" in op


@pytest.mark.parametrize(
    "values",
    [
        {"operator": {"modelSources": {"Team_A": ["hf://x/"]}}},
        {"operator": {"modelSources": {"team-a": ["ftp://x/"]}}},
        {"gateway": {"globalModels": {"chat": "no-namespace"}}},
        {"gateway": {"anonymousNamespaces": ["Not A Namespace"]}},
        {"gateway": {"maxHeldPerKey": -1}},
    ],
)
def test_bad_tenancy_values_are_refused(k8s_bin_dir: Path, values: dict, tmp_path: Path) -> None:
    f = tmp_path / "values.json"
    f.write_text(json.dumps(values))
    proc = _helm(k8s_bin_dir, "template", "ws", str(CHART), "-f", str(f), check=False)
    assert proc.returncode != 0 and "values don't meet the specifications" in proc.stderr


def test_gateway_reads_gpunodes_and_nothing_more_of_them(k8s_bin_dir: Path) -> None:
    for extra in ((), ("--set-json", 'operator.watchNamespaces=["team-a"]')):
        docs = _render(k8s_bin_dir, *extra)
        role = _find(docs, "ClusterRole", "-gateway-agent-records")
        assert role["rules"] == [
            {
                "apiGroups": ["warmserve.io"],
                "resources": ["gpunodes"],
                "verbs": ["get", "list", "watch"],
            }
        ]
        binding = _find(docs, "ClusterRoleBinding", "-gateway-agent-records")
        assert binding["subjects"][0]["name"].endswith("-gateway")
