"""What the README and the Helm chart's README say about the running system is checked against
the code: bind addresses, CUDA IPC handles, leader election through Leases."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from warmserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for d in ("warmserve", "operator", "agent") for p in (ROOT / d).rglob("*.py")]


def _defaults(command: str) -> dict[str, object]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    return {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}


def _code_mentions(pattern: str) -> bool:
    rx = re.compile(pattern)
    return any(rx.search(p.read_text()) for p in CODE)


def test_helm_readme_states_the_cli_bind_defaults() -> None:
    text = (ROOT / "helm" / "warmserve" / "README.md").read_text()
    agent, op = _defaults("agent"), _defaults("operator")
    rows = {
        "`--listen`": f"`{agent['--listen']}`",
        "`--engine-host`": f"`{agent['--engine-host']}`",
        "`--metrics-host`": f"`{agent['--metrics-host']}`",
        "`--metrics-address`": f"`{op['--metrics-address']}`, `{op['--metrics-port']}`",
    }
    for flag, default in rows.items():
        line = next((ln for ln in text.splitlines() if ln.startswith("|") and flag in ln), None)
        assert line is not None, f"no row for {flag} in the chart README's defaults table"
        assert line.rstrip(" |").endswith(default), (flag, default, line)
    assert "binds everything but" not in text


def test_no_cuda_ipc_claims_without_cuda_ipc_code() -> None:
    uses_ipc = _code_mentions(r"cuIpc|IpcMemHandle|ipc_handle")
    for doc in ("helm/warmserve/README.md", "helm/warmserve/values.yaml", "docs/agent.md"):
        text = (ROOT / doc).read_text()
        if not uses_ipc:
            assert "IPC handle" not in text and "CUDA IPC" not in text, doc


def test_leader_election_is_described_as_it_is_done() -> None:
    uses_leases = _code_mentions(r"coordination\.k8s\.io|V1Lease|CoordinationV1Api")
    uses_peering = _code_mentions(r"ClusterKopfPeering|--peering|peering_name|clusterkopfpeerings")
    assert uses_peering or uses_leases
    readme = (ROOT / "README.md").read_text()
    if not uses_leases:
        assert not re.search(r"\blease", readme, re.IGNORECASE), "README mentions leases"
        assert "kopf peering" in readme
