"""Processes of the local stack: started in their own session, recorded, stopped, found.

Every process the stack starts (the control plane through ``hack/k8s/start.sh``, each pod's
command, and whatever those start: agent worker processes, engines) carries the environment
variable :data:`MARKER_ENV` with the stack's id.  ``warmserve down`` stops the recorded process
groups first and then sweeps ``/proc`` for anything that still carries the marker, so nothing is
left behind even when a process re-parented itself or left its group.

A record keeps the process's start time (``/proc/PID/stat`` field 22), so a PID reused by an
unrelated process after a reboot or a long pause is never signalled.  Linux only (``/proc``),
like the control plane itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MARKER_ENV = "WARMSERVE_UP_STACK"
PROC = Path("/proc")


@dataclass(frozen=True)
class ProcRecord:
    """One process the stack started (the leader of its own process group)."""

    name: str
    pid: int
    start_ticks: int  # /proc/PID/stat field 22: tells this process from a later one with its PID
    log: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> ProcRecord:
        return ProcRecord(
            str(d["name"]), int(d["pid"]), int(d["start_ticks"]), str(d.get("log", ""))
        )


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot, or None when it does not exist."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall
    except (IndexError, ValueError):
        return None


def alive(rec: ProcRecord) -> bool:
    """The recorded process still runs (and is not a zombie)."""
    if start_ticks(rec.pid) != rec.start_ticks:
        return False
    try:
        state = (PROC / str(rec.pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def record_of(name: str, pid: int, log: str = "") -> ProcRecord:
    ticks = start_ticks(pid)
    if ticks is None:
        raise ProcessLookupError(f"{name}: process {pid} exited at once (see {log or 'its log'})")
    return ProcRecord(name, pid, ticks, log)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    log: Path,
) -> tuple[subprocess.Popen[bytes], ProcRecord]:
    """Start ``argv`` in a new session (Ctrl-C in the terminal of ``warmserve up`` does not
    reach it; ``warmserve down`` stops its whole group), output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        p = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    return p, record_of(name, p.pid, str(log))


def _signal_group(rec: ProcRecord, sig: int) -> None:
    if not alive(rec):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(rec.pid) == rec.pid:  # a group leader (spawn): its children go too
            os.killpg(rec.pid, sig)
        else:  # e.g. etcd, started in the background by hack/k8s/start.sh
            os.kill(rec.pid, sig)


def stop(records: Iterable[ProcRecord], timeout_s: float = 10.0) -> list[str]:
    """SIGTERM every live record's process group, SIGKILL what is left after ``timeout_s``;
    returns the names that needed SIGKILL."""
    recs = [r for r in records if alive(r)]
    for r in recs:
        _signal_group(r, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(r) for r in recs):
        time.sleep(0.1)
    killed = []
    for r in recs:
        if alive(r):
            killed.append(r.name)
            _signal_group(r, signal.SIGKILL)
    for r in recs:  # reap our own children (no zombies while the caller keeps running)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(r.pid, os.WNOHANG)
    return killed


def marked(stack_id: str) -> list[int]:
    """PIDs of this user's processes that carry ``MARKER_ENV=stack_id`` (not this process)."""
    want = f"{MARKER_ENV}={stack_id}".encode()
    me = os.getpid()
    out = []
    for d in PROC.iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if d.stat().st_uid != os.getuid():
                continue
            env = (d / "environ").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and want in env.split(b"\0"):
            out.append(int(d.name))
    return sorted(out)


def kill_marked(stack_id: str, timeout_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process still carrying the stack's marker; returns them."""
    pids = marked(stack_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and marked(stack_id):
        time.sleep(0.1)
    for pid in marked(stack_id):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def port_free(host: str, port: int) -> bool:
    """Nothing listens on ``host:port`` and it can be bound (SO_REUSEADDR, as servers do)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
