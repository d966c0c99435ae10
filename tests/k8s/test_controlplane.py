"""The real control plane fixtures: pinned versions, OpenAPI health, namespaces, RBAC tokens.

These run against the session's etcd + kube-apiserver (tests/k8s_support.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from warmserve.testing.k8s import HACK, ControlPlane, ControlPlaneError


def _pins() -> dict[str, str]:
    pins = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pins[key] = value
    return pins


def test_apiserver_reports_the_pinned_version(k8s_control_plane: ControlPlane) -> None:
    # helm's kubeVersion checks read /version; an unstamped build says v0.0.0-master.
    version = k8s_control_plane.version()
    k8s = _pins()["K8S_VERSION"]
    assert version["gitVersion"] == f"v{k8s}"
    assert (version["major"], version["minor"]) == ("1", k8s.split(".")[1])


def test_openapi_is_served_and_client_side_validation_works(
    k8s_control_plane: ControlPlane, k8s_namespace: str
) -> None:
    # A Go-toolchain skew once produced a broken OpenAPI document: kubectl then cannot validate.
    doc = json.loads(k8s_control_plane.get_raw("/openapi/v2"))
    assert doc["swagger"] == "2.0"
    assert "io.k8s.api.core.v1.ConfigMap" in doc["definitions"]
    bad = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c1}\ndata: {a: b}\nnotAField: 1\n"
    refused = k8s_control_plane.kubectl(
        "apply", "-n", k8s_namespace, "--validate=strict", "-f", "-", input=bad, check=False
    )
    assert refused.returncode != 0
    assert "notAField" in refused.stderr
    good = bad.replace("notAField: 1\n", "")
    k8s_control_plane.kubectl(
        "apply", "-n", k8s_namespace, "--validate=strict", "-f", "-", input=good
    )
    got = k8s_control_plane.kubectl("get", "configmap", "c1", "-n", k8s_namespace, "-o", "json")
    assert json.loads(got.stdout)["data"] == {"a": "b"}


def test_namespaces_are_unique_and_active(
    k8s_control_plane: ControlPlane, k8s_namespace: str
) -> None:
    other = k8s_control_plane.create_namespace("test_namespaces_are_unique_and_active")
    try:
        assert other != k8s_namespace
        phase = k8s_control_plane.kubectl(
            "get", "namespace", k8s_namespace, "-o", "jsonpath={.status.phase}"
        ).stdout
        assert phase == "Active"
    finally:
        k8s_control_plane.delete_namespace(other)
    # Without a namespace controller deletion never completes; the fixture must not wait for it.
    phase = k8s_control_plane.kubectl(
        "get", "namespace", other, "-o", "jsonpath={.status.phase}"
    ).stdout
    assert phase == "Terminating"


def test_kube_client_talks_to_the_same_cluster(kube_client, k8s_namespace: str, kubectl) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_client)
    core.create_namespaced_config_map(
        k8s_namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="from-python"))
    )
    names = kubectl("get", "configmaps", "-n", k8s_namespace, "-o", "name").stdout.split()
    assert "configmap/from-python" in names


def test_crd_schema_status_subresource_and_finalizers_are_enforced(
    k8s_control_plane: ControlPlane, k8s_namespace: str
) -> None:
    group = f"{k8s_namespace}.test.warmserve.io"  # a fresh group per run: CRDs are cluster-scoped
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"size": {"type": "integer", "minimum": 1}},
                                },
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
    kc = k8s_control_plane.kubectl
    kc("apply", "-f", "-", input=json.dumps(crd))
    kc("wait", "--for=condition=Established", f"crd/widgets.{group}", "--timeout=60s")

    def widget(size: int) -> str:
        return json.dumps(
            {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": "w1", "finalizers": ["test.warmserve.io/hold"]},
                "spec": {"size": size},
            }
        )

    refused = kc("apply", "-n", k8s_namespace, "-f", "-", input=widget(0), check=False)
    assert refused.returncode != 0
    assert "spec.size" in refused.stderr
    kc("apply", "-n", k8s_namespace, "-f", "-", input=widget(2))
    # status is a subresource: a main-resource patch must not change it.
    kc(
        "patch",
        f"widgets.{group}",
        "w1",
        "-n",
        k8s_namespace,
        "--type=merge",
        "-p",
        '{"status": {"x": 1}}',
    )
    status = kc(
        "get", f"widgets.{group}", "w1", "-n", k8s_namespace, "-o", "jsonpath={.status}"
    ).stdout
    assert status == ""
    kc(
        "patch",
        f"widgets.{group}",
        "w1",
        "-n",
        k8s_namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"x": 1}}',
    )
    status = kc(
        "get", f"widgets.{group}", "w1", "-n", k8s_namespace, "-o", "jsonpath={.status.x}"
    ).stdout
    assert status == "1"
    # A finalizer holds deletion until it is removed (operators rely on this).
    kc("delete", f"widgets.{group}", "w1", "-n", k8s_namespace, "--wait=false")
    held = kc(
        "get",
        f"widgets.{group}",
        "w1",
        "-n",
        k8s_namespace,
        "-o",
        "jsonpath={.metadata.deletionTimestamp}",
    ).stdout
    assert held
    kc(
        "patch",
        f"widgets.{group}",
        "w1",
        "-n",
        k8s_namespace,
        "--type=merge",
        "-p",
        '{"metadata": {"finalizers": null}}',
    )
    gone = kc(
        "get", f"widgets.{group}", "w1", "-n", k8s_namespace, "--ignore-not-found", "-o", "name"
    )
    assert gone.stdout.strip() == ""
    kc("delete", "crd", f"widgets.{group}", "--wait=false")


def test_sa_kubeconfig_authenticates_as_the_service_account_with_rbac_enforced(
    k8s_control_plane: ControlPlane, k8s_namespace: str, sa_kubeconfig
) -> None:
    kc = k8s_control_plane.kubectl
    kc("create", "serviceaccount", "reader", "-n", k8s_namespace)
    kc(
        "create",
        "role",
        "cm-reader",
        "-n",
        k8s_namespace,
        "--verb=get,list",
        "--resource=configmaps",
    )
    kc(
        "create",
        "rolebinding",
        "cm-reader",
        "-n",
        k8s_namespace,
        "--role=cm-reader",
        f"--serviceaccount={k8s_namespace}:reader",
    )
    cfg = sa_kubeconfig(k8s_namespace, "reader")
    who = kc("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}", kubeconfig=cfg)
    assert who.stdout == f"system:serviceaccount:{k8s_namespace}:reader"
    assert kc("get", "configmaps", kubeconfig=cfg).returncode == 0  # namespace from the context
    denied = kc("get", "secrets", kubeconfig=cfg, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr
    # The kubernetes python client (what kopf-adjacent code uses) accepts the file too.
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(config_file=str(cfg)))
    assert api.list_namespaced_config_map(k8s_namespace).items is not None


def test_sa_kubeconfig_errors_are_clear(
    k8s_control_plane: ControlPlane, k8s_namespace: str
) -> None:
    with pytest.raises(ControlPlaneError, match=rf"{k8s_namespace}/missing.*does it exist"):
        k8s_control_plane.sa_kubeconfig(k8s_namespace, "missing")
    with pytest.raises(ValueError, match="expiration_s must be >= 600"):
        k8s_control_plane.service_account_token(k8s_namespace, "x", expiration_s=10)


def test_helm_is_the_pinned_version(helm) -> None:
    short = helm("version", "--short").stdout.strip()
    assert short.split("+")[0] == _pins()["HELM_VERSION"]


def test_build_script_rejects_unknown_arguments_and_prints_pins() -> None:
    bad = subprocess.run([str(HACK / "build.sh"), "--nope"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown argument: --nope" in bad.stderr
    out = subprocess.run(
        [str(HACK / "build.sh"), "--print-versions"], capture_output=True, text=True, check=True
    ).stdout
    assert f"kubernetes v{_pins()['K8S_VERSION']}" in out


def test_stop_is_idempotent_and_ignores_stale_pid_files(tmp_path: Path) -> None:
    # stop.sh on a directory with no (or stale) PID files must succeed and kill nothing else.
    (tmp_path / "etcd.pid").write_text("999999999\n")
    subprocess.run([str(HACK / "stop.sh"), str(tmp_path)], check=True)
    subprocess.run([str(HACK / "stop.sh"), str(tmp_path)], check=True)
    assert not (tmp_path / "etcd.pid").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_start_then_stop_leaves_no_process_and_no_etcd_data(
    k8s_control_plane: ControlPlane, tmp_path: Path
) -> None:
    # A second, private control plane: it must come up on its own ports and stop completely.
    plane = ControlPlane.start(tmp_path / "cp", bin_dir=k8s_control_plane.bin_dir)
    pids = {
        name: int((plane.workdir / f"{name}.pid").read_text())
        for name in ("etcd", "kube-apiserver")
    }
    data_dir = Path((plane.workdir / "etcd.datadir").read_text().strip())
    try:
        assert plane.server != k8s_control_plane.server
        assert all(_alive(pid) for pid in pids.values())
        assert data_dir.is_dir()
        assert plane.version()["gitVersion"].startswith("v1.")
    finally:
        plane.stop()
    assert not any(_alive(pid) for pid in pids.values()), pids
    assert not data_dir.exists()
    assert not list(plane.workdir.glob("*.pid")) or list(plane.workdir.glob("*.pid")) == [
        plane.workdir / "watchdog.pid"
    ]


def test_kubeconfig_env_points_at_the_test_cluster(k8s_control_plane: ControlPlane) -> None:
    import os

    from kubernetes import client, config

    assert os.environ["KUBECONFIG"] == str(k8s_control_plane.kubeconfig)
    # read $KUBECONFIG now, as warmserve's clients do: the client library's default location
    # is fixed when it is first imported, which in a full run is at collection, before the
    # plane exists
    api = client.VersionApi(config.new_client_from_config(config_file=os.environ["KUBECONFIG"]))
    assert api.get_code().git_version == k8s_control_plane.version()["gitVersion"]


def test_watchdog_stops_the_plane_when_its_owner_is_killed(
    k8s_control_plane: ControlPlane, tmp_path: Path
) -> None:
    # A test process killed with SIGKILL runs no teardown; the watchdog must clean up anyway.
    import sys
    import time

    workdir = tmp_path / "orphan"
    bin_dir = k8s_control_plane.bin_dir
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from warmserve.testing.k8s import ControlPlane\n"
        f"plane = ControlPlane.start(Path({str(workdir)!r}), bin_dir=Path({str(bin_dir)!r}))\n"
        "for name in ('etcd', 'kube-apiserver'):\n"
        "    print((plane.workdir / f'{name}.pid').read_text().strip(), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    pids = [int(line) for line in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids), "watchdog did not stop the orphaned plane"
