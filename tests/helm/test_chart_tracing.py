"""The chart's tracing values: one switch wires the gateway, the operator and the agents (whose
engines get the endpoint from the agent, never from a tenant), off by default."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from warmserve.testing.k8s import REPO_ROOT

CHART = REPO_ROOT / "helm" / "warmserve"
FLAGS = ("--otlp-traces-endpoint", "--trace-sample-ratio")


def _template(
    bin_dir: Path, values: dict[str, Any], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "KUBECONFIG": "/nonexistent"}
    return subprocess.run(
        [str(bin_dir / "helm"), "template", "ws", str(CHART), "-n", "ws", "-f", str(f)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _args(out: str) -> dict[str, list[str]]:
    """Container args of the operator, gateway and agent workloads."""
    got = {}
    for doc in yaml.safe_load_all(out):
        if doc and doc["kind"] in ("Deployment", "DaemonSet"):
            c = doc["spec"]["template"]["spec"]["containers"][0]
            got[doc["metadata"]["labels"]["app.kubernetes.io/component"]] = c["args"]
    return got


def test_tracing_is_off_by_default(k8s_bin_dir: Path, tmp_path: Path) -> None:
    out = _template(k8s_bin_dir, {}, tmp_path)
    assert out.returncode == 0, out.stderr
    for component, args in _args(out.stdout).items():
        assert not [a for a in args if a.startswith(FLAGS)], component


def test_one_value_turns_tracing_on_everywhere(k8s_bin_dir: Path, tmp_path: Path) -> None:
    values = {
        "tracing": {
            "enabled": True,
            "endpoint": "http://otel-collector.observability:4318",
            "sampleRatio": 0.25,
        }
    }
    out = _template(k8s_bin_dir, values, tmp_path)
    assert out.returncode == 0, out.stderr
    args = _args(out.stdout)
    assert set(args) == {"operator", "gateway", "agent"}
    for component, a in args.items():
        assert "--otlp-traces-endpoint=http://otel-collector.observability:4318" in a, component
        assert "--trace-sample-ratio=0.25" in a, component


@pytest.mark.parametrize(
    "tracing, why",
    [
        ({"enabled": True}, "tracing.enabled needs tracing.endpoint"),
        ({"enabled": True, "endpoint": "collector:4318"}, "/tracing/endpoint"),
        ({"enabled": True, "endpoint": "http://u:p@c:4318"}, "/tracing/endpoint"),
        ({"enabled": True, "endpoint": "http://c:4318", "sampleRatio": 2}, "/tracing/sampleRatio"),
        ({"enabled": "yes"}, "/tracing/enabled"),
        ({"enabled": True, "endpoint": "http://c:4318", "protocol": "grpc"}, "protocol"),
    ],
)
def test_bad_tracing_values_fail_the_render(
    k8s_bin_dir: Path, tmp_path: Path, tracing: dict[str, Any], why: str
) -> None:
    out = _template(k8s_bin_dir, {"tracing": tracing}, tmp_path)
    assert out.returncode != 0
    assert why in out.stderr, out.stderr
