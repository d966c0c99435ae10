"""``warmserve agent reset-fence``: an admin on the node resets an agent's fencing token.

An agent keeps the highest operator leadership term it has seen (its ``--fencing-file``) and
refuses any lower one.  If that fence was raised by a term no live operator holds (a Lease that
was deleted, a token from a misbehaving caller within the bounds the agent checks), the real
leader is refused until the fence is reset.  This command writes the new fence (default 0:
forget it, the leader's next call raises it to its term) with who and why into the file; a
running agent takes it at its next call, logs ``event=fence_reset`` and counts it in
``warmserve_agent_fence_resets_total``.  Node access (or ``kubectl exec`` into the agent pod) is
the privilege it needs, like the file itself.  See docs/security.md, "Recovering a fenced agent".
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import socket
from typing import Any

from warmserve.flags import CliError


def register(sub: Any) -> None:
    r = sub.add_parser(
        "reset-fence",
        help="reset this node's fencing token (admin recovery; see docs/security.md)",
        description="Reset the highest operator leadership term (fencing token) an agent keeps, "
        "when it refuses the operator's real term. Run it on the node or in the agent pod; a "
        "running agent picks the new value up at its next call.",
    )
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--model-dir", help="the agent's weight store (its default fencing file lives there)"
    )
    where.add_argument("--fencing-file", help="the agent's --fencing-file")
    r.add_argument(
        "--to",
        type=int,
        default=0,
        metavar="TOKEN",
        help="the new fence: the operator leader's current token (its log's "
        "event=leadership_acquired fencing_token=N), or 0 (default) to forget it",
    )
    r.add_argument("--reason", required=True, help="why (kept in the file and logged)")
    r.set_defaults(func=reset_fence_cmd)


def reset_fence_cmd(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..config import FENCING_FILE
    from ..fencing import FenceError, reset_fence

    logging.basicConfig(level="INFO", format="ts=%(asctime)s level=%(levelname)s %(message)s")
    if args.fencing_file:
        path = Path(args.fencing_file)
    else:
        if not Path(args.model_dir).is_dir():
            raise CliError(f"--model-dir {args.model_dir} is not a directory (the weight store)")
        path = Path(args.model_dir) / FENCING_FILE
    if not path.parent.is_dir():
        raise CliError(f"--fencing-file {path}: {path.parent} is not a directory")
    if not args.reason.strip():
        raise CliError("--reason must say why the fence is reset")
    actor = f"{os.environ.get('SUDO_USER') or getpass.getuser()}@{socket.gethostname()}"
    try:
        done = reset_fence(path, args.to, reason=args.reason.strip(), actor=actor)
    except (FenceError, ValueError) as exc:
        raise CliError(str(exc)) from None
    before = "unreadable" if done.previous is None else str(done.previous)
    print(
        f"fence in {done.path} reset: {before} -> {done.highest} by {actor}; a running agent "
        "takes it at its next call (event=fence_reset)"
    )
    return 0
