"""A real Kubernetes control plane for tests: kube-apiserver + etcd on loopback, plus helpers.

This module is a pytest plugin (``tests/conftest.py`` lists it in ``pytest_plugins``), so every
test folder gets these fixtures without importing anything:

``k8s_bin_dir`` (session)
    The directory with the pinned ``kube-apiserver``, ``etcd``, ``kubectl`` and ``helm``.
``k8s_control_plane`` (session)
    A :class:`ControlPlane`: etcd and kube-apiserver built from the Go module proxy at the
    versions pinned in ``hack/k8s/versions.env`` (``hack/k8s/build.sh``), started once per test
    session by ``hack/k8s/start.sh`` on free loopback ports with a fresh PKI, stopped at the end
    (also when pytest itself is killed: a watchdog follows the pytest PID). While it runs,
    ``$KUBECONFIG`` points at its admin kubeconfig, so in-process clients (kopf's KopfRunner,
    ``kubernetes.config.load_kube_config()``) talk to it by default. Cluster-scoped objects
    (CRDs, ClusterRoles, ClusterKopfPeerings) are shared by every test of the session: derive
    their names (and helm release names) from the test's namespace.
``k8s_controllers_plane`` (session, separate)
    Like ``k8s_control_plane`` plus kube-controller-manager and kube-scheduler (and ``kwok`` in
    its ``bin_dir``): namespace deletion, GC and workloads progress there. Started on demand.
``k8s_namespace`` (function)
    A fresh namespace with a unique name; deleted afterwards without waiting.
``kube_client`` (session)
    A ``kubernetes.client.ApiClient`` for the admin kubeconfig (group ``system:masters``).
``kubectl`` (session)
    ``kubectl(*args, input=None, check=True) -> CompletedProcess`` with the admin kubeconfig.
``helm`` (session)
    ``helm(*args, check=True) -> CompletedProcess`` with the admin kubeconfig and private helm
    home directories (nothing under ``$HOME`` is touched).
``sa_kubeconfig`` (session)
    ``sa_kubeconfig(namespace, service_account, *, expiration_s=3600) -> Path``: a kubeconfig that
    authenticates as that ServiceAccount with a TokenRequest token, so a test can run the operator
    with exactly the RBAC the Helm chart grants it.

Why a real API server instead of mocks: only the real one enforces RBAC, CRD schemas, status
subresources, finalizers and admission, which is what the operator and the chart get wrong.
What does not happen on ``k8s_control_plane`` (no kube-controller-manager, no kubelet):
namespace deletion never completes, ownerReference GC never runs, Deployments/DaemonSets never
create Pods, namespaces get no ``default`` ServiceAccount. Tests must assert the state the
operator writes, not running Pods.

``warmserve.testing.k8s.fake_node(name, labels=..., gpus=..., taints=...)`` returns a
kwok-managed Node manifest for the controllers plane (Pods scheduled there become Running
without containers).

If the binaries are missing the plugin builds them (``hack/k8s/build.sh``) once, right after
collection and before any test's timeout starts; it never skips.  The control plane itself
(:class:`~warmserve.testing.k8s.ControlPlane` and the chart RBAC helpers) is importable from
``warmserve.testing.k8s``, which the benchmarks use too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from warmserve.testing.k8s import ControlPlane, ensure_binaries

CONTROL_PLANE_FIXTURE = "k8s_control_plane"
BIN_FIXTURE = "k8s_bin_dir"
CONTROLLERS_FIXTURE = "k8s_controllers_plane"



def _uses_control_plane(item: pytest.Item) -> bool:
    return CONTROL_PLANE_FIXTURE in getattr(item, "fixturenames", ())


def _uses_binaries(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return CONTROL_PLANE_FIXTURE in names or BIN_FIXTURE in names or _uses_controllers(item)


def _uses_controllers(item: pytest.Item) -> bool:
    return CONTROLLERS_FIXTURE in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests that need the control plane ``k8s`` (``-m "not k8s"`` deselects them)."""
    for item in items:
        if _uses_control_plane(item) or _uses_controllers(item):
            item.add_marker(pytest.mark.k8s)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before the first test runs, outside any per-test timeout."""
    if session.config.option.collectonly:
        return
    if any(_uses_controllers(item) for item in session.items):
        ensure_binaries(with_controllers=True)
    elif any(_uses_binaries(item) for item in session.items):
        ensure_binaries()


@pytest.fixture(scope="session")
def k8s_bin_dir() -> Path:
    """Directory with the pinned kube-apiserver, etcd, kubectl and helm (no cluster started)."""
    return ensure_binaries()


@pytest.fixture(scope="session")
def k8s_control_plane(
    tmp_path_factory: pytest.TempPathFactory, k8s_bin_dir: Path
) -> Iterator[ControlPlane]:
    """One etcd + kube-apiserver for the whole test session (about 3-5 s to start)."""
    # Inside pytest's basetemp, so logs of a failed run stay around for inspection.
    workdir = Path(tempfile.mkdtemp(prefix="k8s-", dir=tmp_path_factory.getbasetemp()))
    plane = ControlPlane.start(workdir, bin_dir=k8s_bin_dir)
    # Point in-process clients (kubernetes.config.load_kube_config(), kopf's KopfRunner) at this
    # cluster, and never at a developer's real one, for the whole session.
    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(plane.kubeconfig)
    try:
        yield plane
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
        plane.stop()
        shutil.rmtree(workdir / "helm-home", ignore_errors=True)


@pytest.fixture
def k8s_namespace(k8s_control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test; deleted (without waiting) afterwards."""
    name = k8s_control_plane.create_namespace(request.node.name)
    try:
        yield name
    finally:
        k8s_control_plane.delete_namespace(name)


@pytest.fixture(scope="session")
def kube_client(k8s_control_plane: ControlPlane) -> Iterator[Any]:
    """``kubernetes.client.ApiClient`` with admin credentials for this control plane."""
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(k8s_control_plane.kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def kubectl(k8s_control_plane: ControlPlane) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``kubectl(*args, input=None, check=True)``: the pinned kubectl as admin."""
    return k8s_control_plane.kubectl


@pytest.fixture(scope="session")
def helm(k8s_control_plane: ControlPlane) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``helm(*args, check=True)``: the pinned helm as admin, private helm home."""
    return k8s_control_plane.helm


@pytest.fixture(scope="session")
def sa_kubeconfig(k8s_control_plane: ControlPlane) -> Callable[..., Path]:
    """``sa_kubeconfig(namespace, service_account, *, expiration_s=3600) -> Path``."""
    return k8s_control_plane.sa_kubeconfig


@pytest.fixture(scope="session")
def k8s_controllers_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A second, separate control plane that also runs kube-controller-manager and
    kube-scheduler (namespace deletion, GC, default ServiceAccounts, Deployments -> Pods); the
    binaries dir also has ``kwok`` to fake nodes and run Pods. Started only when a test asks."""
    bin_dir = ensure_binaries(with_controllers=True)
    workdir = Path(tempfile.mkdtemp(prefix="k8s-ctl-", dir=tmp_path_factory.getbasetemp()))
    plane = ControlPlane.start(workdir, bin_dir=bin_dir, with_controllers=True)
    try:
        yield plane
    finally:
        plane.stop()
