"""What every ``warmserve`` command shares, below the command registry and the components.

The registry (:mod:`warmserve.cli`) names each subcommand's module; the component commands live
next to their components (``warmserve_operator.cli``, ``warmserve_agent.cli``,
``warmserve_gateway.cli``) and take from here what two or more of them need:

* :class:`CliError`: an error the user can act on, printed as one line with exit status 2;
* :class:`DefaultsHelpFormatter`: "(default: X)" once, only where it says something;
* :func:`default`: a flag's default read from the component's settings dataclass, so that it is
  stated once (the dataclass), never repeated as a literal in the parser;
* the flag groups two components share: :mod:`.engine_args` (operator and agent) and
  :mod:`.tracing` (gateway, operator and agent).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


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


def default(settings: type, name: str) -> Any:
    """The default of the field ``name`` of the dataclass ``settings`` (its default, or what its
    default factory makes)."""
    for f in dataclasses.fields(settings):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise ValueError(f"{settings.__name__}.{name} has no default")
    raise ValueError(f"{settings.__name__} has no field {name!r}")
