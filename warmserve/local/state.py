"""The local stack's directory and its ``stack.json``: what ``warmserve down`` reads.

Layout of the state directory (``$WARMSERVE_UP_DIR``, default
``${XDG_STATE_HOME:-~/.local/state}/warmserve/up``)::

    stack.json          id, state, processes (PID records), endpoints; removed by `down`
    kubeconfig          admin kubeconfig, namespace warmserve (printed by `up`)
    controlplane/       hack/k8s/start.sh's work dir (PKI, etcd/apiserver logs and PIDs)
    pods/<pod>/         each pod's log, mounted secrets, ServiceAccount kubeconfig
    models/             stand-in weights (the agents' hostPath model cache)
    helm/               helm's private config/cache and the values file
    runs/<time>/        each replay's report (report.md, PNG plots, requests.jsonl, ...)

``stack.json`` is written as soon as anything starts and updated after every start, so a run
interrupted half-way is stopped completely by ``down``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .procs import ProcRecord, alive

STACK_FILE = "stack.json"
FORMAT = "warmserve.io/up-stack/v1"


class StackError(Exception):
    """A problem with the stack's state a person can act on; one line."""


def default_dir() -> Path:
    env = os.environ.get("WARMSERVE_UP_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "warmserve" / "up"


@dataclass
class Stack:
    """What one ``warmserve up`` started."""

    dir: Path
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    state: str = "starting"  # starting | running | replaying | ready
    started_unix: float = field(default_factory=time.time)
    up_pid: int = field(default_factory=os.getpid)
    processes: list[ProcRecord] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # endpoints, namespace, pod network

    @property
    def path(self) -> Path:
        return self.dir / STACK_FILE

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def controlplane_dir(self) -> Path:
        return self.dir / "controlplane"

    def add(self, rec: ProcRecord) -> None:
        self.processes.append(rec)
        self.save()

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "format": FORMAT,
            "id": self.id,
            "state": self.state,
            "startedUnix": self.started_unix,
            "upPid": self.up_pid,
            "processes": [p.to_json() for p in self.processes],
            "info": self.info,
        }
        tmp = self.path.with_name(STACK_FILE + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(self.path)

    @staticmethod
    def load(directory: Path) -> Stack | None:
        path = directory / STACK_FILE
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StackError(f"{path} is unreadable ({exc}); remove it by hand") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StackError(f"{path} is not a warmserve up record; remove it by hand")
        try:
            return Stack(
                dir=directory,
                id=str(doc["id"]),
                state=str(doc["state"]),
                started_unix=float(doc["startedUnix"]),
                up_pid=int(doc["upPid"]),
                processes=[ProcRecord.from_json(p) for p in doc["processes"]],
                info=dict(doc.get("info") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StackError(f"{path} is damaged ({exc!r}); remove it by hand") from exc

    def live(self) -> list[ProcRecord]:
        return [p for p in self.processes if alive(p)]

    def dead(self) -> list[ProcRecord]:
        return [p for p in self.processes if not alive(p)]

    def run_dirs(self) -> Iterator[Path]:
        yield from sorted((self.dir / "runs").glob("*"))


def check_can_start(directory: Path) -> None:
    """Refuse to start over a running stack or over the remains of one (one-line errors)."""
    old = Stack.load(directory)
    if old is None:
        return
    live, dead = old.live(), old.dead()
    when = time.strftime("%H:%M:%S", time.localtime(old.started_unix))
    if live and not dead:
        raise StackError(
            f"a warmserve stack is already running (started {when}, {len(live)} processes, "
            f"KUBECONFIG={old.kubeconfig}); `warmserve down` stops it"
        )
    gone = ", ".join(sorted({p.name for p in dead})[:4]) or "none recorded"
    raise StackError(
        f"a previous warmserve up left a stale stack in {directory} (started {when}; "
        f"{len(dead)} of {len(old.processes)} processes gone: {gone}); run `warmserve down` "
        "to clean it up"
    )


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def warmserve_command() -> str:
    """How to run ``warmserve`` from here: its name when that is this one on PATH, else the
    script next to this interpreter (``.venv/bin/warmserve`` after hack/up.sh)."""
    exe = Path(sys.executable).parent / "warmserve"
    found = shutil.which("warmserve")
    if found and exe.exists() and Path(found).resolve() == exe.resolve():
        return "warmserve"
    return _shown(exe) if exe.exists() else f"{sys.executable} -m warmserve"


def kubectl_command(bin_dir: Path, repo: Path) -> str:
    """The control plane's own kubectl, by the checkout's ``.k8s-cache/bin`` link when it
    points there."""
    link = repo / ".k8s-cache" / "bin"
    if link.exists() and link.resolve() == bin_dir.resolve():
        return _shown(link / "kubectl")
    return str(bin_dir / "kubectl")
