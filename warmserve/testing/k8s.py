"""A real Kubernetes control plane for tests and benchmarks: kube-apiserver + etcd on loopback.

:class:`ControlPlane` starts etcd and kube-apiserver built from the Go module proxy at the
versions pinned in ``hack/k8s/versions.env`` (``hack/k8s/build.sh``, cached after the first
build) on free loopback ports with a fresh PKI (``hack/k8s/start.sh``); it stops them (also when
the process that started it dies: a watchdog follows its PID).  ``apply_chart_*_rbac`` apply the
Helm chart's ServiceAccounts and RBAC, so a test or bench runs a component with exactly the
rights the chart grants; ``fake_node`` is a kwok Node for the controllers plane.

Why a real API server instead of mocks: only the real one enforces RBAC, CRD schemas, status
subresources, finalizers and admission, which is what the operator and the chart get wrong.
What does not happen without ``with_controllers`` (no kube-controller-manager, no kubelet):
namespace deletion never completes, ownerReference GC never runs, Deployments/DaemonSets never
create Pods, namespaces get no ``default`` ServiceAccount.

It needs a source checkout (``hack/k8s``, the chart); the pytest fixtures over it are in
``tests/k8s_support.py``.  (Just over 400 lines: the one class and the chart helpers its users
call with it.)
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK = REPO_ROOT / "hack" / "k8s"
_BIN_ENV = "WARMSERVE_K8S_BIN"
_REQUIRED_BINARIES = ("kube-apiserver", "etcd", "kubectl", "helm")
_CONTROLLER_BINARIES = ("kube-controller-manager", "kube-scheduler", "kwok", "kwok-stages.yaml")


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


def stop_control_plane(workdir: Path) -> None:
    """Stop what ``hack/k8s/start.sh`` started in ``workdir`` and delete etcd's data (idempotent;
    also after a start that was cut short, once a process has written its pid file)."""
    _run([str(HACK / "stop.sh"), str(workdir)], check=False, timeout=60)


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
        stop_control_plane(self.workdir)

    def check(self) -> None:
        """Raise :class:`ControlPlaneError` with its last log lines if etcd or kube-apiserver
        (or a controller it runs) has exited."""
        for pid_file in sorted(self.workdir.glob("*.pid")):
            if pid_file.stem == "watchdog":
                continue
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # being stopped: stop.sh removes the pid files
            if not Path(f"/proc/{pid}").exists():
                log = self.workdir / f"{pid_file.stem}.log"
                text = log.read_text(errors="replace") if log.exists() else ""
                last = "\n".join(text.splitlines()[-20:])
                raise ControlPlaneError(f"{pid_file.stem} exited (log {log}):\n{last}")

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
