"""The ``warmserve`` command line.

Each subcommand lives in its own module under ``warmserve.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a handler taking the parsed
arguments and returning an exit status.  ``register`` must stay cheap (argparse only): handlers
import heavy dependencies (grpc, kopf, statsmodels, matplotlib) themselves, so ``warmserve --help``
is instant.

Errors a person can fix (bad input, missing files) raise :class:`CliError` or the policy's
:class:`~warmserve.policy.cluster.PolicyInputError`; ``main`` prints them as one line on stderr
and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from warmserve.policy.cluster import PolicyInputError

EXIT_USAGE = 2

# Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "up",
    "predict",
    "plan",
    "simulate",
    "operator_cmd",
    "status",
    "agent",
    "gateway",
    "models",
)


class CliError(Exception):
    """An error the user can act on; printed as one line, exit status 2."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help once: only when the help does not already say
    what the default is, and never for defaults that mean "not set" (None, False, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default in (None, False, "", [], argparse.SUPPRESS)
            or action.option_strings == []
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


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
    for name in SUBCOMMANDS:
        importlib.import_module(f"warmserve.cli.{name}").register(sub)
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
