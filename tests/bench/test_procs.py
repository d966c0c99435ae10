"""``warmserve.testing.procs``, the supervision the benches and the end-to-end tests share, on
real processes: a child that exits or logs a fatal line ends a wait at once with its last lines;
stopping takes a child's own children with it; a SIGKILLed owner's children are stopped by the
watchdog; SIGTERM runs the owner's clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmserve.testing.procs import ChildFailed, Procs

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_child_that_exits_ends_the_wait_at_once_with_its_last_lines(tmp_path: Path) -> None:
    procs = Procs(tmp_path)
    try:
        code = "print('unexpected keyword argument fencing'); raise SystemExit(3)"
        procs.start("op", [sys.executable, "-c", code], ENV)
        t0 = time.monotonic()
        with pytest.raises(ChildFailed) as err:
            procs.wait_for(lambda: False, "something that never happens", 600)
        assert time.monotonic() - t0 < 10
        assert "op exited with status 3" in str(err.value)
        assert "unexpected keyword argument fencing" in str(err.value)
    finally:
        procs.stop_all()


def test_a_fatal_line_ends_the_wait_while_the_child_lives_on(tmp_path: Path) -> None:
    """kopf retries a failed startup every 60 s and the process stays up: the log says it."""
    line = (
        "level=ERROR logger=kopf.activities.startup Activity 'startup' failed with an exception "
        "and will try again in 60 seconds: TypeError"
    )
    code = f"import time; print({line!r}, flush=True); time.sleep(600)"
    procs = Procs(tmp_path)
    try:
        child = procs.start("op", [sys.executable, "-c", code], ENV)
        t0 = time.monotonic()
        with pytest.raises(ChildFailed) as err:
            procs.wait_for(lambda: False, "never", 600)
        assert time.monotonic() - t0 < 10
        assert child.poll() is None
        assert "op logged a fatal error" in str(err.value) and "TypeError" in str(err.value)
    finally:
        procs.stop_all()
    assert not _alive(child.pid)


def test_the_wait_checks_only_the_named_children(tmp_path: Path) -> None:
    procs = Procs(tmp_path)
    try:
        procs.start("broken", [sys.executable, "-c", "raise SystemExit(1)"], ENV)
        procs.start("fine", [sys.executable, "-c", "import time; time.sleep(600)"], ENV)
        time.sleep(1)
        assert procs.wait_for(lambda: "up", "fine up", 5, names=("fine",)) == "up"
        with pytest.raises(ChildFailed):
            procs.check()
    finally:
        procs.stop_all()


def test_stopping_a_child_stops_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 600 & echo $! > {pid_file}; wait"
    procs = Procs(tmp_path)
    child = procs.start("parent", ["bash", "-c", script], ENV)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    procs.stop_all(grace=1)
    assert _gone_within([child.pid, grandchild], 5)


def test_a_killed_owners_children_are_stopped_by_the_watchdog(tmp_path: Path) -> None:
    """SIGKILL runs no clean-up: the children (sessions of their own) would live on."""
    owner = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from warmserve.testing.procs import Procs\n"
        f"p = Procs(Path({str(tmp_path)!r}))\n"
        "c = p.start('child', ['sleep', '600'], dict(os.environ))\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.kill()
        proc.wait()
        assert _gone_within([child], 15), "the owner's child outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_runs_the_owners_clean_up(tmp_path: Path) -> None:
    marker = tmp_path / "cleaned"
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from warmserve.testing.procs import run_supervised\n"
        "def main():\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(600)\n"
        "    finally:\n"
        f"        Path({str(marker)!r}).write_text('yes')\n"
        "    return 0\n"
        "raise SystemExit(run_supervised(main, 'owner'))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "yes"
