"""``warmserve operator`` with in-process agents: the real operator process (kopf, the
reconciler, the Kubernetes API under its kubeconfig) whose agent pool reaches
:class:`~warmserve_operator.testing.FakeAgents` instead of gRPC clients.  It measures the
control plane (API, statuses, Events, the loop) without agents, gRPC or weight loading.

    python -m warmserve.testing.fake_operator --agents AGENTS.json -- [warmserve operator flags]

``AGENTS.json`` is :meth:`FakeAgents.to_json`'s document (nodes, each agent's GPUs and model
store).  Exit status as ``warmserve operator``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warmserve.testing.fake_operator")
    ap.add_argument("--agents", required=True, type=Path, help="FakeAgents JSON document")
    ap.add_argument("operator_args", nargs=argparse.REMAINDER, help="-- warmserve operator flags")
    ns = ap.parse_args(argv)
    rest = ns.operator_args[1:] if ns.operator_args[:1] == ["--"] else ns.operator_args

    from warmserve_operator.testing import FakeAgents

    from warmserve.cli import EXIT_USAGE, CliError, build_parser, operator_cmd

    try:
        agents = FakeAgents.from_json(ns.agents.read_text())
    except (OSError, ValueError) as exc:
        print(f"fake_operator: --agents {ns.agents}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = build_parser().parse_args(["operator", *rest])
    try:
        return operator_cmd.run(args, connect_agent=agents.connect)
    except CliError as exc:
        print(f"warmserve operator: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
