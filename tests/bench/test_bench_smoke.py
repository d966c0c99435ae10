"""Every benchmark still runs: each runnable ``bench/*.py`` takes ``--smoke`` (seconds, tiny
sizes, the same code path, results in a temp dir, non-zero exit on any error) and CI runs them
all here, so a bench that no longer runs fails the suite; ``bench/engine_bench.py`` needs real
vLLM and runs in the vllm group (``tests/engines/test_engine_bench_smoke.py``).  Also: a bench
stopped with SIGTERM leaves no process behind.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
IN_VLLM_GROUP = {"engine_bench.py"}
SMOKE_TIMEOUT_S = 400  # one bench's bound; each takes seconds to a minute on 2 busy cores


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _runnable(tree: ast.Module) -> bool:
    """Has an ``if __name__ == "__main__":`` block."""
    return any(
        isinstance(n, ast.If)
        and isinstance(n.test, ast.Compare)
        and isinstance(n.test.left, ast.Name)
        and n.test.left.id == "__name__"
        for n in tree.body
    )


def _declares_smoke(tree: ast.Module) -> bool:
    """An ``add_argument("--smoke", ...)`` or ``add_smoke_flag(...)`` call."""
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        if name == "add_smoke_flag":
            return True
        if name == "add_argument" and any(
            isinstance(a, ast.Constant) and a.value == "--smoke" for a in n.args
        ):
            return True
    return False


def _imported(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module.split(".")[0])
    return out


def _benches() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if _runnable(_tree(p)))


def test_every_bench_takes_smoke_and_every_helper_is_a_benchs() -> None:
    """A new ``bench/*.py`` without ``--smoke`` fails here; a file with no ``__main__`` block
    must be a helper some bench imports (so its smoke covers it)."""
    files = sorted(BENCH.glob("*.py"))
    trees = {p: _tree(p) for p in files}
    runnable = [p for p in files if _runnable(trees[p])]
    assert len(runnable) >= 10, runnable
    missing = [p.name for p in runnable if not _declares_smoke(trees[p])]
    assert not missing, f"benches without --smoke: {missing}"
    used = set().union(*(_imported(trees[p]) for p in files))
    orphans = [p.name for p in files if not _runnable(trees[p]) and p.stem not in used]
    assert not orphans, f"bench/ modules that no bench imports and that do not run: {orphans}"
    meddling = [p.name for p in files if "sys.path" in p.read_text()]
    assert not meddling, f"benches touching sys.path (run them with the project venv): {meddling}"


def _results() -> dict[str, float]:
    d = BENCH / "results"
    return {p.name: p.stat().st_mtime for p in d.iterdir()} if d.is_dir() else {}


def _smoke(bench: Path, tmp: Path, env: dict[str, str]) -> tuple[str, int, float, str, list[str]]:
    tmp.mkdir()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(bench.relative_to(ROOT)), "--smoke"],
            cwd=ROOT,
            env={**env, "TMPDIR": str(tmp)},  # its temp dirs, results included, land here
            capture_output=True,
            text=True,
            timeout=SMOKE_TIMEOUT_S,
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -1, f"timed out after {SMOKE_TIMEOUT_S} s\n{exc.stdout or ''}{exc.stderr or ''}"
    wall = time.monotonic() - t0
    written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*.json"))
    return bench.name, rc, wall, out, written


def test_every_bench_smoke_runs(k8s_bin_dir: Path, tmp_path: Path) -> None:
    """All of them at once, three at a time: the control-plane benches mostly wait on their
    children, the simulator ones compute."""
    benches = [b for b in _benches() if b.name not in IN_VLLM_GROUP]
    env = {**os.environ, "WARMSERVE_K8S_BIN": str(k8s_bin_dir), "PYTHONHASHSEED": "0"}
    before = _results()
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = list(pool.map(lambda b: _smoke(b, tmp_path / b.stem, env), benches))
    total = time.monotonic() - t0
    summary = ", ".join(f"{name} {wall:.0f} s" for name, _rc, wall, _out, _w in runs)
    print(f"bench smoke: {len(runs)} benches in {total:.0f} s ({summary})")
    failed = [
        f"--- {name}: exit {rc}, {wall:.0f} s\n{out[-3000:]}"
        for name, rc, wall, out, _w in runs
        if rc != 0
    ]
    assert not failed, "\n".join(failed)
    no_json = [name for name, _rc, _wall, _out, written in runs if not written]
    assert not no_json, f"smoke runs that wrote no JSON into their temp dir: {no_json}"
    assert _results() == before, "a smoke run wrote into bench/results/"


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    try:  # a process exiting meanwhile: listing its tasks fails with ESRCH, not ENOENT
        tasks = list(Path(f"/proc/{pid}/task").glob("*"))
    except OSError:
        return out
    for task in tasks:
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out |= {k} | _descendants(k)
    return out


def _cmdline(pid: int, words: int = 4) -> str:
    """The program's name and its first arguments ("" once it is gone)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return " ".join([Path(argv[0]).name, *argv[1:words]])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_bench_leaves_nothing_running(
    k8s_bin_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """``control_plane_bench.py`` at smoke sizes stopped once its operator runs: the bench exits
    with 128 + the signal and its operator, kube-apiserver, etcd and the control plane's
    watchdog are all gone.  (Sizes as flags, not ``--smoke``, so the same test runs against the
    bench as it was: it left its operator running.)"""
    env = {**os.environ, "WARMSERVE_K8S_BIN": str(k8s_bin_dir), "TMPDIR": str(tmp_path)}
    out = tmp_path / "bench.out"
    sizes = ["--models", "6", "--delete", "3", "--nodes", "1", "--gpus", "8", "--poll", "2"]
    with out.open("wb") as f:
        bench = subprocess.Popen(
            [sys.executable, "bench/control_plane_bench.py", *sizes,
             "--json", str(tmp_path / "cp.json")],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not any("--poll-seconds" in _cmdline(p, 40) for p in _descendants(bench.pid)):
            assert bench.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        time.sleep(1)  # the operator is up and talking to the API server
        work = Path(out.read_text().split("control plane in ", 1)[1].split()[0])
        pids = _descendants(bench.pid) | {
            int(p.read_text().split()[0]) for p in work.rglob("*.pid")
        }
        names = {p: _cmdline(p) for p in pids if _alive(p)}
        assert any(n.startswith("kube-apiserver") for n in names.values()), names
        assert any(n.startswith("etcd") for n in names.values()), names
        bench.send_signal(sig)
        rc = bench.wait(timeout=90)
        deadline = time.monotonic() + 15  # the control plane's watchdog polls every 2 s
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p: names.get(p) for p in pids if _alive(p)}
        assert not left, f"still running after the bench exited: {left}"
        assert rc == 128 + sig, out.read_text()[-2000:]
    finally:
        for p in _descendants(bench.pid) if bench.poll() is None else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
