"""Child processes of a test or a benchmark, supervised.

Each child runs in its own process group (a new session) with its output in ``<tmp>/<name>.log``.
:meth:`Procs.check` raises :class:`ChildFailed` as soon as a child has exited or logged a fatal
line (a Python traceback; kopf's "Activity 'startup' failed ...", which kopf retries every 60 s
while the process lives on), with the child's last log lines; :meth:`Procs.wait_for` checks that
while it waits, so a broken child ends a run at once instead of after the wait's timeout.
:meth:`Procs.stop_all` stops every group (SIGTERM, then SIGKILL), and :func:`exit_on_signals`
turns SIGTERM/SIGHUP into ``SystemExit`` so that the ``finally`` blocks that call it run; should
the owner die without either (SIGKILL), a watchdog process stops the groups it leaves behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Lines after which a child is broken even though it still runs.
FATAL: tuple[str, ...] = (
    r"Traceback \(most recent call last\)",
    r"Activity '[^']*' failed",
)


class ChildFailed(RuntimeError):
    """A supervised child exited or logged a fatal line; the message ends with its last lines."""


def tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


class _Child:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, fatal: Iterable[str]) -> None:
        self.proc = proc
        self.log = log
        self.fatal = re.compile("|".join(f"(?:{p})" for p in fatal)) if fatal else None
        self.read = 0  # bytes of the log already scanned
        self.rest = b""  # a line not yet complete at the last scan

    def fatal_line(self) -> str | None:
        if self.fatal is None or not self.log.exists():
            return None
        with self.log.open("rb") as f:
            f.seek(self.read)
            new = f.read()
        self.read += len(new)
        *done, self.rest = (self.rest + new).split(b"\n")
        for raw in done:
            line = raw.decode(errors="replace")
            if self.fatal.search(line):
                return line
        return None


class Procs:
    """Processes one test or bench starts; all are stopped at the end, whatever happens."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._children: dict[str, _Child] = {}
        self._checks: list[Callable[[], None]] = []
        # The children's process groups, for a watchdog that stops them when this process dies
        # without stop_all (SIGKILL, a crash): they run in sessions of their own, so nothing
        # else would.
        self._groups = tmp / f".procs-{os.getpid()}-{id(self):x}.pgids"
        self._watchdog: subprocess.Popen[bytes] | None = None

    def also_check(self, check: Callable[[], None]) -> None:
        """Run ``check`` (it raises when something this run needs has failed, e.g.
        :meth:`~warmserve.testing.k8s.ControlPlane.check`) in every :meth:`check`."""
        self._checks.append(check)

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        *,
        fatal: Iterable[str] = FATAL,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as ``name`` in a new process group; ``fatal``: regular expressions of
        log lines that make :meth:`check` fail (``()``: only an exit does)."""
        path = self.tmp / f"{name}.log"
        log = path.open("ab")
        try:
            p = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()  # the child holds its own descriptor
        self.procs[name] = p
        self._children[name] = _Child(p, path, tuple(fatal))
        self._record_groups()
        return p

    def _record_groups(self) -> None:
        tmp = self._groups.with_suffix(".tmp")
        tmp.write_text("".join(f"{p.pid}\n" for p in self.procs.values()))
        tmp.replace(self._groups)
        if self._watchdog is None:
            self._watchdog = subprocess.Popen(
                ["bash", "-c", _WATCHDOG, "procs-watchdog", str(os.getpid()), str(self._groups)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def log(self, name: str, lines: int = 40) -> str:
        return f"--- {name} log (last {lines} lines) ---\n" + tail(self.tmp / f"{name}.log", lines)

    def check(self, names: Iterable[str] | None = None) -> None:
        """Raise :class:`ChildFailed` if a child that should run has exited or logged a fatal
        line since the last check, and run the checks :meth:`also_check` added; ``names``: only
        those children, no other check."""
        if names is None:
            for check in self._checks:
                check()
            children = list(self._children.items())
        else:
            children = [(n, self._children[n]) for n in names if n in self._children]
        for name, child in children:
            code = child.proc.poll()
            line = child.fatal_line()
            if code is not None:
                reason = f"exited with status {code}"
            elif line is not None:
                reason = f"logged a fatal error: {line.strip()[:300]}"
            else:
                continue
            raise ChildFailed(f"{name} {reason} (log {child.log})\n{self.log(name)}")

    def wait_for(
        self,
        pred: Callable[[], Any],
        what: str,
        timeout: float,
        step: float = 0.3,
        names: Iterable[str] | None = None,
    ) -> Any:
        """``pred()``'s first true value; :class:`ChildFailed` as soon as a child (of ``names``,
        default: any) fails, :class:`TimeoutError` (with every child's last lines) after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last_exc: Exception | None = None
        while True:
            self.check(names)
            try:
                value = pred()
                if value:
                    return value
            except Exception as exc:  # the API may answer 404 until a component catches up
                last_exc = exc
            if time.monotonic() > deadline:
                logs = "\n".join(self.log(n) for n in self.procs)
                raise TimeoutError(
                    f"not within {timeout:.0f}s: {what} (last error: {last_exc})\n{logs}"
                )
            time.sleep(step)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal ``name``'s whole process group (as a pod's containers die together)."""
        p = self.procs.pop(name)
        self._children.pop(name, None)
        _signal_group(p, sig)
        p.wait(timeout=20)
        self._record_groups()

    def stop_all(self, grace: float = 3.0) -> None:
        """SIGTERM every child's group; whatever still runs after ``grace`` seconds (a child or
        anything it started) gets SIGKILL."""
        for p in self.procs.values():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            # an agent still streaming long completions may take a while: not worth waiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)  # also the grandchildren of a child that exited
            p.wait(timeout=10)
        self.procs.clear()
        self._children.clear()
        self._groups.unlink(missing_ok=True)  # the watchdog sees it gone and exits
        if self._watchdog is not None:
            self._watchdog.wait(timeout=10)
            self._watchdog = None


# Polls the owner every second; once it is gone with its group list still there, TERMs then KILLs
# every listed group.  Its own session: a signal to the owner's group does not reach it.
_WATCHDOG = """
while kill -0 "$1" 2>/dev/null && [ -e "$2" ]; do sleep 1; done
[ -e "$2" ] || exit 0
groups=$(cat "$2")
for g in $groups; do kill -TERM -- "-$g" 2>/dev/null; done
sleep 3
for g in $groups; do kill -KILL -- "-$g" 2>/dev/null; done
rm -f "$2"
"""


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)  # the child leads its group (start_new_session)


def wait_for(pred: Callable[[], Any], what: str, timeout: float, logs: Callable[[], str]) -> Any:
    """``pred()``'s first true value within ``timeout`` seconds, else ``AssertionError`` with
    ``logs()`` (no child supervision: tests that kill children on purpose use this one)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:  # the API may answer 404 until the operator catches up
            last_exc = exc
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout:.0f}s: {what} (last error: {last_exc})\n{logs()}")


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_times(path: Path, pattern: str) -> list[float]:
    """Unix times of the log lines (``%(asctime)s`` first) that match ``pattern``."""
    out: list[float] = []
    if not path.exists():
        return out
    rx = re.compile(pattern)
    for line in path.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m and rx.search(line):
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` (SIGINT keeps raising
    ``KeyboardInterrupt``), so the caller's ``finally`` blocks stop what it started; a second
    signal while they run is ignored, so it cannot cut the clean-up short."""

    def handler(signum: int, _frame: Any) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        print(f"stopping on signal {signum}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, handler)


def run_supervised(main: Callable[[], int], prog: str) -> int:
    """``main()``'s exit status, with SIGTERM/SIGHUP/SIGINT ending it through its ``finally``
    blocks (:func:`exit_on_signals`; status 128 + the signal); a child's failure, a broken
    control plane or a wait that timed out is printed as ``prog: <what, with the last log
    lines>`` and status 1."""
    from warmserve.testing.k8s import ControlPlaneError

    exit_on_signals()
    try:
        return main()
    except (ChildFailed, ControlPlaneError, TimeoutError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; everything it started is stopped", file=sys.stderr)
        return 128 + signal.SIGINT
