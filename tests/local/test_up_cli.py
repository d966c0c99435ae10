"""Bad input to ``warmserve up`` / ``down``: each is one line on stderr and exit status 2,
before anything is started."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local.up_support import REPO, warmserve
from warmserve.local.procs import free_port


def one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("warmserve up: error: ") or lines[0].startswith("warmserve down")
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_unknown_trace(tmp_path: Path) -> None:
    p = warmserve("up", "--trace", "no-such-trace", "--state-dir", str(tmp_path))
    one_line_error(p, "trace not found: no-such-trace", "azure_lmm_2025")
    assert not (tmp_path / "stack.json").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speed", "7"], "does not divide"),
        (["--gpus", "2x2x80GiB"], "need 4 GPUs on one node"),
        (["--gpus", "lots"], "--gpus must look like 2x8x80GiB"),
        (["--minutes", "0"], "--minutes must be > 0"),
        (["--trace", "azure_code_2023_1h", "--minutes", "90"], "spans 57 trace minutes"),
        (["--trace", "servegen_language_14d_10min_per_model"], "600 s steps"),
    ],
)
def test_other_bad_arguments(tmp_path: Path, args: list[str], needle: str) -> None:
    one_line_error(warmserve("up", *args, "--state-dir", str(tmp_path)), needle)


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = warmserve("up", "--port", str(port), "--state-dir", str(tmp_path))
    one_line_error(p, f"port {port} is in use", "--port")
    assert not (tmp_path / "stack.json").exists()


def test_stale_previous_run_then_down_cleans_it(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from warmserve.local.procs import ProcRecord

    record = {
        "format": "warmserve.io/up-stack/v1",
        "id": "deadbeef0000",
        "state": "replaying",
        "startedUnix": 1.0,
        "upPid": dead.pid,
        "processes": [ProcRecord("kube-apiserver", dead.pid, 12345).to_json()],
        "info": {},
    }
    (tmp_path / "stack.json").write_text(json.dumps(record))
    one_line_error(warmserve("up", "--state-dir", str(tmp_path)), "stale stack", "`warmserve down`")
    d = warmserve("down", "--state-dir", str(tmp_path))
    assert d.returncode == 0, d.stderr
    assert "stopped 0 processes" in d.stdout
    assert not (tmp_path / "stack.json").exists()
    # nothing to stop is not an error either
    assert warmserve("down", "--state-dir", str(tmp_path)).returncode == 0


def test_missing_go_toolchain(tmp_path: Path) -> None:
    """No cached control plane and no Go: the build cannot start; one line, nothing left."""
    go = shutil.which("go")
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not go or Path(d) != Path(go).parent]
    env = {k: v for k, v in os.environ.items() if k != "WARMSERVE_K8S_BIN"}
    env.update({"PATH": os.pathsep.join(path), "WARMSERVE_K8S_CACHE": str(tmp_path / "cache")})
    assert shutil.which("go", path=env["PATH"]) is None
    port = str(free_port())
    p = warmserve("up", "--port", port, "--state-dir", str(tmp_path / "state"), env=env)
    one_line_error(p, "cannot build the control plane", "go is not on PATH")
    assert "[k8s-build" in p.stdout  # the build's own progress was shown
    assert not (tmp_path / "state" / "stack.json").exists()


def test_readme_first_command_runs_up_and_second_runs_the_tests() -> None:
    import re

    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md lost its Quickstart block"
    first, second = [ln.split("#")[0].strip() for ln in block.group(1).strip().splitlines()][:2]
    assert first == "./hack/up.sh" and second == "./hack/test.sh"
    script = (REPO / "hack" / "up.sh").read_text()
    assert os.access(REPO / "hack" / "up.sh", os.X_OK)
    assert "hack/venv.sh" in script and 'exec .venv/bin/warmserve up "$@"' in script


def test_operator_day_seconds_flag() -> None:
    """The flag `up` added to the operator: a compressed seasonal day, checked like the window."""
    from warmserve_operator.config import OperatorConfig

    from warmserve.policy.cluster import PolicyInputError

    assert OperatorConfig(window_s=15, day_s=4320).day_s == 4320
    with pytest.raises(PolicyInputError, match=r"must divide a day \(4320 s\)"):
        OperatorConfig(window_s=7, day_s=4320)
    p = warmserve("operator", "--window-seconds", "7", "--day-seconds", "4320")
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "warmserve operator: error: window_s 7 must divide a day (4320 s) evenly"
    )
