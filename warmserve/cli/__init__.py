"""The ``warmserve`` command line: the registry of its subcommands.

Each subcommand lives in a module of its own that exposes ``register(subparsers)``, which adds
its parser and sets ``func`` to a handler taking the parsed arguments and returning an exit
status.  A component's command lives next to the component (``warmserve_operator.cli``,
``warmserve_agent.cli``, ``warmserve_gateway.cli``); the others (``up``/``down``, ``predict``,
``plan``, ``simulate``, ``status``, ``models``) under ``warmserve.cli``.  :data:`SUBCOMMANDS`
names them by dotted path, as strings: this registry is the only place in ``warmserve/`` that
names a component, and it imports none (an import-linter contract keeps ``warmserve`` free of the
components).  ``register`` must stay cheap (argparse only): handlers import heavy dependencies
(grpc, kopf, statsmodels, matplotlib) themselves, so ``warmserve --help`` is instant.

Errors a person can fix (bad input, missing files) raise :class:`CliError` or the policy's
:class:`~warmserve.policy.cluster.PolicyInputError`; ``main`` prints them as one line on stderr
and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from warmserve.flags import CliError, DefaultsHelpFormatter
from warmserve.policy.cluster import PolicyInputError

__all__ = ["SUBCOMMANDS", "CliError", "DefaultsHelpFormatter", "build_parser", "main"]

EXIT_USAGE = 2

# Subcommand modules by dotted path, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "warmserve.cli.up",
    "warmserve.cli.predict",
    "warmserve.cli.plan",
    "warmserve.cli.simulate",
    "warmserve_operator.cli",
    "warmserve.cli.status",
    "warmserve_agent.cli",
    "warmserve_gateway.cli",
    "warmserve.cli.models",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="warmserve",
        description=(
            "Kubernetes-native serving of many LLMs on a shared GPU cluster with predictive "
            "prewarming (WarmServe)."
        ),
    )
    from warmserve import __version__

    parser.add_argument("--version", action="version", version=f"warmserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to run again (simulate --compiled)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except (CliError, PolicyInputError) as exc:
        print(f"warmserve {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as exc:
        print(f"warmserve {args.command}: error: file not found: {exc.filename}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
