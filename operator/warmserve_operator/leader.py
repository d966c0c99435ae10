"""Which replica runs the loop: a ``coordination.k8s.io/v1`` Lease.

The loop used to read kopf's internal ``ClusterKopfPeering`` status; now it holds a standard
Lease in the operator's namespace (the one ``kubectl get lease`` shows, like every controller
built on client-go).  kopf's peering still pauses kopf's own handlers on non-leaders; the two
agree because both prefer the live replica with the highest priority.

The rule (:func:`next_lease`, pure, unit-tested):

* no Lease, an empty holder or an expired one (``renewTime + leaseDurationSeconds`` in the
  past): take it;
* held by us: renew it — unless a live replica with a higher priority asked for it
  (``warmserve.io/preempt-by``), then release it (the asker takes it on its next round);
* held by a live replica with a lower priority: ask it to hand over (``preempt-by``);
* otherwise: wait.

So a replacement with a lower priority than a dead leader waits at most one lease duration
plus one retry period (defaults 10 s + 2 s), not kopf's peering lifetime (measured:
52.9 s); and two replicas never both hold it: every write carries the read
``resourceVersion``, so a conflicting write loses.

Holding the Lease is not enough to act safely: a leader whose poll outlasted the Lease acted
after a standby had taken it (two actors; ``tests/e2e/test_leader_fencing_e2e.py``).  So, as
client-go's ``leaderelection`` does, the Lease is renewed by its own task (:class:`Elector`,
every ``retry_s``, whatever the loop is doing) and the leader *fences* itself: it acts only while
its last successful renewal *started* less than ``renew_deadline_s`` ago on the monotonic clock
(:func:`leading`).  That renewal wrote a ``renewTime`` no earlier than its start, and another
replica takes the Lease only once ``renewTime + lease_s`` has passed; ``renew_deadline_s <
lease_s`` leaves the margin (clock skew between nodes, the last log line) in between, so the
old leader stops before anyone else may start.

The self-fence cannot recall a call already sent, nor stop a leader paused (GC, SIGSTOP, a
partition) between its check and its call.  So every agent call carries a *fencing token*
(Kleppmann; Chubby's sequencers, :mod:`warmserve_agent.fencing`): the Lease's
``leaseTransitions`` of the term this replica holds, under the Lease's creation time
(:func:`.lease.fencing_token`, :attr:`Leadership.token`).  A write that makes
a replica the holder of a Lease that was not live and its own — created, empty, another's, or
expired (a re-acquire by the same holder after losing it included) — increments it
(:func:`next_lease`); renewals, hand-over requests and releases keep it.  Every write is a
compare-and-swap on ``resourceVersion``, so two terms never get the same number and a later term
always has a higher one.  The agent refuses a token lower than the highest it has seen; the
operator treats a refusal of its current term's token as losing the Lease
(``reason=fenced_by_agent``, :meth:`Elector.refused`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .lease import (  # re-exported: the Lease's rule and I/O live in .lease
    PREEMPT_ANNOTATION,
    PRIORITY_ANNOTATION,
    LeaseRecord,
    LeaseTarget,
    hold_lease,
    next_lease,
    release_lease,
    released,
)

__all__ = [
    "PREEMPT_ANNOTATION",
    "PRIORITY_ANNOTATION",
    "ElectionConfigError",
    "ElectionTiming",
    "Elector",
    "Leadership",
    "LeaseRecord",
    "LeaseTarget",
    "LoopFence",
    "NotLeader",
    "after_round",
    "hold_lease",
    "leading",
    "next_lease",
    "release_lease",
    "released",
]

log = logging.getLogger("warmserve.operator")

# client-go's defaults are 15 s / 10 s / 2 s; the Lease stays 10 s (the handover bound)
# with about the same proportions, which also give the defaults for another Lease duration.
DEFAULT_LEASE_S = 10.0
RENEW_DEADLINE_SHARE = 0.7
RETRY_SHARE = 0.2


class ElectionConfigError(ValueError):
    """Leader-election timings that cannot keep two replicas from acting at once."""


class NotLeader(Exception):
    """Raised by a leader-only write once this replica stopped leading (fenced)."""


@dataclass(frozen=True, slots=True)
class ElectionTiming:
    """``lease_s``: how long a Lease lasts after its renewal (``--lease-seconds``);
    ``renew_deadline_s``: how long the leader keeps acting without a successful renewal
    (``--renew-deadline-seconds``); ``retry_s``: time between renewal / acquisition rounds
    (``--retry-period-seconds``)."""

    lease_s: float = DEFAULT_LEASE_S
    renew_deadline_s: float = DEFAULT_LEASE_S * RENEW_DEADLINE_SHARE
    retry_s: float = DEFAULT_LEASE_S * RETRY_SHARE

    @classmethod
    def for_lease(
        cls, lease_s: float, renew_deadline_s: float | None = None, retry_s: float | None = None
    ) -> ElectionTiming:
        """Unset timings follow the Lease: 0.7x and 0.2x of it (7 s and 2 s for 10 s)."""
        return cls(
            lease_s,
            lease_s * RENEW_DEADLINE_SHARE if renew_deadline_s is None else renew_deadline_s,
            lease_s * RETRY_SHARE if retry_s is None else retry_s,
        )

    def __post_init__(self) -> None:
        for name, v in (
            ("lease duration", self.lease_s),
            ("renew deadline", self.renew_deadline_s),
            ("retry period", self.retry_s),
        ):
            if not (math.isfinite(v) and v > 0):
                raise ElectionConfigError(f"{name} must be > 0 seconds, got {v}")
        if self.lease_s != int(self.lease_s):
            raise ElectionConfigError(
                f"lease duration must be a whole number of seconds (the Lease stores "
                f"leaseDurationSeconds as an integer), got {self.lease_s}"
            )
        if not self.renew_deadline_s < self.lease_s:
            raise ElectionConfigError(
                f"renew deadline ({self.renew_deadline_s} s) must be shorter than the lease "
                f"duration ({self.lease_s} s): a leader that cannot renew must stop acting "
                "before another replica may take the Lease"
            )
        if not self.retry_s < self.renew_deadline_s:
            raise ElectionConfigError(
                f"retry period ({self.retry_s} s) must be shorter than the renew deadline "
                f"({self.renew_deadline_s} s): a leader must get more than one try to renew"
            )


@dataclass(frozen=True, slots=True)
class Leadership:
    """What a replica knows of its own leadership, on the monotonic clock: whether its last
    round held the Lease and when the last round that wrote it as ours *started*."""

    holder: bool = False
    renewed_at: float = -math.inf
    token: int = 0  # the fencing token (.lease.fencing_token) of the last term written as ours


def after_round(
    state: Leadership, started: float, held: bool | None, token: int | None = None
) -> Leadership:
    """The state after a round that started at ``started``: ``held`` True: it wrote the Lease
    as ours; False: another replica holds it, or we released it; None: the round failed (an API
    error or a timeout): nothing is known, so the last renewal still counts (until the
    deadline, like client-go's renew loop).  ``token``: the term the round wrote (None: the
    one held before)."""
    if held is None:
        return state
    tok = state.token if token is None else token
    if held:
        return Leadership(True, max(started, state.renewed_at), tok)
    return Leadership(False, state.renewed_at, state.token)


def leading(state: Leadership, timing: ElectionTiming, now: float) -> bool:
    """The fence: act only while the last successful renewal started < renew deadline ago."""
    return state.holder and now - state.renewed_at < timing.renew_deadline_s


class LoopFence:
    """Whether this replica's loop may act: it held the Lease for ``settle_polls`` polls in a
    row (:meth:`poll`), and its Lease was renewed within the renew deadline (``leading``:
    :meth:`Elector.leading`), checked by :meth:`may_act` right before each side effect, not at
    the poll's start (a poll may outlast the Lease)."""

    def __init__(self, leading: Callable[[], bool], settle_polls: int) -> None:
        self.leading = leading
        self.settle_polls = settle_polls
        self.streak = 0
        self.leader = False

    def poll(self, holds: bool) -> bool:
        """A poll saw this replica hold the Lease (or not); returns whether the loop leads."""
        self.streak = self.streak + 1 if holds else 0
        self.leader = self.streak >= self.settle_polls
        return self.leader

    def lost(self) -> None:
        self.leader = False
        self.streak = 0

    def may_act(self) -> bool:
        return self.leader and self.leading()


class Elector:
    """Runs the Lease rounds on their own schedule (every ``timing.retry_s``, independent of how
    long a poll takes) and answers :meth:`leading`, the fence checked before every leader-only
    side effect.  ``round``: one :func:`hold_lease` round (True: we hold it; False: another
    does; None: unknown, e.g. a write conflict), alone or with the term's fencing token.
    ``on_change(leading, reason)`` is called on every transition (metrics, waking the loop).
    :meth:`token` and :meth:`refused` are what agent calls use (the operator's
    ``agents.Fencing``)."""

    def __init__(
        self,
        round_: Callable[[], Awaitable[bool | tuple[bool | None, int] | None]],
        timing: ElectionTiming,
        clock: Callable[[], float] = time.monotonic,
        release_: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.round = round_
        self.release_round = release_  # on stop: empty the Lease if still ours
        self.timing = timing
        self.clock = clock
        self.state = Leadership()
        self.on_change: Callable[[bool, str], None] = lambda leading, reason: None
        self._was = False  # what the last transition said

    def release(self) -> None:
        """About to hand the Lease over (a higher priority asked): stop acting first."""
        self.state = Leadership(False, self.state.renewed_at, self.state.token)
        if self._was:
            self._transition(False, "released", self.clock() - self.state.renewed_at)

    def token(self) -> int:
        """The fencing token every agent call carries: the term this replica holds or last
        held (0: never led, an unfenced caller)."""
        return self.state.token

    def refused(self, token: int) -> None:
        """An agent refused a call that carried ``token``: it has seen a newer term.  If that
        is our current term, another replica leads: stop at once, as if the Lease were lost
        (``reason=fenced_by_agent``); a call of an earlier term of ours changes nothing."""
        if token == 0 or token < self.state.token:
            log.info("event=stale_call_fenced token=%d current=%d", token, self.state.token)
            return
        self.state = Leadership(False, self.state.renewed_at, self.state.token)
        if self._was:
            self._transition(False, "fenced_by_agent", self.clock() - self.state.renewed_at)

    def leading(self) -> bool:
        ok = leading(self.state, self.timing, self.clock())
        if ok != self._was:
            since = self.clock() - self.state.renewed_at
            reason = "acquired" if ok else ("renew_deadline" if self.state.holder else "lost")
            self._transition(ok, reason, since)
        return ok

    def _transition(self, ok: bool, reason: str, since: float) -> None:
        self._was = ok
        if ok:
            log.info(
                "event=leadership_acquired lease_s=%s fencing_token=%d",
                self.timing.lease_s,
                self.state.token,
            )
        else:
            log.warning(
                "event=leadership_lost reason=%s since_renewal_s=%.2f renew_deadline_s=%.2f",
                reason,
                since,
                self.timing.renew_deadline_s,
            )
        self.on_change(ok, reason)

    async def run_round(self) -> None:
        started = self.clock()
        # While leading, a round may take until the deadline (then it counts as failed and the
        # fence has already dropped leadership); otherwise one renew deadline.
        budget = self.timing.renew_deadline_s
        left = self.state.renewed_at + budget - started
        if self.state.holder and left > 0:
            budget = left
        token: int | None = None
        try:
            held = await asyncio.wait_for(self.round(), timeout=budget)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the API is down or slow: retry; the fence keeps us safe
            held = None
            log.warning("event=lease_round_failed error=%r", str(exc) or type(exc).__name__)
        if isinstance(held, tuple):
            held, token = held
        before = self.state.token
        self.state = after_round(self.state, started, held, token)
        if self._was and self.state.holder and self.state.token != before:
            # Our own Lease had expired and nobody took it: a new term, the same leader.
            log.info("event=leadership_term token=%d previous=%d", self.state.token, before)
        self.leading()  # log and report a transition now, not at the next poll

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds every ``retry_s`` until ``stop``; then stop leading and, on a clean stop,
        release the Lease if it is still ours (``release_``; client-go's ``ReleaseOnCancel``),
        so a standby takes over on its next round, not after the Lease expires (a rolling
        update of the operator).  The fence drops first, as for a hand-over."""
        try:
            while not stop.is_set():
                await self.run_round()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.timing.retry_s)
        finally:
            held = self.state.holder
            self.state = Leadership(token=self.state.token)  # the last term, for the record
            if self._was:
                self._transition(False, "stopped", 0.0)
        if held and self.release_round is not None:
            try:
                # Up to the renew deadline, not one retry: a release slowed by a busy API server
                # still spares the standby the Lease's expiry, and the stop stays bounded.
                await asyncio.wait_for(self.release_round(), timeout=self.timing.renew_deadline_s)
                log.info("event=lease_released")
            except Exception as exc:  # best effort: the Lease then expires as before
                log.warning("event=lease_release_failed error=%r", str(exc) or type(exc).__name__)
