"""Build a real model once and keep it: ``${WARMSERVE_MODEL_CACHE:-~/.cache/warmserve-models}/
<name>-<key>/``, keyed by the pins (warmserve.realmodel.pins).

Like the control-plane cache (hack/k8s/build.sh): a lock file serialises builders (concurrent
callers wait, then find the result), a build happens in a staging directory renamed into place
only when whole, and a ``.complete`` marker plus a manifest with every file's sha256 say that it
is.  Every call re-checks the manifest; a directory that fails it (a changed, missing or extra
file, an interrupted build) is rebuilt from the verified sources, never served.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import warmserve
from warmserve.realmodel import manifest
from warmserve.realmodel.convert import EXIT_MISSING, NEEDS, RESULT_PREFIX
from warmserve.realmodel.fetch import RealModelError, fetch_source
from warmserve.realmodel.pins import MODELS, RECIPE_REV, RealModel

CONVERT_TIMEOUT_S = 1800
# The directory that holds the warmserve package: put on the converter's PYTHONPATH (the vLLM
# venv does not install warmserve).
PACKAGE_ROOT = Path(warmserve.__file__).resolve().parents[1]


def cache_root() -> Path:
    env = os.environ.get("WARMSERVE_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "warmserve-models"


def lookup(name: str) -> RealModel:
    try:
        return MODELS[name]
    except KeyError:
        raise RealModelError(
            f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}"
        ) from None


def model_dir(model: RealModel, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{model.name}-{model.key}"


class _Line:
    """One line of progress on stderr: on a terminal its tail is rewritten with each phase; in
    a log the line is opened when a build starts and closed with its outcome."""

    def __init__(self, stream: TextIO | None, label: str) -> None:
        self.stream = stream
        self.tty = bool(stream and stream.isatty())
        self.label = label
        self.t0 = time.monotonic()
        self.opened = False

    def _write(self, text: str) -> None:
        if self.stream:
            self.stream.write(text)
            self.stream.flush()

    def phase(self, text: str) -> None:
        if self.tty:
            self._write(f"\r\x1b[K{self.label}{text} ({time.monotonic() - self.t0:.0f} s)")
            self.opened = True
        elif not self.opened:
            self._write(f"{self.label}{text} ...")
            self.opened = True

    def close(self, text: str) -> None:
        if self.tty:
            self._write(f"\r\x1b[K{self.label}{text}\n")
        elif self.opened:
            self._write(f" {text}\n")
        else:
            self._write(f"{self.label}{text}\n")
        self.opened = False


@contextmanager
def _locked(path: Path, line: _Line) -> Iterator[None]:
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            line.phase(f"waiting for another build (lock {path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _has_converter_modules() -> bool:
    return all(importlib.util.find_spec(n) is not None for n in NEEDS)


def converter_python(explicit: str | None = None) -> str:
    """The interpreter that converts: ``explicit``, else $WARMSERVE_MODEL_PYTHON, else this
    one when it has the modules, else a checkout's vLLM venv (.vllm-cache/venv, linked by
    hack/vllm/setup.sh)."""
    if explicit or os.environ.get("WARMSERVE_MODEL_PYTHON"):
        return explicit or os.environ["WARMSERVE_MODEL_PYTHON"]
    if _has_converter_modules():
        return sys.executable
    venv = PACKAGE_ROOT / ".vllm-cache" / "venv" / "bin" / "python"
    if venv.exists():
        return str(venv)
    raise RealModelError(
        f"converting needs {', '.join(NEEDS)}, which {sys.executable} lacks: run "
        "hack/vllm/real-model.sh (it installs them beside vLLM and builds), or pass the python "
        "hack/vllm/setup.sh prints (--python / WARMSERVE_MODEL_PYTHON)"
    )


def _converter_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def _preflight(model: RealModel, python: str) -> None:
    """Fail before downloading when the converter's interpreter is missing or lacks modules."""
    try:
        res = subprocess.run(
            [python, "-m", model.converter, "--check"],
            capture_output=True,
            text=True,
            timeout=120,
            env=_converter_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealModelError(f"cannot run the converter's python {python}: {e}") from e
    if res.returncode != 0:
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        raise RealModelError(err[-1] if err else f"{python} -m {model.converter} --check failed")


def _convert(model: RealModel, python: str, src: Path, out: Path) -> dict[str, str]:
    try:
        res = subprocess.run(
            [python, "-m", model.converter, str(src), str(out)],
            capture_output=True,
            text=True,
            timeout=CONVERT_TIMEOUT_S,
            env=_converter_env(),
            cwd=out.parent,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise RealModelError(f"converting {model.name} took over {CONVERT_TIMEOUT_S} s") from e
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    if res.returncode == EXIT_MISSING:
        raise RealModelError(err[-1] if err else f"{python} lacks a module the conversion needs")
    if res.returncode != 0:
        raise RealModelError(
            f"converting {model.name} with {python} failed (exit {res.returncode}): "
            f"{err[-1][:300] if err else 'no output'}"
        )
    found = [ln for ln in res.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not found:
        raise RealModelError(f"the converter {model.converter} printed no result line")
    return json.loads(found[-1][len(RESULT_PREFIX) :])


def _check_output(model: RealModel, out: Path) -> None:
    missing = [f for f in model.expect_files if not (out / f).is_file()]
    if missing:
        raise RealModelError(f"the conversion of {model.name} wrote no {', '.join(missing)}")
    config = json.loads((out / "config.json").read_text())
    for k, want in model.expect_config.items():
        if config.get(k) != want:
            raise RealModelError(
                f"the converted {model.name} has config {k}={config.get(k)!r}, expected {want!r}"
            )


def _provenance(model: RealModel, converted_with: dict[str, str], index_url: str | None) -> dict:
    return {
        "model": model.name,
        "description": model.description,
        "upstream": model.upstream,
        "license": model.license,
        "source": {
            "package": model.package,
            "version": model.version,
            "wheel": model.wheel,
            "wheel_url": model.wheel_url,
            "wheel_sha256": model.wheel_sha256,
            "index": index_url or "pip's configured index (PyPI)",
            "file": model.member,
            "file_sha256": model.member_sha256,
        },
        "conversion": {
            "recipe": f"{model.converter} rev {RECIPE_REV}",
            "dtype": "bfloat16",
            "versions": converted_with,
        },
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "warmserve": warmserve.__version__,
    }


def _build(model: RealModel, stage: Path, python: str, index_url: str | None, line: _Line) -> None:
    work = stage.parent / f"{stage.name}.src"
    try:
        line.phase(f"downloading {model.requirement} with pip")
        src = fetch_source(model, work, index_url=index_url)
        line.phase("converting (about a minute)")
        stage.mkdir()
        versions = _convert(model, python, src, stage)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _check_output(model, stage)
    doc = _provenance(model, versions, index_url)
    (stage / manifest.PROVENANCE).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    line.phase("writing the manifest")
    manifest.write(stage, model.name, model.key)


def _remove_leftovers(root: Path, final: Path) -> None:
    """Staging directories of builds that died (we hold the lock: nobody else builds)."""
    for p in root.glob(f".{final.name}.*"):
        shutil.rmtree(p, ignore_errors=True)


def ensure_model(
    name: str | RealModel,
    *,
    cache: Path | None = None,
    python: str | None = None,
    index_url: str | None = None,
    rebuild: bool = False,
    progress: TextIO | None = sys.stderr,
) -> Path:
    """The verified model directory, built first when missing or failing its manifest."""
    model = lookup(name) if isinstance(name, str) else name
    root = cache or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{model.name}-{model.key}.lock").touch()
    except OSError as e:
        raise RealModelError(f"cannot use the model cache {root}: {e.strerror or e}") from e
    final = model_dir(model, root)
    line = _Line(progress, f"[warmserve-models] {model.name}: ")
    with _locked(root / f"{final.name}.lock", line):
        why = "rebuild asked for" if rebuild else manifest.problem(final)
        if why is None:
            line.close(f"cached, verified in {time.monotonic() - line.t0:.1f} s: {final}")
            return final
        line.phase(f"building {final} ({why})")
        _remove_leftovers(root, final)
        try:
            py = converter_python(python)
            _preflight(model, py)
            stage = root / f".{final.name}.build-{os.getpid()}"
            _build(model, stage, py, index_url, line)
            if final.exists():
                final.rename(root / f".{final.name}.old-{os.getpid()}")
            stage.rename(final)
        except BaseException:
            line.close("failed")
            raise
        finally:
            _remove_leftovers(root, final)
        line.close(f"built in {time.monotonic() - line.t0:.0f} s: {final}")
    return final
