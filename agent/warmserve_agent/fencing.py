"""Fencing tokens: a stale operator leader's late calls cannot act (Kleppmann's fencing tokens,
Chubby's sequencers).

The operator fences itself (it acts only while its Lease renewal is fresh), but a call already
sent when it lost the Lease, or sent by a leader that was paused (GC, SIGSTOP, a partition)
between its check and its call, still reaches the agent after the standby took over.  So every
mutating call (and ``Describe``) carries ``fencing_token``: the caller's leadership term, the
Lease's ``leaseTransitions`` under its creation time, which only grows.  The agent keeps the
highest token it has seen and refuses a lower one (:func:`admit`, pure and property-tested):

* ``token > highest``: accepted, and the fence rises to it;
* ``token == highest``: accepted (the current leader's calls, retries included);
* ``0 < token < highest``: refused (``stale``): a newer leader has reached this agent;
* ``token == 0``: an unfenced caller (the ``warmserve`` CLI, tests, an older operator):
  accepted, unless the agent runs with ``--require-fencing-token`` (``unfenced``; ``Describe``
  stays open).  Its call never moves the fence.

:class:`Fence` applies the rule and keeps ``highest`` in a file (``--fencing-file``, by default
in the weight store, which outlives the agent process): an agent that forgot the fence on a
restart would accept the stale leader's next call.  The file is written (atomically, fsync'd)
*before* the call that raised the fence runs, so no state change that a newer token caused is
on the node unless the fence that protects it is on disk.  Reading the Lease from the agent
instead would need Kubernetes credentials and the Lease's name on every node, and the agent
would still have to trust the operator's calls in the order they arrive.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import grpc

from warmserve_agent.safe_text import bounded
from warmserve_agent.wire import FENCED_PREFIX

log = logging.getLogger("warmserve.agent.fencing")

MAX_TOKEN = 2**64 - 1  # uint64 on the wire


class FenceError(ValueError):
    """A fencing file the agent cannot read (the CLI prints it as one line)."""


class Refused(StrEnum):
    STALE = "stale"  # lower than the highest token seen
    UNFENCED = "unfenced"  # no token, and the agent requires one


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one call's token: ``refused`` is None when it may run; ``highest`` is the
    fence after it."""

    highest: int
    refused: Refused | None = None

    @property
    def accepted(self) -> bool:
        return self.refused is None


def admit(highest: int, token: int, require_token: bool = False) -> Verdict:
    """The rule (module docstring): monotonic, lower always refused, equal accepted."""
    if not 0 <= token <= MAX_TOKEN or not 0 <= highest <= MAX_TOKEN:
        raise ValueError(f"fencing tokens are uint64, got token={token} highest={highest}")
    if token == 0:
        return Verdict(highest, Refused.UNFENCED if require_token else None)
    if token < highest:
        return Verdict(highest, Refused.STALE)
    return Verdict(token)


def refusal_message(method: str, token: int, verdict: Verdict) -> str:
    """What the caller reads: why, and what to do."""
    if verdict.refused is Refused.UNFENCED:
        return (
            f"{FENCED_PREFIX} {method} carries no fencing_token and this agent requires one "
            "(--require-fencing-token); only the operator's current leader may change this node"
        )
    return (
        f"{FENCED_PREFIX} {method} carries fencing token {token}, but this agent has seen "
        f"token {verdict.highest}: a newer operator leader took over; this caller is no longer "
        "the leader and must not act"
    )


class Fence:
    """:func:`admit` over the agent's highest token, persisted in ``path`` (None: memory only).
    Thread-safe; ``refused`` counts refusals by (method, reason) for the metrics."""

    def __init__(self, path: Path | None = None, require_token: bool = False) -> None:
        self.path = path
        self.require_token = require_token
        self.highest = self._load()
        self.refused: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def _load(self) -> int:
        if self.path is None or not self.path.exists():
            return 0
        try:
            value = json.loads(self.path.read_text())["highest_token"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FenceError(
                f"fencing file {self.path} is unreadable ({exc}); it holds the highest operator "
                "leadership term this agent has seen: fix it, or delete it only if no stale "
                "operator replica can still reach this agent"
            ) from None
        if not isinstance(value, int) or not 0 <= value <= MAX_TOKEN:
            raise FenceError(f"fencing file {self.path}: highest_token must be a uint64")
        return value

    def check(self, method: str, token: int, read: bool = False) -> Verdict:
        """The verdict for one call (persisting a raised fence first); logs and counts a
        refusal (``event=call_fenced``).  ``read``: a ``Describe``, open to unfenced callers
        (the CLI) even when the agent requires tokens of mutations."""
        with self._lock:
            verdict = admit(self.highest, token, self.require_token and not read)
            if verdict.refused is not None:
                self.refused[(method, verdict.refused.value)] += 1
                log.warning(
                    "event=call_fenced method=%s token=%d highest=%d reason=%s",
                    method,
                    token,
                    verdict.highest,
                    verdict.refused.value,
                )
            elif verdict.highest > self.highest:
                log.info(
                    "event=fence_raised method=%s token=%d previous=%d",
                    method,
                    verdict.highest,
                    self.highest,
                )
                self._persist(verdict.highest)
                self.highest = verdict.highest
            return verdict

    def _persist(self, highest: int) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"highest_token": highest, "updated_unix": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)
        except OSError as exc:  # a read-only store: the fence still holds until a restart
            log.error(
                "event=fence_persist_failed path=%s token=%d error=%r: an agent restart will "
                "forget this fence",
                self.path,
                highest,
                str(exc),
            )


async def enforce(
    fence: Fence, method: str, token: int, context: grpc.aio.ServicerContext, read: bool = False
) -> None:
    """The servicer's check before any mutation: FAILED_PRECONDITION (``fenced: ...``) when
    :meth:`Fence.check` refuses ``token``."""
    verdict = fence.check(method, token, read)
    if verdict.refused is not None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, bounded(refusal_message(method, token, verdict))
        )
