"""Fencing tokens: a stale operator leader's late calls cannot act (Kleppmann's fencing tokens,
Chubby's sequencers).

The operator fences itself (it acts only while its Lease renewal is fresh), but a call already
sent when it lost the Lease, or sent by a leader that was paused (GC, SIGSTOP, a partition)
between its check and its call, still reaches the agent after the standby took over.  So every
mutating call (and ``Describe``) carries ``fencing_token``: the caller's leadership term, the
Lease's ``creationTimestamp`` (unix seconds) in the high 32 bits and its ``leaseTransitions`` in
the low 32 (the layout is an API type: :mod:`warmserve.api.agent.fencing`), which only grows.
The agent keeps the highest token it has seen and refuses a lower one (:func:`admit`, pure and
property-tested):

* ``token > highest``: accepted, and the fence rises to it, if it is *plausible* (below);
* ``token == highest``: accepted (the current leader's calls, retries included);
* ``0 < token < highest``: refused (``stale``): a newer leader has reached this agent;
* ``token == 0``: an unfenced caller (the ``warmserve`` CLI, tests, an older operator):
  accepted, unless the agent runs with ``--require-fencing-token`` (``unfenced``; ``Describe``
  stays open).  Its call never moves the fence.

A raised fence is never lowered by a call, so one absurd token would lock the real leader out for
good (2**64-1 did, across restarts).  A rise is therefore bounded (:class:`Bounds`):

* ``future``: the token's creation time may lie at most ``max_skew_s`` past the agent's clock:
  no Lease is created in the future, so such a token is no operator's term;
* ``jump``: within one Lease (same creation time as the fence) the term may rise by at most
  ``max_term_jump`` at once: terms go up by one per leader change, and an agent misses at most
  the changes of its time away.  A newer Lease (a reinstall) may start at any term.

Both refusals are not ``fenced:`` ones (the caller is not deposed, its token is implausible), so
the operator does not step down for them.  Why bounds rather than tokens the operator signs:
a signature proves the token came from a holder of the signing key, which is the operator's
identity again (``--allow-client-id`` already admits only it), and it would still sign whatever
term it believes in; the bounds instead keep *any* caller's token within what a real Lease can
carry, with no second key to distribute and rotate.  What the bounds cannot catch (a plausible
but wrong term, e.g. of a Lease deleted since) an admin resets on the node:
:func:`reset_fence` (``warmserve agent reset-fence``; docs/security.md, "Recovering a fenced
agent"), which a running agent picks up at its next call.

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
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import grpc

from warmserve.api.agent.errors import FENCED_PREFIX
from warmserve.api.agent.fencing import MAX_TOKEN, split
from warmserve_agent.safe_text import bounded

log = logging.getLogger("warmserve.agent.fencing")

IMPLAUSIBLE_PREFIX = "implausible fencing token"


class FenceError(ValueError):
    """A fencing file the agent cannot read (the CLI prints it as one line)."""


class Refused(StrEnum):
    STALE = "stale"  # lower than the highest token seen
    UNFENCED = "unfenced"  # no token, and the agent requires one
    FUTURE = "future"  # its Lease creation time lies beyond the agent's clock plus the skew
    JUMP = "jump"  # more terms past the fence, within one Lease, than any agent can miss


@dataclass(frozen=True, slots=True)
class Bounds:
    """How far one call may raise the fence (module docstring).  ``max_skew_s``: clock skew
    allowed between the API server (which stamps the Lease) and this node; ``max_term_jump``:
    leader changes one agent may miss (1024 at the chart's 10 s Lease: hours of failovers)."""

    max_skew_s: float = 300.0
    max_term_jump: int = 1024

    def __post_init__(self) -> None:
        if not self.max_skew_s >= 0 or self.max_term_jump < 1:
            raise ValueError(
                f"fencing bounds need max_skew_s >= 0 and max_term_jump >= 1, got {self}"
            )


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one call's token: ``refused`` is None when it may run; ``highest`` is the
    fence after it."""

    highest: int
    refused: Refused | None = None

    @property
    def accepted(self) -> bool:
        return self.refused is None


def _check_uint64(**values: int) -> None:
    if not all(0 <= v <= MAX_TOKEN for v in values.values()):
        shown = " ".join(f"{k}={v}" for k, v in values.items())
        raise ValueError(f"fencing tokens are uint64, got {shown}")


def admit(
    highest: int,
    token: int,
    now_s: float,
    require_token: bool = False,
    bounds: Bounds = Bounds(),
) -> Verdict:
    """The rule (module docstring): monotonic, lower always refused, equal accepted, a rise
    only to a plausible term at the agent's clock ``now_s``."""
    _check_uint64(token=token, highest=highest)
    if token == 0:
        return Verdict(highest, Refused.UNFENCED if require_token else None)
    if token < highest:
        return Verdict(highest, Refused.STALE)
    if token == highest:
        return Verdict(highest)
    created, term = split(token)
    if created > now_s + bounds.max_skew_s:
        return Verdict(highest, Refused.FUTURE)
    fence_created, fence_term = split(highest)
    if created == fence_created and term - fence_term > bounds.max_term_jump:
        return Verdict(highest, Refused.JUMP)
    return Verdict(token)


def refusal_message(
    method: str, token: int, verdict: Verdict, now_s: float = 0.0, bounds: Bounds = Bounds()
) -> str:
    """What the caller reads: why, and what to do."""
    if verdict.refused is Refused.UNFENCED:
        return (
            f"{FENCED_PREFIX} {method} carries no fencing_token and this agent requires one "
            "(--require-fencing-token); only the operator's current leader may change this node"
        )
    created, term = split(token)
    recovery = (
        "no operator Lease can carry it; if the fence was raised wrongly, an admin on this "
        "node resets it (warmserve agent reset-fence; docs/security.md)"
    )
    if verdict.refused is Refused.FUTURE:
        return (
            f"{IMPLAUSIBLE_PREFIX} {token} on {method}: its Lease creation time {created} lies "
            f"{created - now_s:.0f} s past this agent's clock (at most {bounds.max_skew_s:.0f} s "
            f"of clock skew, --fencing-max-skew); {recovery}"
        )
    if verdict.refused is Refused.JUMP:
        return (
            f"{IMPLAUSIBLE_PREFIX} {token} on {method}: term {term} is "
            f"{term - split(verdict.highest)[1]} past the fence {verdict.highest} of the same "
            f"Lease (at most {bounds.max_term_jump}, --fencing-max-term-jump); {recovery}"
        )
    return (
        f"{FENCED_PREFIX} {method} carries fencing token {token}, but this agent has seen "
        f"token {verdict.highest}: a newer operator leader took over; this caller is no longer "
        "the leader and must not act"
    )


def _read(path: Path) -> tuple[int, os.stat_result | None]:
    """(highest token in ``path``, its stat); (0, None) when there is no file."""
    try:
        st = path.stat()
        value = json.loads(path.read_text())["highest_token"]
    except (FileNotFoundError, NotADirectoryError):
        return 0, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FenceError(
            f"fencing file {path} is unreadable ({exc}); it holds the highest operator "
            "leadership term this agent has seen: fix it, or reset it (warmserve agent "
            "reset-fence) only if no stale operator replica can still reach this agent"
        ) from None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN:
        raise FenceError(f"fencing file {path}: highest_token must be a uint64")
    return value, st


def _stamp(st: os.stat_result | None) -> tuple[int, ...] | None:
    return None if st is None else (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _write(path: Path, record: dict[str, object]) -> os.stat_result:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path.stat()


class Fence:
    """:func:`admit` over the agent's highest token, persisted in ``path`` (None: memory only).
    Thread-safe; ``refused`` counts refusals by (method, reason) and ``resets`` the resets an
    admin wrote into the file while the agent ran, for the metrics."""

    def __init__(
        self,
        path: Path | None = None,
        require_token: bool = False,
        bounds: Bounds = Bounds(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.require_token = require_token
        self.bounds = bounds
        self.clock = clock
        self.highest, st = _read(path) if path is not None else (0, None)
        self._stamp = _stamp(st)
        self.refused: Counter[tuple[str, str]] = Counter()
        self.resets = 0
        self._lock = threading.Lock()
        if admit(0, self.highest, clock(), bounds=bounds).refused is Refused.FUTURE:
            log.error(
                "event=fence_implausible path=%s highest=%d: the fence on disk lies in the "
                "future, so the operator's real term is refused; reset it (warmserve agent "
                "reset-fence)",
                path,
                self.highest,
            )

    def check(self, method: str, token: int, read: bool = False) -> Verdict:
        """The verdict for one call (persisting a raised fence first); logs and counts a
        refusal (``event=call_fenced``).  ``read``: a ``Describe``, open to unfenced callers
        (the CLI) even when the agent requires tokens of mutations."""
        with self._lock:
            self._pick_up_reset()
            now = self.clock()
            verdict = admit(
                self.highest, token, now, self.require_token and not read, self.bounds
            )
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

    def message(self, method: str, token: int, verdict: Verdict) -> str:
        return refusal_message(method, token, verdict, self.clock(), self.bounds)

    def _pick_up_reset(self) -> None:
        """A file that changed under the running agent was written by ``reset-fence`` (the
        agent writes it only here, and records what it wrote): take its value."""
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError:
            return
        if _stamp(st) == self._stamp:
            return
        try:
            value, st = _read(self.path)
        except FenceError as exc:
            log.error("event=fence_reload_failed %s; keeping %d", exc, self.highest)
            self._stamp = _stamp(st)
            return
        self._stamp = _stamp(st)
        if value == self.highest:
            return
        self.resets += 1
        log.warning(
            "event=fence_reset path=%s previous=%d highest=%d: the fencing file was rewritten "
            "while the agent ran (warmserve agent reset-fence)",
            self.path,
            self.highest,
            value,
        )
        self.highest = value

    def _persist(self, highest: int) -> None:
        if self.path is None:
            return
        try:
            st = _write(self.path, {"highest_token": highest, "updated_unix": time.time()})
            self._stamp = _stamp(st)
        except OSError as exc:  # a read-only store: the fence still holds until a restart
            log.error(
                "event=fence_persist_failed path=%s token=%d error=%r: an agent restart will "
                "forget this fence",
                self.path,
                highest,
                str(exc),
            )


@dataclass(frozen=True, slots=True)
class Reset:
    """What :func:`reset_fence` did: the fence before (None: no readable file) and after."""

    path: Path
    previous: int | None
    highest: int


def reset_fence(
    path: Path,
    to: int = 0,
    reason: str = "",
    actor: str = "",
    now_s: float | None = None,
    bounds: Bounds = Bounds(),
) -> Reset:
    """Set the fence in ``path`` to ``to`` (0: forget it; the operator's next call raises it to
    its current term), with who did it and why in the file.  For an admin on the node whose
    agent refuses the operator's real term; a running agent takes the new value at its next
    call.  ``to`` must itself be plausible (not in the future)."""
    now = time.time() if now_s is None else now_s
    _check_uint64(to=to)
    if to and admit(0, to, now, bounds=bounds).refused is Refused.FUTURE:
        raise FenceError(
            f"--to {to}: its Lease creation time {split(to)[0]} lies in the future; give the "
            "operator's current fencing token (its log's event=leadership_acquired) or 0"
        )
    try:
        previous: int | None = _read(path)[0]
    except FenceError:
        previous = None
    record = {
        "highest_token": to,
        "updated_unix": now,
        "reset": {"previous": previous, "reason": reason, "by": actor, "unix": now},
    }
    try:
        _write(path, record)
    except OSError as exc:
        raise FenceError(f"cannot write the fencing file {path}: {exc}") from None
    log.warning(
        "event=fence_reset_written path=%s previous=%s highest=%d by=%r reason=%r",
        path,
        previous,
        to,
        actor,
        reason,
    )
    return Reset(path, previous, to)


async def enforce(
    fence: Fence, method: str, token: int, context: grpc.aio.ServicerContext, read: bool = False
) -> None:
    """The servicer's check before any mutation: FAILED_PRECONDITION (``fenced: ...`` for a
    deposed caller, ``implausible fencing token ...`` for a bounded rise) when
    :meth:`Fence.check` refuses ``token``."""
    verdict = fence.check(method, token, read)
    if verdict.refused is not None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, bounded(fence.message(method, token, verdict))
        )
