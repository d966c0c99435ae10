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

``fake_node(name, labels=..., gpus=..., taints=...)`` returns a kwok-managed Node manifest for
the controllers plane (Pods scheduled there become Running without containers).

If the binaries are missing the plugin builds them (``hack/k8s/build.sh``) once, right after
collection and before any test's timeout starts; it never skips.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
HACK = REPO_ROOT / "hack" / "k8s"
CONTROL_PLANE_FIXTURE = "k8s_control_plane"
BIN_FIXTURE = "k8s_bin_dir"
_BIN_ENV = "WARMSERVE_K8S_BIN"
_REQUIRED_BINARIES = ("kube-apiserver", "etcd", "kubectl", "helm")
_CONTROLLER_BINARIES = ("kube-controller-manager", "kube-scheduler", "kwok", "kwok-stages.yaml")
CONTROLLERS_FIXTURE = "k8s_controllers_plane"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached; the message says which step."""


def _bin_dir_from_env(names: Sequence[str]) -> Path | None:
    value = os.environ.get(_BIN_ENV)
    if not value:
        return None
    path = Path(value)
    if all((path / name).is_file() for name in names):
        return path
    return None


def ensure_binaries(*, with_controllers: bool = False) -> Path:
    """Return the directory holding the pinned binaries, building them if needed.

    ``$WARMSERVE_K8S_BIN`` wins when it holds every binary (``hack/test.sh`` sets it after
    building); otherwise ``hack/k8s/build.sh`` reuses its cache or builds (minutes, once).
    ``with_controllers`` adds kube-controller-manager, kube-scheduler and kwok.
    """
    names = _REQUIRED_BINARIES + (_CONTROLLER_BINARIES if with_controllers else ())
    from_env = _bin_dir_from_env(names)
    if from_env is not None:
        return from_env
    argv = [str(HACK / "build.sh")] + (["--with-controllers"] if with_controllers else [])
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise ControlPlaneError(
            f"hack/k8s/build.sh failed with exit status {proc.returncode}; its progress and the "
            "compiler errors are in the output above"
        )
    bin_dir = Path(proc.stdout.strip().splitlines()[-1])
    os.environ[_BIN_ENV] = str(bin_dir)
    return bin_dir


def _run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    input: str | None = None,
    check: bool = True,
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(argv),
        input=input,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise ControlPlaneError(
            f"{Path(argv[0]).name} {' '.join(argv[1:])} exited {proc.returncode}:\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver pair and the files that describe it."""

    workdir: Path
    bin_dir: Path
    server: str
    kubeconfig: Path

    @property
    def ca_file(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @classmethod
    def start(
        cls, workdir: Path, *, bin_dir: Path | None = None, with_controllers: bool = False
    ) -> ControlPlane:
        """Start etcd + kube-apiserver in ``workdir`` and wait for ``/readyz``.

        ``with_controllers`` also runs kube-controller-manager and kube-scheduler. The start
        script writes ``workdir/{kubeconfig,env,*.log,*.pid}``; on failure it prints the last
        apiserver/etcd log lines, which end up in the exception message.
        """
        bin_dir = bin_dir or ensure_binaries(with_controllers=with_controllers)
        env = dict(os.environ, **{_BIN_ENV: str(bin_dir)})
        extra = ["--with-controllers"] if with_controllers else []
        argv = [str(HACK / "start.sh"), str(workdir), "--watch-pid", str(os.getpid()), *extra]
        for _attempt in range(3):
            proc = _run(argv, env=env, check=False, timeout=300)
            # Free ports are picked before binding; on a busy machine another process can take
            # one in between. That (and only that) is worth a retry on fresh ports.
            if proc.returncode == 0 or "address already in use" not in proc.stderr:
                break
        if proc.returncode != 0:
            raise ControlPlaneError(f"hack/k8s/start.sh failed:\n{proc.stderr.strip()}")
        values = dict(
            line.split("=", 1) for line in (workdir / "env").read_text().splitlines() if "=" in line
        )
        return cls(
            workdir=workdir,
            bin_dir=bin_dir,
            server=values["SERVER"],
            kubeconfig=Path(proc.stdout.strip().splitlines()[-1]),
        )

    def stop(self) -> None:
        """Stop every process it started and delete etcd's data (idempotent)."""
        _run([str(HACK / "stop.sh"), str(self.workdir)], check=False, timeout=60)

    # -- commands -------------------------------------------------------------------------------
    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """Environment for kubectl/helm/kopf subprocesses: only this cluster, private helm dirs."""
        helm_home = self.workdir / "helm-home"
        return dict(
            os.environ,
            KUBECONFIG=str(kubeconfig or self.kubeconfig),
            HELM_CACHE_HOME=str(helm_home / "cache"),
            HELM_CONFIG_HOME=str(helm_home / "config"),
            HELM_DATA_HOME=str(helm_home / "data"),
            PATH=f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        )

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster (admin unless ``kubeconfig`` is given)."""
        return _run(
            [str(self.bin_dir / "kubectl"), *args],
            env=self.env(kubeconfig),
            input=input,
            check=check,
            timeout=timeout,
        )

    def helm(
        self, *args: str, check: bool = True, timeout: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm against this cluster with the admin kubeconfig."""
        return _run(
            [str(self.bin_dir / "helm"), *args], env=self.env(), check=check, timeout=timeout
        )

    # -- raw HTTPS ------------------------------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        pki = self.workdir / "pki"
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    def get_raw(self, path: str) -> bytes:
        """GET ``path`` as admin (e.g. ``/version``, ``/openapi/v2``)."""
        with urllib.request.urlopen(
            self.server + path, context=self._ssl_context(), timeout=30
        ) as resp:
            return resp.read()

    def version(self) -> dict[str, Any]:
        return json.loads(self.get_raw("/version"))

    # -- namespaces and ServiceAccount credentials ---------------------------------------------
    def create_namespace(self, hint: str = "t") -> str:
        """Create a namespace named ``<hint>-<8 hex>`` (hint sanitised to a DNS label)."""
        base = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-")[:40].strip("-") or "t"
        name = f"{base}-{uuid.uuid4().hex[:8]}"
        self.kubectl("create", "namespace", name)
        return name

    def delete_namespace(self, name: str) -> None:
        """Delete without waiting: with no namespace controller it stays Terminating (harmless)."""
        self.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)

    def service_account_token(
        self, namespace: str, service_account: str, *, expiration_s: int = 3600
    ) -> str:
        """Issue a bound token for an existing ServiceAccount via the TokenRequest API.

        The apiserver signs it with ``--service-account-signing-key-file``; no controller needed.
        """
        if expiration_s < 600:
            raise ValueError(f"expiration_s must be >= 600 (apiserver minimum), got {expiration_s}")
        proc = self.kubectl(
            "create",
            "token",
            service_account,
            "-n",
            namespace,
            f"--duration={expiration_s}s",
            check=False,
        )
        if proc.returncode != 0:
            raise ControlPlaneError(
                f"cannot issue a token for ServiceAccount {namespace}/{service_account} "
                f"(does it exist?): {proc.stderr.strip()}"
            )
        return proc.stdout.strip()

    def sa_kubeconfig(
        self,
        namespace: str,
        service_account: str,
        *,
        expiration_s: int = 3600,
        path: Path | None = None,
    ) -> Path:
        """Write a kubeconfig authenticating as ``system:serviceaccount:<namespace>:<sa>``.

        Use it to run the operator (kopf) with exactly the RBAC the chart grants, so a missing
        rule fails the test instead of hiding behind admin credentials.
        """
        token = self.service_account_token(namespace, service_account, expiration_s=expiration_s)
        path = path or self.workdir / f"kubeconfig-{namespace}-{service_account}"
        ca_data = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "warmserve-test",
                    "cluster": {"server": self.server, "certificate-authority-data": ca_data},
                }
            ],
            "users": [{"name": service_account, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "sa",
                    "context": {
                        "cluster": "warmserve-test",
                        "user": service_account,
                        "namespace": namespace,
                    },
                }
            ],
            "current-context": "sa",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML
        path.chmod(0o600)
        return path


def _apply_chart_objects(
    helm: Callable[..., subprocess.CompletedProcess[str]],
    kubectl: Callable[..., subprocess.CompletedProcess[str]],
    namespace: str,
    release: str,
    templates: Sequence[str],
    kinds: frozenset[str],
    set_args: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Render ``templates`` of the chart for ``release`` in ``namespace``, apply the objects of
    ``kinds`` (each names its namespace) and return them."""
    import yaml

    shows = [a for t in templates for a in ("--show-only", f"templates/{t}")]
    rendered = helm(
        "template", release, str(REPO_ROOT / "helm" / "warmserve"), "-n", namespace, *shows,
        *set_args,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in kinds]
    kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    )
    return docs


_RBAC_KINDS = frozenset(
    {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
)


def _service_account(docs: list[dict[str, Any]], component: str) -> str:
    return next(
        d["metadata"]["name"]
        for d in docs
        if d["kind"] == "ServiceAccount"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    )


def apply_chart_operator_rbac(
    helm: Callable[..., subprocess.CompletedProcess[str]],
    kubectl: Callable[..., subprocess.CompletedProcess[str]],
    namespace: str,
    release: str,
) -> str:
    """Render the chart's operator ServiceAccount and RBAC for ``release``, apply them in
    ``namespace`` and return the ServiceAccount's name (tests then run the operator with its token,
    so a missing RBAC rule fails them)."""
    docs = _apply_chart_objects(
        helm, kubectl, namespace, release, ("serviceaccount.yaml", "rbac.yaml"), _RBAC_KINDS
    )
    return _service_account(docs, "operator")


def host_ip() -> str:
    """This machine's non-loopback IPv4 address.

    EndpointSlices refuse loopback addresses, so tests that stand in for the EndpointSlice
    controller (no kubelet here) list local processes under this address."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("198.51.100.1", 9))  # no packet is sent: this only picks the route
        ip = s.getsockname()[0]
    if ip.startswith("127."):
        ip = socket.gethostbyname(socket.gethostname())
    if ip.startswith("127."):
        raise RuntimeError("no non-loopback IPv4 address: EndpointSlices refuse loopback ones")
    return ip


def apply_chart_gateway_rbac(
    helm: Callable[..., subprocess.CompletedProcess[str]],
    kubectl: Callable[..., subprocess.CompletedProcess[str]],
    namespace: str,
    release: str,
    *set_args: str,
) -> str:
    """Render the chart's gateway ServiceAccount and RBAC for ``release`` (extra ``--set``
    arguments allowed), apply them in ``namespace`` and return the ServiceAccount's name."""
    docs = _apply_chart_objects(
        helm, kubectl, namespace, release, ("gateway.yaml", "gateway-rbac.yaml"), _RBAC_KINDS,
        set_args,
    )  # fmt: skip
    return _service_account(docs, "gateway")


def fake_node(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    gpus: int = 0,
    taints: Sequence[dict[str, str]] = (),
) -> str:
    """Manifest (JSON) of a Node that kwok manages on the controllers plane.

    kwok (annotation ``kwok.x-k8s.io/node=fake``) makes it Ready and marks Pods bound to it
    Running without starting containers; ``gpus`` adds ``nvidia.com/gpu`` capacity.
    """
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110"}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"kubernetes.io/hostname": name, "type": "kwok", **(labels or {})},
        },
        "spec": {"taints": list(taints)},
        "status": {"allocatable": capacity, "capacity": capacity},
    }
    return json.dumps(node)


# ---------------------------------------------------------------------------------------------
# pytest plugin


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
