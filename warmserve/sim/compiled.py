"""The compiled simulator: the event loop's modules built with mypyc, opt-in.

``warmserve simulate --compiled`` and ``python bench/sim_speed.py --compiled`` run the same
simulator with its hot modules (:data:`MODULES`: the per-request path and the executor) compiled
to C extensions by mypyc.  Results are identical to pure Python, which stays the default and the
reference (docs/simulator.md, "Compiled simulator").

Never stale, never in the source tree: the extensions are built into a *copy* of the
``warmserve`` package under ``~/.cache/warmserve-mypyc/<key>/`` (``$WARMSERVE_MYPYC_CACHE``
overrides the folder), where ``<key>`` hashes every file of the package (the compiled sources,
the modules their types come from and the data files the copy serves), the module list, the
mypy version and the Python version.  Any edit gives a new key and so a new build; an editable
install never sees a ``.so`` beside its ``.py``.  The command then runs again (``os.execve``)
with that copy first on ``PYTHONPATH`` (``python -P``: the working folder is not put first), and
the new process checks that it really imports the compiled modules from the copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Compiled, in the order the per-request path meets them.  Every module here must type-check
# with mypy (mypyc refuses otherwise); the tests build them (tests/sim/test_compiled.py).
MODULES: tuple[str, ...] = (
    "warmserve/sim/core.py",
    "warmserve/sim/state.py",
    "warmserve/sim/request_queues.py",
    "warmserve/sim/batching.py",
    "warmserve/sim/lifecycle.py",
    "warmserve/sim/cluster.py",
    "warmserve/sim/stats.py",
    "warmserve/sim/sharing.py",
    "warmserve/sim/executor.py",
    # the decisions the loop asks for: the snapshot and Algorithm 1 (Eq. 5-8 placement), the
    # fair-share caps, the autoscaler, the start choice.  Pure: the controller (its mixin parts
    # compiled as traits measured no faster, and mypyc 2.4.1 emits C that gcc rejects for a
    # trait attribute of tuple type) and policy/cluster.py (its frozen dataclasses set
    # attributes mypyc's native classes lack).
    "warmserve/control/snapshot.py",
    "warmserve/policy/evict_aware_placement.py",
    "warmserve/policy/replica_match.py",
    "warmserve/policy/gpu_groups.py",
    "warmserve/control/decisions.py",
    "warmserve/control/demand.py",
    "warmserve/control/observation.py",
    "warmserve/control/free_growth.py",
    "warmserve/control/config.py",
    "warmserve/control/history.py",
    "warmserve/policy/fairness.py",
    "warmserve/policy/autoscaler.py",
    "warmserve/policy/overshoot.py",
    "warmserve/policy/scoring.py",
    "warmserve/policy/start_choice.py",
    "warmserve/policy/reclaim.py",
    "warmserve/policy/proactive.py",
    "warmserve/policy/load.py",
)
# mypy's options for the build: imported modules that are not compiled are read for their types
# only (their own type errors do not stop the build); a name may be bound again with another
# type (mypy renames it: loop variables reused in snapshot.py and evict_aware_placement.py).
MYPY_FLAGS: tuple[str, ...] = ("--follow-imports=silent", "--ignore-missing-imports",
                               "--allow-redefinition")
MYPY_PIN = "2.4.1"  # pyproject.toml's dev extra pins the same
ENV_DIR = "WARMSERVE_COMPILED"  # set in the re-executed process: the copy it runs from
FORMAT = "1"  # bump when the layout of a cache entry changes
KEEP = 4  # cache entries kept (the newest); older ones are removed after a build

_SKIP = (".pyc", ".so", ".pyd", ".c", ".o")


class CompiledError(RuntimeError):
    """The compiled simulator cannot be built or loaded; the message says why, in one line."""


def package_dir() -> Path:
    """The ``warmserve`` package this module belongs to (the source tree, or the copy)."""
    return Path(__file__).resolve().parent.parent


def cache_root() -> Path:
    env = os.environ.get("WARMSERVE_MYPYC_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmserve-mypyc"


def _package_files(pkg: Path) -> list[Path]:
    out = []
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(_SKIP):
            out.append(p)
    return out


def mypy_version() -> str | None:
    """The installed mypy's version, or None without mypyc (read without importing mypy)."""
    if importlib.util.find_spec("mypyc") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mypy")
    except PackageNotFoundError:  # pragma: no cover - mypyc without its distribution
        return None


def cache_key(pkg: Path, mypy: str, modules: Sequence[str] = MODULES) -> str:
    """Hash of what a build depends on: every package file, the modules, mypy and Python."""
    h = hashlib.sha256()
    for part in (FORMAT, mypy, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "",
                 *modules, *MYPY_FLAGS):
        h.update(part.encode() + b"\0")
    for p in _package_files(pkg):
        h.update(p.relative_to(pkg).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:24]


def check_toolchain() -> str:
    """mypyc, a C compiler and Python's headers: the mypy version, or :class:`CompiledError`."""
    mypy = mypy_version()
    if mypy is None:
        raise CompiledError(
            f"--compiled needs mypyc: pip install 'mypy=={MYPY_PIN}' (part of the dev extra: "
            "pip install -e '.[dev]'), or run without --compiled"
        )
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        raise CompiledError(
            f"--compiled needs a C compiler: {cc!r} not found (install gcc, or set CC), or run "
            "without --compiled"
        )
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        raise CompiledError(
            f"--compiled needs Python's C headers: no Python.h in {include} (install "
            "python3-dev), or run without --compiled"
        )
    return mypy


def _log(msg: str) -> None:
    print(f"compiled simulator: {msg}", file=sys.stderr, flush=True)


def build(log: Callable[[str], None] = _log, root: Path | None = None) -> Path:
    """The folder holding the compiled copy of the package, built first if not cached."""
    mypy = check_toolchain()
    pkg = package_dir()
    root = root or cache_root()
    key = cache_key(pkg, mypy)
    dest = root / key
    if (dest / "BUILT").exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".build-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(pkg, tmp / "warmserve",
                    ignore=shutil.ignore_patterns("__pycache__", *(f"*{s}" for s in _SKIP)))
    log(f"building {len(MODULES)} modules with mypyc {mypy} into {dest} (once per source "
        "change; a few minutes on 2 cores)")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "mypyc", *MYPY_FLAGS, *MODULES]
    logfile = tmp / "build.log"
    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, "PYTHONPATH": ""})
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("building '") or "error:" in line:
                log(f"[{time.perf_counter() - t0:5.0f} s] {line.strip()[:160]}")
        rc = proc.wait()
    if rc != 0:
        tail = logfile.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise CompiledError(f"mypyc failed (exit {rc}; log {logfile}): {tail[0][:300]}")
    shutil.rmtree(tmp / "build", ignore_errors=True)  # C sources and objects
    (tmp / "BUILT").write_text(f"mypy {mypy}\npython {sys.version}\n" + "\n".join(MODULES) + "\n")
    try:
        tmp.rename(dest)
    except OSError:  # built meanwhile by another process: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    _prune(root, keep=dest)
    return dest


def _prune(root: Path, keep: Path) -> None:
    entries = sorted((p for p in root.iterdir() if (p / "BUILT").exists()),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def verify_loaded(dest: str) -> None:
    """In the re-executed process: every compiled module is imported from the copy, compiled."""
    import importlib

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for rel in MODULES:
        name = rel.removesuffix(".py").replace("/", ".")
        mod = importlib.import_module(name)
        f = str(getattr(mod, "__file__", ""))
        if not (f.startswith(dest) and f.endswith(suffix)):
            raise CompiledError(f"{name} was imported from {f}, not compiled from {dest}")


def run_compiled(argv: Sequence[str]) -> None:
    """Run ``python -P <argv>`` again from the compiled copy (building it first); in that
    process (``$WARMSERVE_COMPILED`` set) check the copy is what runs and return None."""
    here = os.environ.get(ENV_DIR)
    if here:
        verify_loaded(here)
        return None
    dest = str(build())
    env = dict(os.environ)
    env[ENV_DIR] = dest
    env["PYTHONPATH"] = os.pathsep.join(p for p in (dest, env.get("PYTHONPATH", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-P", *argv], env)


# Facts of a run that measure the machine, not the simulation: never compared.
TIMING_KEYS = frozenset({"prep_s", "wall_s", "cpu_s", "setup_cpu_s", "layout_cpu_s",
                         "sim_requests_per_wall_s", "sim_requests_per_cpu_s"})


def compare(a: object, b: object, path: str = "") -> tuple[int, list[str]]:
    """Compare two results (``warmserve simulate --json``) value by value, type and ``repr``
    included (1 and 1.0 differ; NaN equals NaN), timing keys left out: (values compared,
    differences as ``path: a != b``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        n, diffs = 0, []
        for k in sorted(set(a) | set(b), key=str):
            if k in TIMING_KEYS:
                continue
            if k not in a or k not in b:
                diffs.append(f"{path}/{k}: only in {'second' if k in b else 'first'}")
                continue
            dn, dd = compare(a[k], b[k], f"{path}/{k}")
            n += dn
            diffs += dd
        return n, diffs
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return 1, [f"{path}: length {len(a)} != {len(b)}"]
        n, diffs = 0, []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            dn, dd = compare(x, y, f"{path}[{i}]")
            n += dn
            diffs += dd
        return n, diffs
    same = type(a) is type(b) and repr(a) == repr(b)
    return 1, [] if same else [f"{path}: {a!r} != {b!r}"]
