"""The embedded control plane: ``hack/k8s`` builds kube-apiserver, etcd, kubectl and helm from
the Go module proxy once and caches them (~/.cache/warmserve-k8s); ``start.sh`` runs etcd +
kube-apiserver on loopback.  This module finds the checkout's ``hack/k8s``, builds with visible
progress, starts and stops the plane, and runs kubectl / helm against it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .state import StackError

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack" / "k8s"
CHART = REPO / "helm" / "warmserve"
NEEDED = ("kube-apiserver", "etcd", "kubectl", "helm")


def check_checkout() -> None:
    for p in (HACK / "build.sh", HACK / "start.sh", CHART / "Chart.yaml"):
        if not p.is_file():
            raise StackError(
                f"warmserve up needs a source checkout of warmserve ({p.relative_to(REPO)} is "
                f"missing under {REPO}); clone the repository and run it from there"
            )


def _bin_ok(d: Path) -> bool:
    return all(os.access(d / c, os.X_OK) for c in NEEDED)


def ensure_binaries(progress: Callable[[str], None]) -> Path:
    """The directory with the control-plane binaries, built first if needed.

    ``$WARMSERVE_K8S_BIN`` wins when it has them.  Otherwise ``hack/k8s/build.sh`` runs (it is
    instant when the binaries are cached); its progress lines and a heartbeat every 15 s go to
    ``progress``.  A failure is one line: the build's last error (e.g. no Go toolchain).
    """
    env_bin = os.environ.get("WARMSERVE_K8S_BIN")
    if env_bin and _bin_ok(Path(env_bin)):
        return Path(env_bin)
    check_checkout()
    proc = subprocess.Popen(
        ["bash", str(HACK / "build.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    last_error = ""
    t0 = time.monotonic()
    done = threading.Event()
    building = threading.Event()

    def heartbeat() -> None:
        while not done.wait(15):
            if building.is_set():
                m, s = divmod(int(time.monotonic() - t0), 60)
                progress(
                    f"building the control plane... {m}m{s:02d}s (the first build takes 5-30 min)"
                )

    threading.Thread(target=heartbeat, daemon=True).start()
    assert proc.stderr is not None and proc.stdout is not None
    try:
        for line in proc.stderr:
            line = line.rstrip()
            if not line:
                continue
            if "ERROR" in line:
                last_error = re.sub(r"^\[k8s-build[^\]]*\]\s*ERROR:\s*", "", line)
            if "building" in line:
                building.set()
            progress(line)
        out = proc.stdout.read().strip()
        rc = proc.wait()
    finally:
        done.set()
    if rc != 0 or not out:
        why = last_error or f"hack/k8s/build.sh exited with status {rc}"
        raise StackError(f"cannot build the control plane: {why}")
    return Path(out.splitlines()[-1])


@dataclass
class ControlPlane:
    dir: Path
    bin: Path
    admin_kubeconfig: Path
    server: str

    @staticmethod
    def start(directory: Path, bin_dir: Path, env: Mapping[str, str]) -> ControlPlane:
        """``hack/k8s/start.sh DIR`` (etcd + kube-apiserver, new session, ready when it returns)."""
        directory.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(
            ["bash", str(HACK / "start.sh"), str(directory)],
            env={**env, "WARMSERVE_K8S_BIN": str(bin_dir)},
            capture_output=True,
            text=True,
            start_new_session=True,
            timeout=300,
        )
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise StackError(f"the control plane did not start: {tail} (logs in {directory})")
        server = ""
        for line in (directory / "env").read_text().splitlines():
            if line.startswith("SERVER="):
                server = line.split("=", 1)[1]
        return ControlPlane(directory, bin_dir, directory / "kubeconfig", server)

    def pids(self) -> dict[str, int]:
        out = {}
        for f in sorted(self.dir.glob("*.pid")):
            if f.stem in ("etcd", "kube-apiserver"):
                out[f.stem] = int(f.read_text().strip())
        return out

    @staticmethod
    def stop(directory: Path) -> None:
        if (directory / "kube-apiserver.pid").exists() or (directory / "etcd.pid").exists():
            subprocess.run(
                ["bash", str(HACK / "stop.sh"), str(directory)], capture_output=True, timeout=60
            )

    # ---- kubectl / helm --------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(self.admin_kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and p.returncode != 0:
            raise StackError(f"kubectl {' '.join(args[:3])}: {p.stderr.strip()[-300:]}")
        return p

    def apply(self, objects: Sequence[Mapping[str, Any]]) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        self.kubectl("apply", "-f", "-", input=json.dumps(doc))

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, home: Path, *args: str, timeout: float = 180) -> str:
        home.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "KUBECONFIG": str(self.admin_kubeconfig),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        p = subprocess.run(
            [str(self.bin / "helm"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if p.returncode != 0:
            raise StackError(f"helm {args[0]}: {p.stderr.strip()[-300:]}")
        return p.stdout

    def token(self, namespace: str, service_account: str, hours: int = 72) -> str:
        """A TokenRequest token for the ServiceAccount (what the kubelet mounts in a pod)."""
        return self.kubectl(
            "create", "token", service_account, "-n", namespace, f"--duration={hours}h"
        ).stdout.strip()

    def kubeconfig_for(self, token: str | None, namespace: str, path: Path) -> Path:
        """A kubeconfig for this plane: the ServiceAccount ``token``, or the admin certificate
        when ``token`` is None; ``namespace`` as the context's default."""
        ca = self.dir / "pki" / "ca.crt"
        if token is None:
            user: dict[str, Any] = {
                "client-certificate": str(self.dir / "pki" / "admin.crt"),
                "client-key": str(self.dir / "pki" / "admin.key"),
            }
        else:
            user = {"token": token}
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "warmserve-up",
                    "cluster": {"server": self.server, "certificate-authority": str(ca)},
                }
            ],
            "users": [{"name": "user", "user": user}],
            "contexts": [
                {
                    "name": "warmserve-up",
                    "context": {"cluster": "warmserve-up", "user": "user", "namespace": namespace},
                }
            ],
            "current-context": "warmserve-up",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=2))
        path.chmod(0o600)
        return path


def go_available() -> bool:
    return shutil.which("go") is not None
