"""The CRD's CEL rules for spec.model.source and its name pattern agree with
warmserve.modelref, case by case, on the real kube-apiserver (server-side dry run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from warmserve.modelref import SourceURIError, check_model_name, parse_source

REPO = Path(__file__).resolve().parents[2]

SOURCES = [
    "hf://meta-llama/Llama-3.1-8B-Instruct",
    "hf://org/name@main",
    "hf://org/name@refs/pr/12",
    "hf://org/name@refs/convert/parquet",
    "hf://org/name@refs/heads/main",
    "hf://org/name@refs/tags/v1.0",
    "hf://org/name@refs",
    "hf://org/name@release/2024-06",
    "hf://org/name@0123456789abcdef0123456789abcdef01234567",
    "hf://org/name@a..b",
    "hf://org/name@v1.lock",
    "hf://org/name@v1.lock/x",
    "hf://org/name@v1.",
    "hf://org/name@a//b",
    "hf://org/name@-x",
    "hf://org/name@x~1",
    "hf://org/name@" + "a" * 255,
    "hf://org/name@" + "a" * 256,
    "hf://org..x/name@main",
    "hf://org/name@v1.0",
    "hf://name-only",
    "hf://org/name@",
    "hf://org/name/extra",
    "hf://org/../x",
    "hf://org/name@../x",
    "s3://models-bucket/llama/8b",
    "s3://my.bucket/x",
    "s3://bucket",
    "s3://bucket/",
    "s3://bucket/x/",
    "s3://Bucket/x",
    "s3://bucket//x",
    "s3://b/x",
    "s3://bucket/a/./b",
    "pvc://model-store",
    "pvc://model-store/llama/8b",
    "pvc://Claim/x",
    "pvc://claim/../x",
    "pvc://claim/",
    "file:///var/lib/models/llama",
    "file://relative",
    "file:///a/../b",
    "file:///a/",
    "gs://bucket/x",
    "http://example.com/x",
    "llama",
]
NAMES = [
    "llama",
    "meta-llama/Llama-3.1-8B",
    "o" * 100 + "/" + "m" * 99,
    "o" * 100 + "/" + "m" * 100,
    "a/b/c",
    "../etc",
    "a/.b",
    "-x",
]


def _dry_run(kube_client: Any, ns: str, model: dict[str, Any]) -> str:
    """ "" when the API server accepts the ModelDeployment, else its message."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = client.CustomObjectsApi(kube_client)
    body = {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "probe", "namespace": ns},
        "spec": {"model": model},
    }
    try:
        api.create_namespaced_custom_object(
            "warmserve.io", "v1alpha1", ns, "modeldeployments", body, dry_run="All"
        )
    except ApiException as exc:
        if exc.status != 422:
            raise
        return str(exc.body)
    return ""


@pytest.fixture
def crds(kubectl: Any) -> None:
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/modeldeployments.warmserve.io",
    )


def test_cel_source_rules_match_the_parser(
    crds: None, kube_client: Any, k8s_namespace: str
) -> None:
    disagree = []
    for uri in SOURCES:
        try:
            parse_source(uri)
            ours = True
        except SourceURIError:
            ours = False
        refused = _dry_run(kube_client, k8s_namespace, {"name": "m", "source": uri})
        if ours != (not refused):
            disagree.append((uri, ours, refused[:200]))
    assert not disagree, disagree
    # Both sides accept some and refuse some (the table is not trivially one-sided).
    assert 0 < sum(1 for u in SOURCES if not _ok(u)) < len(SOURCES)


def _ok(uri: str) -> bool:
    try:
        parse_source(uri)
    except SourceURIError:
        return False
    return True


def test_name_pattern_matches_the_store_rule(crds: None, kube_client: Any, k8s_namespace: str):
    for name in NAMES:
        try:
            check_model_name(name)
            ours = True
        except SourceURIError:
            ours = False
        refused = _dry_run(kube_client, k8s_namespace, {"name": name})
        assert ours == (not refused), (name, refused[:200])


def test_a_refused_source_says_which_form_to_use(crds: None, kube_client: Any, k8s_namespace: str):
    msg = _dry_run(kube_client, k8s_namespace, {"name": "m", "source": "hf://name-only"})
    assert "hf:// sources look like hf://ORG/NAME" in msg
    msg = _dry_run(kube_client, k8s_namespace, {"name": "m", "source": "pvc://claim/../x"})
    assert "'..' path segments" in msg
    msg = _dry_run(kube_client, k8s_namespace, {"name": "m", "source": "hf://o/n@refs/pr/1"})
    assert "must be a branch, tag or commit: refs/pr/N" in msg
