"""``bench/engine_bench.py --smoke`` (real vLLM, so in the vllm group; every other bench's smoke
is ``tests/bench/test_bench_smoke.py``): one prewarm hit of the tiny model with its engine prepared,
its JSON in a temp dir and not in ``bench/results``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_engine_bench_smoke_runs(tmp_path: Path) -> None:
    results = ROOT / "bench" / "results"
    before = {p.name: p.stat().st_mtime for p in results.iterdir()} if results.is_dir() else {}
    proc = subprocess.run(
        [sys.executable, "bench/engine_bench.py", "--smoke"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    saved = list(tmp_path.rglob("engine_bench.json"))
    assert len(saved) == 1, proc.stdout[-2000:]
    doc = json.loads(saved[0].read_text())
    assert doc["smoke"] is True and doc["rounds"] == 1
    assert [m["model"] for m in doc["models"]] == ["tiny"] and "tiny" in doc["summary"]
    after = {p.name: p.stat().st_mtime for p in results.iterdir()} if results.is_dir() else {}
    assert after == before
