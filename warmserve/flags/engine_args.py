"""The admin's engine-argument flags, shared by ``warmserve operator`` and ``warmserve agent``.

Both enforce the same allowlist (the operator at admission, every agent again before an instance
starts), so the chart passes both the same values (``engineArgs`` in values.yaml).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from warmserve.flags import CliError


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "engine arguments",
        "what tenants may set in spec.engine.args (docs/security.md, 'Engine arguments'); give "
        "the operator and every agent the same flags",
    )
    g.add_argument(
        "--allow-engine-arg",
        action="append",
        default=[],
        dest="allow_engine_args",
        metavar="DEST",
        help="let tenants set this vLLM engine argument too (its dest or flag, e.g. "
        "kv_events_config; repeatable); arguments that can run code are refused here",
    )
    g.add_argument(
        "--unsafe-allow-code-engine-arg",
        action="append",
        default=[],
        dest="unsafe_engine_args",
        metavar="DEST",
        help="let tenants set an engine argument that can run code on the GPU node, e.g. "
        "trust_remote_code (repeatable): only for tenants trusted with the node, its other "
        "tenants' weights and the agent's files",
    )


def policy(args: argparse.Namespace) -> Any:
    """The :class:`~warmserve.engine_args.EngineArgPolicy` of the flags (CliError if bad)."""
    from warmserve.engine_arg_policy import EngineArgPolicy, EngineArgPolicyError
    from warmserve.engine_args import load_schema

    try:
        pol = EngineArgPolicy.from_admin(
            args.allow_engine_args, args.unsafe_engine_args, known=load_schema().dests
        )
    except EngineArgPolicyError as exc:
        raise CliError(str(exc)) from None
    return pol


def log_policy(pol: Any, log: logging.Logger) -> None:
    """Say at start what the admin widened; loudly when it may run code."""
    if pol.extra:
        log.info("event=engine_args_widened dests=%s", ",".join(sorted(pol.extra)))
    if pol.unsafe:
        log.warning(
            "event=unsafe_engine_args dests=%s: tenants may set engine arguments that run code "
            "on the GPU nodes",
            ",".join(sorted(pol.unsafe)),
        )
