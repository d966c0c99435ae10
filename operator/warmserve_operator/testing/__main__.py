"""``warmserve operator`` with in-process agents: the real operator process (kopf, the
reconciler, the Kubernetes API under its kubeconfig) whose agent pool reaches
:class:`~warmserve_operator.testing.FakeAgents` instead of gRPC clients.  It measures the
control plane (API, statuses, Events, the loop) without agents, gRPC or weight loading.

    python -m warmserve_operator.testing --agents AGENTS.json -- [warmserve operator flags]

``AGENTS.json`` is :meth:`FakeAgents.to_json`'s document (nodes, each agent's GPUs and model
store).  Exit status as ``warmserve operator``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE = 2  # as `warmserve`'s


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m warmserve_operator.testing")
    ap.add_argument("--agents", required=True, type=Path, help="FakeAgents JSON document")
    ap.add_argument("operator_args", nargs=argparse.REMAINDER, help="-- warmserve operator flags")
    ns = ap.parse_args(argv)
    rest = ns.operator_args[1:] if ns.operator_args[:1] == ["--"] else ns.operator_args

    from warmserve.flags import CliError

    from ..cli import register
    from ..cli.run import run as run_operator
    from . import FakeAgents

    try:
        agents = FakeAgents.from_json(ns.agents.read_text())
    except (OSError, ValueError) as exc:
        print(f"warmserve_operator.testing: --agents {ns.agents}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser = argparse.ArgumentParser(prog="warmserve")
    register(parser.add_subparsers())
    args = parser.parse_args(["operator", *rest])
    try:
        return run_operator(args, connect_agent=agents.connect)
    except CliError as exc:
        print(f"warmserve operator: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
