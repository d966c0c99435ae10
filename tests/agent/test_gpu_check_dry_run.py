"""``hack/gpu-check.sh --dry-run`` in CI: the wheel list, the GPU tests' collection, the
fake-driver contracts and the GPU bench's code paths, on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_passes() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(
        [str(ROOT / "hack" / "gpu-check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "verified size and sha256 of" in out
    assert "dry run OK" in out
    assert "DRY RUN: fake driver, no GPU" in out  # the bench says no figure is a GPU figure
    declared = sum(
        1
        for f in (ROOT / "tests" / "gpu").glob("test_*.py")
        for line in f.read_text().splitlines()
        if line.startswith("def test_")
    )
    assert f"declared {declared}, collected {declared}" in out


def test_gpu_check_refuses_to_run_without_a_gpu(tmp_path: Path) -> None:
    if Path("/dev/nvidiactl").exists():
        return  # a GPU machine: the real run is hack/gpu-check.sh itself
    env = {**os.environ, "PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [str(ROOT / "hack" / "gpu-check.sh"), "--results-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "no NVIDIA GPU here" in res.stderr
