"""Rough edges a first user hit, each pinned by a test: clear errors instead of
tracebacks, --help that states each default once, one size parser for every caller."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from warmserve.cli import SUBCOMMANDS, build_parser
from warmserve.units import SizeError, format_size, parse_size

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("gpus", "says"),
    [
        ("8x80", "'80' has no unit; write e.g. 80GiB"),
        ("8x80B", "each GPU needs at least one page"),
        ("8x80XB", "unknown unit 'XB'"),
        ("0x80GiB", "1-64 GPUs per part"),
        ("eight", "use COUNTxSIZE"),
    ],
)
def test_simulate_gpus_mistakes_are_one_line_errors(tmp_path: Path, gpus: str, says: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "warmserve", "agent", "--simulate-gpus", gpus,
         "--model-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", ["predict", "plan", "simulate", "operator", "status", "agent"])
def test_help_states_each_default_at_most_once(name: str) -> None:
    parser = _subparsers(build_parser())[name]
    text = parser.format_help()
    # One block of help per option: from a line starting with "  -" to the next.
    blocks = re.split(r"\n(?=  -)", text)
    for block in blocks:
        flat = " ".join(block.split())
        assert flat.lower().count("(default") <= 1, flat
        for meaningless in ("(default: None)", "(default: False)", "(default: [])"):
            assert meaningless not in flat, flat
    assert len(SUBCOMMANDS) >= 6


def test_operator_help_still_shows_real_defaults() -> None:
    text = " ".join(_subparsers(build_parser())["operator"].format_help().split())
    assert "(default: 300.0)" in text  # window
    assert "(default: 9090)" in text  # metrics port
    assert text.count("(default: the policy core's default)") == 1


# ---- one size parser ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "n"),
    [
        (1234, 1234),
        ("1234", 1234),
        ("80GiB", 80 * 1024**3),
        ("80 gib", 80 * 1024**3),
        ("12.55GB", 12_550_000_000),
        ("2MiB", 2 * 1024**2),
        ("1.5KiB", 1536),
        ("0", 0),
    ],
)
def test_the_size_rules(text: object, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["-1", -1, "1e3", "GiB", "1.2.3GB", "12 parsecs", True, 1.5, None])
def test_bad_sizes_name_the_value(bad: object) -> None:
    with pytest.raises(SizeError, match=r"^where: "):
        parse_size(bad, "where")


def test_every_caller_uses_the_one_parser() -> None:
    """No module but warmserve/units.py defines its own size units (a dict with two or more of
    KB/MB/GB/KiB/MiB/GiB-style keys): scenario files, agent flags and every other caller read
    sizes through warmserve.units.parse_size, so "80GiB" means the same everywhere."""
    unitish = re.compile(r"^(k|m|g|t)(i)?(b)?$", re.IGNORECASE)
    offenders = []
    for folder in ("warmserve", "operator", "agent", "gateway"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "warmserve" / "units.py" or "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Dict):
                    keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                    if sum(1 for k in keys if isinstance(k, str) and unitish.match(k)) >= 2:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"size units defined outside warmserve/units.py: {offenders}"


def test_scenario_and_agent_flags_agree() -> None:
    from warmserve_agent.config import parse_simulated_gpus

    from warmserve.cluster_snapshot import parse_size as scenario_size

    for text in ("80GiB", "12.55GB", "512MiB", "1.5TiB"):
        assert (
            parse_simulated_gpus(f"2x{text}") == [scenario_size(text)] * 2 == [parse_size(text)] * 2
        )
    assert format_size(80 * 1024**3) == "80.0GiB" and format_size(512) == "512B"
