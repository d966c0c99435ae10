"""Which replica runs the loop: a ``coordination.k8s.io/v1`` Lease (issue 11, issue 16).

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
plus one retry period (defaults 10 s + 2 s), not kopf's peering lifetime (issue 16 measured
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
``leaseTransitions`` of the term this replica holds (:attr:`Leadership.token`).  A write that makes
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
import datetime as dt
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger("warmserve.operator")

PRIORITY_ANNOTATION = "warmserve.io/priority"
PREEMPT_ANNOTATION = "warmserve.io/preempt-by"
# client-go's defaults are 15 s / 10 s / 2 s; the Lease stays 10 s (issue 16's handover bound)
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
    token: int = 0  # the fencing token (leaseTransitions) of the last term written as ours


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


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str
    renew_s: float  # unix seconds of the last renewal
    duration_s: float
    priority: int = 0
    preempt_by: str = ""
    resource_version: str = ""
    transitions: int = 0  # spec.leaseTransitions: the fencing token of the holder's term

    def expired(self, now: float) -> bool:
        return not self.holder or self.renew_s + self.duration_s < now


def next_lease(
    rec: LeaseRecord | None, me: str, priority: int, now: float, duration_s: float
) -> tuple[bool, LeaseRecord | None]:
    """(leader after writing, the record to write or ``None`` for no write).  A write that
    starts a term (the Lease was not live and ours) increments ``transitions``."""
    mine = LeaseRecord(me, now, duration_s, priority)
    if rec is None:
        return True, replace(mine, transitions=1)
    new_term = replace(mine, resource_version=rec.resource_version, transitions=rec.transitions + 1)
    if rec.holder == me:
        if rec.preempt_by and rec.preempt_by != me:
            return False, replace(rec, holder="", preempt_by="")
        if not rec.expired(now):  # a renewal: the same term
            return True, replace(new_term, transitions=rec.transitions)
        return True, new_term
    if rec.expired(now):
        return True, new_term
    if priority > rec.priority and rec.preempt_by != me:
        return False, replace(rec, preempt_by=me)
    return False, None


def released(rec: LeaseRecord | None, me: str) -> LeaseRecord | None:
    """The record a replica that stops writes (client-go's ``ReleaseOnCancel``): the Lease
    emptied if it is still ours, so a standby takes it on its next round instead of waiting for
    it to expire; ``None`` (no write) if another replica holds it or there is none."""
    if rec is None or rec.holder != me:
        return None
    return replace(rec, holder="", preempt_by="")


def _micro(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _unix(value: Any) -> float:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()
    if not value:
        return 0.0
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True, slots=True)
class LeaseTarget:
    """Where a replica's Lease rounds go: ``coord``, a ``CoordinationV1Api``; ``run``, runs a
    blocking client call off the event loop; ``api_exception``, the client's error type; the
    Lease ``namespace/name``; ``manager``, the ``managed-by`` label it carries."""

    coord: Any
    api_exception: type[Exception]
    run: Callable[..., Any]
    namespace: str
    name: str
    manager: str


async def hold_lease(
    target: LeaseTarget,
    me: str,
    priority: int,
    duration_s: float,
    before_release: Callable[[], None] = lambda: None,
) -> tuple[bool | None, int]:
    """One round of :func:`next_lease` against the Lease: (whether we hold it, the Lease's
    ``leaseTransitions`` after the round).  None: our write lost a conflict, so who holds it is
    unknown until the next round."""
    obj, rec = await _read_lease(target, duration_s)
    now = dt.datetime.now(dt.UTC).timestamp()
    leader, write = next_lease(rec, me, priority, now, duration_s)
    if write is None:
        return leader, rec.transitions if rec is not None else 0
    if rec is not None and rec.holder == me and not write.holder:
        before_release()  # stop acting before the asker can take it
    if not await _write_lease(target, obj, write):
        # Another replica wrote first: a higher priority asking us to hand over (we still hold
        # it) or a taker of an expired Lease (our deadline passed before that).
        return None, 0
    return leader, write.transitions


async def release_lease(target: LeaseTarget, me: str, duration_s: float) -> bool:
    """Empty the Lease if it is still ours (:func:`released`); True if it was written."""
    obj, rec = await _read_lease(target, duration_s)
    write = released(rec, me)
    if write is None:
        return False
    return await _write_lease(target, obj, write)


async def _read_lease(target: LeaseTarget, duration_s: float) -> tuple[Any, LeaseRecord | None]:
    t = target
    try:
        obj = await t.run(t.coord.read_namespaced_lease, t.name, t.namespace)
    except t.api_exception as exc:
        if getattr(exc, "status", None) != 404:
            raise
        return None, None
    ann = obj.metadata.annotations or {}
    return obj, LeaseRecord(
        obj.spec.holder_identity or "",
        _unix(obj.spec.renew_time),
        float(obj.spec.lease_duration_seconds or duration_s),
        int(ann.get(PRIORITY_ANNOTATION, "0") or 0),
        ann.get(PREEMPT_ANNOTATION, ""),
        obj.metadata.resource_version or "",
        int(getattr(obj.spec, "lease_transitions", 0) or 0),
    )


async def _write_lease(target: LeaseTarget, obj: Any, write: LeaseRecord) -> bool:
    """Create or replace (with the read ``resourceVersion``); False: another replica wrote
    first (404/409)."""
    from kubernetes import client

    t = target
    body = client.V1Lease(
        metadata=client.V1ObjectMeta(
            name=t.name,
            namespace=t.namespace,
            resource_version=write.resource_version or None,
            annotations={
                PRIORITY_ANNOTATION: str(write.priority),
                PREEMPT_ANNOTATION: write.preempt_by,
            },
            labels={"app.kubernetes.io/managed-by": t.manager},
        ),
        spec=client.V1LeaseSpec(
            holder_identity=write.holder,
            lease_duration_seconds=int(max(write.duration_s, 1)),
            renew_time=_micro(write.renew_s) if write.holder else None,
            lease_transitions=write.transitions,
        ),
    )
    try:
        if obj is None:
            await t.run(t.coord.create_namespaced_lease, t.namespace, body)
        else:
            await t.run(t.coord.replace_namespaced_lease, t.name, t.namespace, body)
    except t.api_exception as exc:
        if getattr(exc, "status", None) in (404, 409):
            return False
        raise
    return True


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
                await asyncio.wait_for(self.release_round(), timeout=self.timing.retry_s)
                log.info("event=lease_released")
            except Exception as exc:  # best effort: the Lease then expires as before
                log.warning("event=lease_release_failed error=%r", str(exc) or type(exc).__name__)
