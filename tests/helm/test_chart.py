"""The Helm chart: lint, render, server-side validation and a real install on the test API server.

The API server (tests/k8s_support.py) has no kubelet and no controllers, so Pods never run: the
install test checks the release status and the objects, not running workloads.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from warmserve.testing.k8s import REPO_ROOT, ControlPlane, fake_node

CHART = REPO_ROOT / "helm" / "warmserve"
KIND_VALUES = REPO_ROOT / "e2e" / "kind-values.yaml"  # what e2e/kind-up.sh installs
REPO_CRDS = REPO_ROOT / "crds"


def _helm(bin_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # Offline helm (lint/template) needs no cluster; keep it away from $HOME and any kubeconfig.
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "KUBECONFIG": "/nonexistent"}
    proc = subprocess.run(
        [str(bin_dir / "helm"), *args], capture_output=True, text=True, env=env, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def _render(bin_dir: Path, *set_args: str, namespace: str = "warmserve") -> list[dict[str, Any]]:
    out = _helm(bin_dir, "template", "ws", str(CHART), "--namespace", namespace, *set_args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _find(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(hits) == 1, (
        f"expected one {kind} *{name_suffix}, got {[h['metadata']['name'] for h in hits]}"
    )
    return hits[0]


def test_chart_crds_are_identical_to_the_repository_crds() -> None:
    repo = {p.name: p.read_bytes() for p in sorted(REPO_CRDS.glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert repo, "crds/ has no CRDs"
    assert chart == repo, "helm/warmserve/crds differs from crds/: run hack/k8s/sync-chart-crds.sh"
    # kopf peering (leader election) must ship with the chart.
    assert "kopf.dev_clusterkopfpeerings.yaml" in chart


def test_helm_lint_strict_is_clean(k8s_bin_dir: Path) -> None:
    proc = _helm(k8s_bin_dir, "lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


def test_defaults_render_the_documented_objects(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir)
    kinds = sorted({d["kind"] for d in docs})
    for kind in ("ClusterKopfPeering", "DaemonSet", "Deployment", "Secret", "ServiceAccount"):
        assert kind in kinds
    op = _find(docs, "Deployment", "-operator")
    pod = op["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ws-warmserve-operator"
    container = pod["containers"][0]
    assert container["command"] == ["warmserve"] and container["args"][0] == "operator"
    assert "--peering=warmserve" in container["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    agent = _find(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    args = agent["containers"][0]["args"]
    assert args[:2] == ["agent", "--gpus=auto"]
    assert "--client-ca=/etc/warmserve/tls/ca.crt" in args  # mTLS on by default
    assert "--allow-insecure-listen" not in args
    startup = agent["containers"][0]["startupProbe"]
    # Opening 8 GPUs takes a while before the port opens: a startup probe, not a liveness kill.
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 300
    assert "initialDelaySeconds" not in agent["containers"][0]["livenessProbe"]
    assert agent["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert agent["hostIPC"] is False
    # Each side's certificate from its own generated CA (test_chart_security.py).
    server = _find(docs, "Secret", "-agent-server-tls")["data"]
    client = _find(docs, "Secret", "-operator-client-tls")["data"]
    assert server["ca.crt"] != client["ca.crt"] and server["tls.crt"] != client["tls.crt"]


def test_values_change_gpu_requests_node_selector_and_tls(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set",
        "agent.gpuResource.name=amd.com/gpu",
        "--set",
        "agent.gpuResource.count=4",
        "--set-json",
        # helm merges maps: the default label is dropped by setting it to null (as documented)
        'agent.nodeSelector={"pool":"gpu-a100","nvidia.com/gpu.present":null}',
        "--set",
        "agent.simulateGpus=2x16GiB",
        "--set",
        "tls.enabled=false",
        "--set",
        "tls.allowInsecure=true",
    )
    agent = _find(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"pool": "gpu-a100"}
    assert agent["containers"][0]["resources"]["limits"] == {"amd.com/gpu": 4}
    args = agent["containers"][0]["args"]
    assert "--simulate-gpus=2x16GiB" in args and not any(a.startswith("--gpus") for a in args)
    assert not any(a.startswith("--tls") for a in args)
    assert "--allow-insecure-listen" in args  # the agent refuses plaintext 0.0.0.0 otherwise
    assert not [d for d in docs if d["kind"] == "Secret" and not _demand_token(d)]
    none = _render(k8s_bin_dir, "--set", "agent.gpuResource.count=0")
    limits = _find(none, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ].get("limits", {})
    assert "nvidia.com/gpu" not in limits


def test_existing_secret_and_cert_manager_modes(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set",
        "tls.mode=existingSecret",
        "--set",
        "tls.serverSecret=my-tls",
        "--set",
        "tls.clientSecret=my-client-tls",
    )
    assert not [d for d in docs if d["kind"] == "Secret" and not _demand_token(d)]
    for kind, suffix, name in (
        ("Deployment", "-operator", "my-client-tls"),
        ("DaemonSet", "-agent", "my-tls"),
    ):
        volumes = _find(docs, kind, suffix)["spec"]["template"]["spec"]["volumes"]
        assert {"secretName": name, "defaultMode": 0o440} in [v.get("secret") for v in volumes]
    cm = _render(
        k8s_bin_dir, "--set", "tls.mode=certManager", "--set", "tls.certManager.issuerRef.name=ca"
    )
    certs = [d for d in cm if d["kind"] == "Certificate"]
    assert sorted(c["spec"]["secretName"] for c in certs) == [
        "ws-warmserve-agent-server-tls",
        "ws-warmserve-operator-client-tls",
    ]
    server = next(c for c in certs if "server" in c["metadata"]["name"])
    assert server["spec"]["dnsNames"] == ["warmserve-agent"]
    assert server["spec"]["issuerRef"]["name"] == "ca"


@pytest.mark.parametrize(
    ("set_args", "message"),
    [
        # values.schema.json: the message names the field
        (
            ["--set", "tls.mode=selfsigned"],
            "at '/tls/mode': value must be one of 'generate', 'existingSecret', 'certManager'",
        ),
        (["--set", "agent.gpuResource.count=-1"], "at '/agent/gpuResource/count': minimum"),
        (["--set", "operator.windowSeconds=abc"], "at '/operator/windowSeconds': got string"),
        (["--set", "operator.logLevel=verbose"], "at '/operator/logLevel': value must be one of"),
        (["--set", "agent.grpcPort=70000"], "at '/agent/grpcPort': maximum"),
        (["--set", "agent.modelCache.hostPath=models"], "at '/agent/modelCache/hostPath'"),
        # template checks that a schema cannot express
        (["--set", "tls.mode=certManager"], "tls.certManager.issuerRef.name is required"),
        (
            ["--set", "tls.mode=existingSecret"],
            "tls.mode=existingSecret needs tls.serverSecret and tls.clientSecret",
        ),
        (
            ["--set", "operator.serviceAccount.create=false"],
            "operator.serviceAccount.name is required",
        ),
        (["--set", "agent.metricsPort=50051"], "agent.metricsPort and agent.grpcPort must differ"),
        (
            ["--set", "operator.metricsPort=8080"],
            "operator.metricsPort and operator.healthPort must differ",
        ),
        (["--set", "metrics.podMonitor.interval=often"], "at '/metrics/podMonitor/interval'"),
        (["--set", "metrics.scrapeAnnotations=yes"], "at '/metrics/scrapeAnnotations': got string"),
        # plaintext, unauthenticated agents only when asked for explicitly (issue 16)
        (["--set", "tls.enabled=false"], "also set tls.allowInsecure=true"),
        (["--set", "agent.gpuReserve=lots"], "at '/agent/gpuReserve'"),
        (["--set", "agent.requireFencingToken=maybe"], "at '/agent/requireFencingToken'"),
        # the loop's leader election: schema, then the orderings the fence relies on
        (
            ["--set-json", "operator.leaderElection.leaseSeconds=2.5"],
            "at '/operator/leaderElection/leaseSeconds': got number, want integer",
        ),
        (
            ["--set", "operator.leaderElection.renewDeadlineSeconds=12"],
            "renewDeadlineSeconds (12) must be shorter than leaseSeconds (10)",
        ),
        (
            [
                "--set",
                "operator.leaderElection.leaseSeconds=3",
                "--set",
                "operator.leaderElection.retryPeriodSeconds=3",
            ],
            "retryPeriodSeconds (3) must be shorter than the renew deadline (2.1)",
        ),
    ],
)
def test_bad_values_fail_with_a_message(
    k8s_bin_dir: Path, set_args: list[str], message: str
) -> None:
    proc = _helm(k8s_bin_dir, "template", "ws", str(CHART), *set_args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


# Every leader-election value set (a float through --set-json: --set makes "2.5" a string).
CUSTOM_ELECTION = [
    "--set",
    "operator.leaderElection.leaseSeconds=15",
    "--set",
    "operator.leaderElection.renewDeadlineSeconds=10",
    "--set-json",
    "operator.leaderElection.retryPeriodSeconds=2.5",
]


def _parse_cli(args: list[str]) -> argparse.Namespace:
    """Parse ``args`` with the real ``warmserve`` argument parser (fails on unknown flags)."""
    from warmserve.cli import build_parser

    try:
        return build_parser().parse_args(args)
    except (SystemExit, argparse.ArgumentError) as exc:  # unknown or invalid flags
        raise AssertionError(f"warmserve rejects the chart's arguments {args}") from exc


def _env_refs_are_defined(container: dict[str, Any]) -> None:
    """Every ``$(VAR)`` in the args names an env var of the container: kubelet leaves an
    undefined reference as the literal text, e.g. an agent advertising ``$(POD_IP)``."""
    defined = {e["name"] for e in container.get("env", [])}
    refs = {m for a in container["args"] for m in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a)}
    assert refs <= defined, f"{container['name']}: undefined {sorted(refs - defined)}"


@pytest.mark.parametrize(
    "set_args",
    [
        [],
        [
            "--set",
            "tls.enabled=false",
            "--set",
            "tls.allowInsecure=true",
            "--set",
            "operator.logLevel=debug",
            "--set",
            "agent.gpuReserve=6GiB",
        ],
        [
            "--set",
            "agent.simulateGpus=8x80GiB",
            "--set",
            "operator.predictor=seasonal",
            "--set",
            "operator.watchNamespaces={team-a,team-b}",
            *CUSTOM_ELECTION,
        ],
        ["-f", str(KIND_VALUES)],
    ],
    ids=["defaults", "no-tls", "simulated", "kind"],
)
def test_container_args_are_accepted_by_the_warmserve_cli(
    k8s_bin_dir: Path, set_args: list[str]
) -> None:
    # The chart and the CLI are written separately; a renamed flag would crash-loop the pods.
    docs = _render(k8s_bin_dir, *set_args)
    objs = (("Deployment", "-operator"), ("DaemonSet", "-agent"), ("Deployment", "-gateway"))
    for kind, suffix in objs:
        container = _find(docs, kind, suffix)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["warmserve"]
        _parse_cli(container["args"])
        _env_refs_are_defined(container)


@pytest.mark.parametrize(
    ("set_args", "timing"),
    [
        ([], (10.0, 7.0, 2.0)),
        (["--set", "operator.leaderElection.leaseSeconds=15"], (15.0, 10.5, 3.0)),
        (CUSTOM_ELECTION, (15.0, 10.0, 2.5)),
    ],
)
def test_leader_election_values_reach_the_operators_timing(
    k8s_bin_dir: Path, set_args: list[str], timing: tuple[float, float, float]
) -> None:
    # What the operator's CLI builds from the chart's arguments (and would refuse at start).
    from warmserve_operator.leader import ElectionTiming

    container = _find(_render(k8s_bin_dir, *set_args), "Deployment", "-operator")["spec"][
        "template"
    ]["spec"]["containers"][0]
    a = _parse_cli(container["args"])
    t = ElectionTiming.for_lease(a.lease_seconds, a.renew_deadline_seconds, a.retry_period_seconds)
    assert (t.lease_s, t.renew_deadline_s, t.retry_s) == pytest.approx(timing)


def _pod(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    return _find(docs, kind, suffix)["spec"]["template"]


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_agents_require_a_fencing_token_unless_told_otherwise(k8s_bin_dir: Path) -> None:
    # The chart's operator always runs with leader election, so it always sends its term's
    # token: by default only its current leader can change a node (docs/agent.md).
    def agent_args(*set_args: str) -> list[str]:
        ds = _find(_render(k8s_bin_dir, *set_args), "DaemonSet", "-agent")
        return ds["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--require-fencing-token" in agent_args()
    assert "--require-fencing-token" not in agent_args("--set", "agent.requireFencingToken=false")
    ns = _parse_cli(agent_args())
    assert ns.require_fencing_token is True


def test_agent_engines_and_metrics_are_reachable_from_other_pods(k8s_bin_dir: Path) -> None:
    # The CLI binds engines and metrics to 127.0.0.1: in a pod the endpoints Activate returns
    # would be unreachable from the gateway, and Prometheus could not scrape. Engines bind the
    # pod IP only (NetworkPolicy: test_chart_security.py).
    pod = _pod(_render(k8s_bin_dir), "DaemonSet", "-agent")
    container = pod["spec"]["containers"][0]
    ns = _parse_cli(container["args"])
    assert ns.engine_host == "$(POD_IP)"
    assert ns.advertise_host == "$(POD_IP)"  # kubelet substitutes the env var below
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert (ns.metrics_host, ns.metrics_port) == ("0.0.0.0", 9091)
    assert _ports(container) == {"grpc": 50051, "metrics": 9091}
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == "9091" and ann["prometheus.io/path"] == "/metrics"
    assert "checksum/tls" in ann

    # The args build an AgentConfig with those hosts once kubelet has substituted $(POD_IP).
    from warmserve_agent.cli.run import _config

    ns.advertise_host = ns.advertise_host.replace("$(POD_IP)", "10.1.2.3")
    ns.engine_host = ns.engine_host.replace("$(POD_IP)", "10.1.2.3")
    ns.model_dir = str(REPO_ROOT)  # any directory: _config checks it exists
    ns.tls_cert = ns.tls_key = ns.client_ca = None  # the secret is not mounted here
    ns.allow_client_id = []  # (checked with the certificates: test_chart_security.py)
    cfg = _config(ns)
    assert (cfg.engine_host, cfg.advertise_host, cfg.metrics_host) == (
        "10.1.2.3",
        "10.1.2.3",
        "0.0.0.0",
    )


def test_operator_metrics_bind_all_interfaces_on_a_named_port(k8s_bin_dir: Path) -> None:
    pod = _pod(_render(k8s_bin_dir), "Deployment", "-operator")
    container = pod["spec"]["containers"][0]
    ns = _parse_cli(container["args"])
    assert (ns.metrics_address, ns.metrics_port) == ("0.0.0.0", 9090)
    assert _ports(container) == {"metrics": 9090, "health": 8080}
    ann = pod["metadata"]["annotations"]
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"]) == ("true", "9090")


def test_metrics_off_declares_no_port_and_no_scrape_annotations(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir, "--set", "operator.metricsPort=0", "--set", "agent.metricsPort=0",
        "--set", "tls.enabled=false", "--set", "tls.allowInsecure=true",
        "--set", "metrics.podMonitor.enabled=true",
    )  # fmt: skip
    op = _pod(docs, "Deployment", "-operator")
    ag = _pod(docs, "DaemonSet", "-agent")
    # containerPort 0 would be rejected by the API server; no annotations at all are left.
    assert _ports(op["spec"]["containers"][0]) == {"health": 8080}
    assert _ports(ag["spec"]["containers"][0]) == {"grpc": 50051}
    assert "annotations" not in op["metadata"] and "annotations" not in ag["metadata"]
    assert _parse_cli(op["spec"]["containers"][0]["args"]).metrics_port == 0
    agent_ns = _parse_cli(ag["spec"]["containers"][0]["args"])
    assert agent_ns.metrics_port is None and agent_ns.engine_host == "$(POD_IP)"
    # The gateway's admin port also serves /demand to the operator, so it is always there.
    pms = [d["metadata"]["name"] for d in docs if d["kind"] == "PodMonitor"]
    assert pms == ["ws-warmserve-gateway"]


def test_scrape_annotations_can_be_turned_off_or_overridden(k8s_bin_dir: Path) -> None:
    off = _render(k8s_bin_dir, "--set", "metrics.scrapeAnnotations=false")
    for kind, suffix in (("Deployment", "-operator"), ("DaemonSet", "-agent")):
        ann = _pod(off, kind, suffix)["metadata"]["annotations"]
        assert not [k for k in ann if k.startswith("prometheus.io/")]
        assert "checksum/tls" in ann
    mine = _render(
        k8s_bin_dir,
        "--set-string",
        "agent.podAnnotations.prometheus\\.io/scrape=false",
        "--set-string",
        "operator.podAnnotations.team=ml",
    )
    agent = _pod(mine, "DaemonSet", "-agent")["metadata"]["annotations"]
    assert agent["prometheus.io/scrape"] == "false"  # the user's value wins
    assert agent["prometheus.io/port"] == "9091"
    operator = _pod(mine, "Deployment", "-operator")["metadata"]["annotations"]
    assert operator["team"] == "ml" and operator["prometheus.io/scrape"] == "true"


def test_pod_monitors_select_the_pods_and_their_metrics_port(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set", "metrics.podMonitor.enabled=true",
        "--set", "metrics.podMonitor.labels.release=kube-prometheus",
        "--set", "metrics.podMonitor.scrapeTimeout=10s",
    )  # fmt: skip
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == [
        "ws-warmserve-agent",
        "ws-warmserve-gateway",
        "ws-warmserve-operator",
    ]
    gw_monitor = _find(docs, "PodMonitor", "-gateway")
    assert gw_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "admin"
    assert "admin" in _ports(_pod(docs, "Deployment", "-gateway")["spec"]["containers"][0])
    for kind, suffix in (("Deployment", "-operator"), ("DaemonSet", "-agent")):
        pod = _pod(docs, kind, suffix)
        monitor = _find(docs, "PodMonitor", suffix)
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["warmserve"]}
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint == {
            "port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"
        }  # fmt: skip
        assert "metrics" in _ports(pod["spec"]["containers"][0])
    # The operator's PodMonitor must not also select agent pods (and vice versa).
    agent_labels = _pod(docs, "DaemonSet", "-agent")["metadata"]["labels"]
    op_selector = _find(docs, "PodMonitor", "-operator")["spec"]["selector"]["matchLabels"]
    assert not op_selector.items() <= agent_labels.items()
    # Agents off: only the operator's.
    no_agent = _render(
        k8s_bin_dir, "--set", "metrics.podMonitor.enabled=true", "--set", "agent.enabled=false",
        "--set", "gateway.enabled=false",
    )  # fmt: skip
    assert [d["metadata"]["name"] for d in no_agent if d["kind"] == "PodMonitor"] == [
        "ws-warmserve-operator"
    ]


def test_kind_values_simulate_gpus_and_never_pull(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir, "-f", str(KIND_VALUES))
    agent = _find(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0]
    assert "--simulate-gpus=8x80GiB" in agent["args"]
    assert "nvidia.com/gpu" not in agent["resources"].get("limits", {})
    assert agent["imagePullPolicy"] == "Never"
    operator = _find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert "--window=60" in operator["args"]


def test_no_binding_grants_cluster_admin(k8s_bin_dir: Path) -> None:
    for doc in _render(k8s_bin_dir):
        if doc["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            assert doc["roleRef"]["name"] not in ("cluster-admin", "admin", "edit"), doc


# -- against the real API server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def crds_installed(k8s_control_plane: ControlPlane) -> None:
    """Install the CRDs (server-side dry-run of custom objects needs their CRDs to exist)."""
    k8s_control_plane.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds")
    )
    k8s_control_plane.kubectl(
        "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"
    )


@pytest.mark.parametrize(
    "set_args",
    [
        [],
        [
            "--set",
            "tls.enabled=false",
            "--set",
            "agent.enabled=false",
            "--set",
            "createPeering=false",
        ],
        [
            "--set",
            "tls.mode=existingSecret",
            "--set",
            "tls.serverSecret=mine",
            "--set",
            "tls.clientSecret=mine-client",
            "--set",
            "operator.replicas=2",
            "--set",
            "agent.simulateGpus=8x80GiB",
        ],
        ["-f", str(KIND_VALUES), "--set", "image.repository=warmserve", "--set", "image.tag=dev"],
        ["--set", "operator.metricsPort=0", "--set", "agent.metricsPort=0"],
    ],
    ids=["defaults", "minimal", "existing-secret-ha", "kind", "metrics-off"],
)
def test_rendered_manifests_pass_server_side_dry_run(
    k8s_control_plane: ControlPlane,
    k8s_namespace: str,
    crds_installed: None,
    set_args: list[str],
) -> None:
    rendered = k8s_control_plane.helm(
        "template", "ws", str(CHART), "--namespace", k8s_namespace, "--include-crds", *set_args
    ).stdout
    proc = k8s_control_plane.kubectl(
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-n",
        k8s_namespace,
        "-f",
        "-",
        input=rendered,
    )
    assert "(server dry run)" in proc.stdout
    assert "deployment.apps/ws-warmserve-operator" in proc.stdout


@dataclass
class Release:
    """A helm release in the test's namespace; cluster-scoped names (ClusterRole, peering) are
    derived from the unique namespace so tests and other suites sharing the API server never clash.
    """

    plane: ControlPlane
    namespace: str
    name: str

    @property
    def fullname(self) -> str:
        return f"{self.name}-warmserve"

    @property
    def peering(self) -> str:
        return f"{self.namespace}-peering"

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.plane.helm(*args, "--namespace", self.namespace, check=check)

    def get(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl("get", *args, "-n", self.namespace)


@pytest.fixture
def release(k8s_control_plane: ControlPlane, k8s_namespace: str) -> Iterator[Release]:
    """A release named after the namespace's random suffix; uninstalled at the end."""
    rel = Release(k8s_control_plane, k8s_namespace, "ws" + k8s_namespace.rsplit("-", 1)[1])
    yield rel
    rel.helm("uninstall", rel.name, "--wait=false", check=False)


def test_helm_install_upgrade_uninstall(release: Release) -> None:
    # No --wait: without kubelet the Deployment and DaemonSet never become ready.
    name, full = release.name, release.fullname
    out = release.helm("install", name, str(CHART), "--set", f"operator.peering={release.peering}")
    assert "is installed in namespace" in out.stdout and "WARNING" not in out.stdout
    status = json.loads(release.helm("status", name, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    for obj in (
        f"deployment/{full}-operator",
        f"daemonset/{full}-agent",
        f"serviceaccount/{full}-operator",
        f"serviceaccount/{full}-agent",
        f"secret/{full}-agent-server-tls",
        f"secret/{full}-operator-client-tls",
    ):
        release.get(obj)
    for crd in (
        "modeldeployments.warmserve.io",
        "gpunodes.warmserve.io",
        "clusterkopfpeerings.kopf.dev",
    ):
        release.get("crd", crd)
    release.get("clusterkopfpeering", release.peering)

    def cert() -> str:
        jsonpath = "jsonpath={.data.tls\\.crt}"
        return release.get("secret", f"{full}-agent-server-tls", "-o", jsonpath).stdout

    before = cert()
    assert before
    # An upgrade reuses the generated certificates (lookup), so pods are not restarted for nothing.
    release.helm(
        "upgrade", name, str(CHART), "--reuse-values", "--set", "operator.windowSeconds=60"
    )
    assert cert() == before
    deployment = json.loads(release.get("deployment", f"{full}-operator", "-o", "json").stdout)
    assert "--window=60" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert json.loads(release.helm("status", name, "-o", "json").stdout)["version"] == 2
    # Plaintext agents: the install notes say loudly what that means.
    out = release.helm(
        "upgrade",
        name,
        str(CHART),
        "--reuse-values",
        "--set",
        "tls.enabled=false",
        "--set",
        "tls.allowInsecure=true",
    )
    assert "WITHOUT authentication or encryption" in out.stdout
    ds = json.loads(release.get("daemonset", f"{full}-agent", "-o", "json").stdout)
    assert "--allow-insecure-listen" in ds["spec"]["template"]["spec"]["containers"][0]["args"]

    release.helm("uninstall", name)
    leftover = release.get(
        "clusterkopfpeering", release.peering, "--ignore-not-found", "-o", "name"
    )
    assert leftover.stdout == ""
    gone = release.get("deployment", f"{full}-operator", "--ignore-not-found", "-o", "name")
    assert gone.stdout.strip() == ""
    # CRDs stay (helm never deletes crds/ content), so ModelDeployments survive an uninstall.
    release.get("crd", "modeldeployments.warmserve.io")


def test_helm_install_wait_places_agents_on_gpu_nodes_only(
    k8s_controllers_plane: ControlPlane,
) -> None:
    # With kube-controller-manager, kube-scheduler and kwok fake nodes, `helm install --wait`
    # really waits for Pods: this checks the chart's scheduling (node selector, GPU taint
    # toleration, GPU request) on two 8-GPU nodes, a 4-GPU node and a CPU node.
    plane = k8s_controllers_plane
    ns = plane.create_namespace("chart-sched")
    pool = {"pool": ns}  # keeps other tests' DaemonSets off these nodes and vice versa
    gpu = {"nvidia.com/gpu.present": "true", **pool}
    taint = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    nodes = {
        f"{ns}-gpu8-a": fake_node(f"{ns}-gpu8-a", labels=gpu, gpus=8, taints=taint),
        f"{ns}-gpu8-b": fake_node(f"{ns}-gpu8-b", labels=gpu, gpus=8, taints=taint),
        f"{ns}-gpu4": fake_node(
            f"{ns}-gpu4", labels={**gpu, "small": "true"}, gpus=4, taints=taint
        ),
        f"{ns}-cpu": fake_node(f"{ns}-cpu", labels=pool),
    }
    for manifest in nodes.values():
        plane.kubectl("apply", "-f", "-", input=manifest)
    name = "ws" + ns.rsplit("-", 1)[1]
    try:
        plane.helm(
            "install", name, str(CHART), "-n", ns, "--wait", "--timeout=90s",
            "--set", f"operator.peering={ns}-peering",
            "--set-json", f"operator.nodeSelector={json.dumps(pool)}",
            # 8 GPUs per agent: the 4-GPU node cannot host one, so exclude it by label.
            "--set-json",
            "agent.affinity=" + json.dumps({"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "small", "operator": "DoesNotExist"},
                                          {"key": "pool", "operator": "In", "values": [ns]}]}
                ]}}}),
        )  # fmt: skip
        pods = json.loads(plane.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
        placed = {p["metadata"]["labels"]["app.kubernetes.io/component"]: [] for p in pods}
        for p in pods:
            assert p["status"]["phase"] == "Running", p["metadata"]["name"]
            placed[p["metadata"]["labels"]["app.kubernetes.io/component"]].append(
                p["spec"]["nodeName"]
            )
        assert sorted(placed["agent"]) == [f"{ns}-gpu8-a", f"{ns}-gpu8-b"]
        assert placed["operator"] == [f"{ns}-cpu"]  # GPU nodes are tainted for the operator
        agent_pod = next(
            p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"
        )
        limits = agent_pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "8"
    finally:
        plane.helm("uninstall", name, "-n", ns, "--wait=false", check=False)
        for node in nodes:
            plane.kubectl("delete", "node", node, "--wait=false", check=False)
        plane.delete_namespace(ns)


def test_kind_values_install_and_become_ready_on_kind_like_nodes(
    k8s_controllers_plane: ControlPlane,
) -> None:
    # What e2e/kind-up.sh does, minus Docker: two untainted workers labelled
    # nvidia.com/gpu.present=true without GPU capacity; `helm install --wait` must succeed.
    plane = k8s_controllers_plane
    ns = plane.create_namespace("chart-kind")
    pool = {"pool": ns}
    nodes = [f"{ns}-w1", f"{ns}-w2"]
    for node in nodes:
        labels = {"nvidia.com/gpu.present": "true", **pool}
        plane.kubectl("apply", "-f", "-", input=fake_node(node, labels=labels))
    name = "ws" + ns.rsplit("-", 1)[1]
    try:
        plane.helm(
            "install", name, str(CHART), "-n", ns, "--wait", "--timeout=90s",
            "-f", str(KIND_VALUES), "--set", f"operator.peering={ns}-peering",
            "--set-json", f"operator.nodeSelector={json.dumps(pool)}",
            "--set-json", f"agent.nodeSelector={json.dumps(pool)}",
        )  # fmt: skip
        ds = json.loads(plane.kubectl("get", "ds", "-n", ns, "-o", "json").stdout)["items"][0]
        assert ds["status"]["numberReady"] == 2
    finally:
        plane.helm("uninstall", name, "-n", ns, "--wait=false", check=False)
        for node in nodes:
            plane.kubectl("delete", "node", node, "--wait=false", check=False)
        plane.delete_namespace(ns)


def test_gateway_objects_and_the_operator_wiring(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir, "--set", "gateway.apiKeys.existingSecret=keys")
    dep = _find(docs, "Deployment", "-gateway")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ws-warmserve-gateway"
    c = pod["containers"][0]
    ns = _parse_cli(c["args"])
    assert (ns.port, ns.admin_port, ns.api_keys) == (8000, 9092, Path("/etc/warmserve/api-keys"))
    assert _ports(c) == {"http": 8000, "admin": 9092}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "admin"}
    keys = {"name": "api-keys", "secret": {"secretName": "keys", "defaultMode": 0o440}}
    assert keys in pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == ns.drain_delay + ns.drain_seconds + 5
    # The edge's settings reach the gateway as its flags, at their defaults.
    assert (ns.max_header_block_bytes, ns.header_timeout, ns.idle_timeout) == (32768, 10, 75)
    assert (ns.max_connections, ns.ttfb_timeout, ns.trusted_proxy_hops) == (4096, 60, 0)
    assert ns.routes == [] and ns.drain_delay == 5
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9092"
    pdb = _find(docs, "PodDisruptionBudget", "-gateway")
    assert pdb["spec"]["minAvailable"] == 1
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    api_svc = _find(docs, "Service", "-gateway")
    assert api_svc["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    demand = _find(docs, "Service", "-gateway-demand")
    assert demand["spec"]["clusterIP"] == "None" and demand["spec"]["publishNotReadyAddresses"]
    assert demand["spec"]["ports"][0]["name"] == "admin"
    # The operator reads the replicas' held requests from that Service's EndpointSlices.
    op = _parse_cli(_pod(docs, "Deployment", "-operator")["spec"]["containers"][0]["args"])
    assert op.gateway_service == "warmserve/ws-warmserve-gateway-demand"
    assert op.gateway_port_name == "admin"
    # One replica: no PDB (it would block every node drain); gateway off: nothing of it.
    one = _render(k8s_bin_dir, "--set", "gateway.replicas=1")
    assert not [d for d in one if d["kind"] == "PodDisruptionBudget"]
    off = _render(k8s_bin_dir, "--set", "gateway.enabled=false")
    assert not [d for d in off if "gateway" in d["metadata"]["name"]]
    op_off = _parse_cli(_pod(off, "Deployment", "-operator")["spec"]["containers"][0]["args"])
    assert op_off.gateway_service is None


def test_gateway_values_are_checked(k8s_bin_dir: Path) -> None:
    for set_args, message in (
        (["--set", "gateway.adminPort=8000"], "gateway.port and gateway.adminPort must differ"),
        (["--set", "gateway.replicas=-1"], "replicas"),
        (["--set", "gateway.maxBodyBytes=lots"], "maxBodyBytes"),
        (["--set", "gateway.service.type=Ingress"], "type"),
        (["--set", "gateway.typo=1"], "typo"),
        (["--set", "gateway.maxConnections=0"], "maxConnections"),
        (["--set", "gateway.headerTimeoutSeconds=0"], "headerTimeoutSeconds"),
        (["--set", "gateway.drainDelaySeconds=-1"], "drainDelaySeconds"),
        (["--set", "gateway.trustedProxyHops=17"], "trustedProxyHops"),
        (["--set-json", 'gateway.extraRoutes=["/v1/../metrics"]'], "extraRoutes"),
    ):
        proc = _helm(k8s_bin_dir, "template", "ws", str(CHART), *set_args, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (set_args, proc.stderr)


def _demand_token(doc: dict) -> bool:
    """The /demand token Secret (templates/demand-token.yaml), rendered in every TLS mode."""
    return str(doc["metadata"]["name"]).endswith("-demand-token")
