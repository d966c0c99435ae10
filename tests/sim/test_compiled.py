"""The compiled simulator (warmserve.sim.compiled): its cache key, its errors, and
a real mypyc build whose results equal pure Python's, value by value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmserve.cli import main
from warmserve.sim import compiled

ROOT = Path(__file__).resolve().parents[2]
TESTBED = ROOT / "bench/scenarios/paper-testbed.yaml"


def _pkg(tmp_path: Path) -> Path:
    pkg = tmp_path / "warmserve"
    (pkg / "sim").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sim" / "core.py").write_text("X = 1\n")
    (pkg / "sim" / "profile.yaml").write_text("a: 1\n")
    return pkg


def test_cache_key_follows_every_source_and_data_file_and_mypy(tmp_path):
    pkg = _pkg(tmp_path)
    key = compiled.cache_key(pkg, "2.4.1")
    assert key == compiled.cache_key(pkg, "2.4.1")  # deterministic
    # what the build leaves or Python writes does not count
    (pkg / "sim" / "__pycache__").mkdir()
    (pkg / "sim" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"x")
    (pkg / "sim" / "core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"x")
    assert compiled.cache_key(pkg, "2.4.1") == key
    assert compiled.cache_key(pkg, "2.4.2") != key  # another mypy(c)
    assert compiled.cache_key(pkg, "2.4.1", modules=("warmserve/sim/core.py",)) != key
    (pkg / "sim" / "core.py").write_text("X = 2\n")  # a compiled source changed
    key2 = compiled.cache_key(pkg, "2.4.1")
    assert key2 != key
    (pkg / "sim" / "profile.yaml").write_text("a: 2\n")  # a data file the copy serves
    assert compiled.cache_key(pkg, "2.4.1") != key2
    (pkg / "sim" / "new.py").write_text("")  # a new module
    assert compiled.cache_key(pkg, "2.4.1") not in (key, key2)


def test_the_real_package_key_changes_with_a_compiled_source(tmp_path):
    import shutil

    pkg = tmp_path / "warmserve"
    shutil.copytree(compiled.package_dir(), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    key = compiled.cache_key(pkg, "2.4.1")
    core = pkg / "sim" / "core.py"
    core.write_text(core.read_text() + "\n# edited\n")
    assert compiled.cache_key(pkg, "2.4.1") != key


def test_every_compiled_module_exists():
    for rel in compiled.MODULES:
        assert (compiled.package_dir().parent / rel).is_file(), rel


def test_without_mypyc_a_clear_error(monkeypatch):
    monkeypatch.setattr(compiled, "mypy_version", lambda: None)
    with pytest.raises(compiled.CompiledError, match=r"needs mypyc: pip install 'mypy==2\.4\.1'"):
        compiled.check_toolchain()


def test_without_a_c_compiler_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(compiled.CompiledError, match="needs a C compiler: 'no-such-compiler-xyz'"):
        compiled.check_toolchain()


def test_without_python_headers_a_clear_error(monkeypatch, tmp_path):
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    with pytest.raises(compiled.CompiledError, match="needs Python's C headers"):
        compiled.check_toolchain()


def test_cli_compiled_without_compiler_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    monkeypatch.delenv(compiled.ENV_DIR, raising=False)
    rc = main(["simulate", str(TESTBED), "--duration", "60", "--compiled"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "needs a C compiler" in err


def test_sim_speed_compiled_without_compiler_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "CC": "no-such-compiler-xyz"}
    env.pop(compiled.ENV_DIR, None)
    p = subprocess.run([sys.executable, str(ROOT / "bench/sim_speed.py"), "--compiled",
                        "--parts", "unsat", "--json", str(tmp_path / "x.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        p.stderr.strip().splitlines()[-1]] and "needs a C compiler" in p.stderr


def test_compare_counts_values_and_finds_every_difference():
    a = {"facts": {"requests": 3, "prep_s": 1.0}, "rows": [{"x": 1, "y": [1.5, float("nan")],
                                                            "wall_s": 2.0}]}
    b = json.loads(json.dumps(a))
    b["facts"]["prep_s"] = 9.0  # timing: not compared
    b["rows"][0]["wall_s"] = 7.0
    assert compiled.compare(a, b) == (4, [])
    b["rows"][0]["x"] = 1.0  # same number, another type: JSON prints it differently
    b["rows"][0]["y"][0] = 1.25
    n, diffs = compiled.compare(a, b)
    assert n == 4 and diffs == ["/rows[0]/x: 1 != 1.0", "/rows[0]/y[0]: 1.5 != 1.25"]


@pytest.mark.slow
def test_compiled_run_equals_pure_python(tmp_path):
    """Builds the compiled copy (cached by its key: ~1 min cold on 2 cores, instant after) and
    runs every system of the testbed for 5 simulated minutes, pure and compiled; then the CLI."""
    if compiled.mypy_version() is None:  # the dev extra pins mypy: CI always has it
        pytest.fail("mypyc is not installed (pip install -e '.[dev]')")
    env = {k: v for k, v in os.environ.items() if k != compiled.ENV_DIR}
    outs = {}
    for mode in ("pure", "compiled"):
        out = tmp_path / f"{mode}.json"
        # every result: rows, starts, timelines, counters, each model's histograms
        cmd = [sys.executable, str(ROOT / "bench/sim_identity.py"), "run", str(TESTBED),
               "--duration", "300", "--out", str(out)]
        if mode == "compiled":
            cmd.append("--compiled")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[mode] = json.loads(out.read_text())
    n, diffs = compiled.compare(outs["pure"], outs["compiled"])
    assert n > 10_000 and len(outs["pure"]["systems"]) >= 10
    assert diffs == []
    # the CLI's --compiled runs too, and prints what the pure run prints
    cli = [sys.executable, "-P", "-m", "warmserve", "simulate", str(TESTBED), "--duration", "60",
           "--systems", "warmserve"]
    pure = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    comp = subprocess.run([*cli, "--compiled"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=900)
    assert pure.returncode == 0 and comp.returncode == 0, comp.stderr[-3000:]
    table = [ln for ln in pure.stdout.splitlines() if "per wall second" not in ln]
    assert [ln for ln in comp.stdout.splitlines() if "per wall second" not in ln] == table
    # and it really ran compiled: the extensions exist in the cache entry of today's sources
    dest = compiled.cache_root() / compiled.cache_key(compiled.package_dir(),
                                                      compiled.mypy_version() or "")
    assert (dest / "BUILT").exists()
    assert list((dest / "warmserve" / "sim").glob("core.*.so"))


def test_cli_runs_again_with_the_arguments_it_parsed(monkeypatch):
    """``main(argv)`` called by a program (not from sys.argv) runs that argv again."""
    seen = []

    def fake_run_compiled(argv):
        seen.append(list(argv))
        raise compiled.CompiledError("stop here")

    monkeypatch.setattr(compiled, "run_compiled", fake_run_compiled)
    monkeypatch.setattr(sys, "argv", ["pytest", "-q"])
    rc = main(["simulate", str(TESTBED), "--duration", "60", "--compiled"])
    assert rc == 2
    assert seen == [["-m", "warmserve", "simulate", str(TESTBED), "--duration", "60",
                     "--compiled"]]
