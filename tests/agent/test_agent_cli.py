"""`warmserve agent` runs the agent; `warmserve agent inspect` shows it to a person."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from warmserve_agent.testing import write_model

from warmserve.cli import main


def test_agent_cli_runs_and_inspects(model_root: Path, tmp_path: Path, capsys) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "warmserve",
            "agent",
            "--simulate-gpus",
            "2x4MiB",
            "--page-size",
            "64KiB",
            "--model-dir",
            str(model_root),
            "--listen",
            "127.0.0.1:0",
            "--memory-dir",
            str(tmp_path / "mem"),
            "--node-name",
            "cli-node",
            "--spare-workers",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving on (\S+) \(2 GPUs\)", line)
        assert m, f"unexpected first line {line!r}; stderr: {proc.stderr.read()}"
        addr = m.group(1)
        from warmserve.api.agent.client import SyncAgentClient

        with SyncAgentClient(addr) as c:
            c.prewarm_wait("alpha", [0, 1], layers=2)
        assert main(["agent", "inspect", addr]) == 0
        out = capsys.readouterr().out
        assert "node cli-node" in out and "universal" in out
        assert re.search(r"slot-[0-9a-f]{12}\s+alpha\s+0,1\s+2/4", out), out
        assert main(["agent", "inspect", addr, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["slots"][0]["layers_resident"] == 2 and d["slots"][0]["layers_total"] == 4
        assert [g["state"] for g in d["gpus"]] == ["WORKER_STATE_UNIVERSAL"] * 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not list((tmp_path / "mem").glob("*.mem"))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["agent", "--model-dir", "."], "choose --gpus auto"),
        (["agent", "--simulate-gpus", "8xlots", "--model-dir", "."], "bad size"),
        (["agent", "--simulate-gpus", "eight", "--model-dir", "."], "COUNTxSIZE"),
        (["agent", "--simulate-gpus", "1x1GiB", "--model-dir", "/nonexistent"], "not a directory"),
        (
            ["agent", "--simulate-gpus", "1x1GiB", "--model-dir", ".", "--page-size", "3MiB"],
            "power of two",
        ),
        (
            ["agent", "--simulate-gpus", "1x1GiB", "--model-dir", ".", "--tls-cert", "/no/such"],
            "no such file",
        ),
        (
            ["agent", "--simulate-gpus", "1x1GiB", "--model-dir", ".", "--sim-copy-gbps", "-1"],
            ">= 0",
        ),
        (["agent", "inspect", "127.0.0.1:9", "--timeout", "5"], "agent at 127.0.0.1:9: "),
        (["agent", "--gpus", "auto", "--model-dir", ".", "--gpu-reserve", "lots"], "bad size"),
        (
            ["agent", "--gpus", "auto", "--model-dir", ".", "--store-reserve", "most"],
            "or a share such as 15%",
        ),
        (["agent", "--gpus", "auto", "--model-dir", ".", "--store-reserve", "120%"], "0-99%"),
    ],
)
def test_agent_cli_errors(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_agent_cli_without_cuda_python(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from warmserve_agent.backends import cuda_driver

    def missing() -> None:
        raise cuda_driver.CudaError(
            "the cuda backend needs cuda-python: pip install 'warmserve[cuda]'"
        )

    monkeypatch.setattr(cuda_driver, "import_driver", missing)
    assert main(["agent", "--gpus", "auto", "--model-dir", "."]) == 2
    err = capsys.readouterr().err
    assert "pip install 'warmserve[cuda]'" in err and "Traceback" not in err


def test_agent_cli_without_an_nvidia_driver(capsys) -> None:
    """cuda-python installed (a dev dependency) but no driver: one clear line, no traceback."""
    if Path("/dev/nvidiactl").exists():
        return  # a GPU machine: covered by hack/gpu-check.sh
    assert main(["agent", "--gpus", "auto", "--model-dir", "."]) == 2
    err = capsys.readouterr().err
    assert "no usable NVIDIA driver" in err and "--simulate-gpus" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_gpu_reserve_reaches_the_config() -> None:
    import argparse

    from warmserve_agent.cli import register
    from warmserve_agent.cli.run import _config

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    args = ap.parse_args(["agent", "--gpus", "auto", "--model-dir", ".", "--gpu-reserve", "6GiB"])
    assert _config(args).gpu_reserve_bytes == 6 * 1024**3


def test_store_reserve_reaches_the_config() -> None:
    import argparse

    from warmserve_agent.cli import register
    from warmserve_agent.cli.run import _config
    from warmserve_agent.sources.disk_reserve import DEFAULT_RESERVE, DiskReserve

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    base = ["agent", "--gpus", "auto", "--model-dir", "."]
    assert _config(ap.parse_args(base)).store_reserve == DEFAULT_RESERVE
    got = _config(ap.parse_args([*base, "--store-reserve", "20%"])).store_reserve
    assert got == DiskReserve(0.2, 0)
    got = _config(ap.parse_args([*base, "--store-reserve", "50GiB"])).store_reserve
    assert got == DiskReserve(0.0, 50 * 1024**3)


def test_the_agent_refuses_to_start_on_a_store_it_cannot_move(tmp_path: Path) -> None:
    """A store of the earlier ``<store>/ORG/NAME`` layout is moved to ``<store>/ORG~NAME`` when
    the agent starts (test_model_store_security.py); one it cannot move stops the start with one
    line saying how to move it, and nothing is lost."""

    store = tmp_path / "store"
    write_model(store / "acme", "chat", layers=2, hidden=16)
    write_model(store, "acme~chat", layers=2, hidden=16, seed=2)  # the same name, both layouts
    argv = [sys.executable, "-m", "warmserve", "agent", "--simulate-gpus", "1x4MiB"]
    argv += ["--page-size", "64KiB", "--model-dir", str(store), "--listen", "127.0.0.1:0"]
    argv += ["--memory-dir", str(tmp_path / "mem"), "--spare-workers", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "old ORG/NAME layout" in err and "mv ORG/NAME ORG~NAME" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (store / "acme" / "chat" / "config.json").is_file()
