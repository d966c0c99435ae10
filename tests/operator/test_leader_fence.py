"""The leader fence (operator/warmserve_operator/leader.py): renewal on its own schedule, and a
leader that stops acting before anyone else may start.

The property test replays Lease rounds of several replicas against one Lease with arbitrary
delays (slow reads, slow writes, rounds that time out while their write still lands, long
stalls) through the same pure rules the operator runs (:func:`next_lease`, :func:`after_round`,
:func:`leading`) and checks that no two replicas ever lead at the same moment.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_operator.leader import (
    ElectionConfigError,
    ElectionTiming,
    Elector,
    Leadership,
    LeaseRecord,
    after_round,
    leading,
    next_lease,
)

# ---------------------------------------------------------------------------- timings


def test_timings_are_checked() -> None:
    t = ElectionTiming()
    assert (t.lease_s, t.renew_deadline_s, t.retry_s) == pytest.approx((10.0, 7.0, 2.0))
    assert ElectionTiming.for_lease(4) == ElectionTiming(4, 4 * 0.7, 4 * 0.2)
    assert ElectionTiming.for_lease(15, 10, 2) == ElectionTiming(15, 10, 2)
    with pytest.raises(ElectionConfigError, match="shorter than the lease"):
        ElectionTiming.for_lease(4, 5)
    with pytest.raises(ElectionConfigError, match=r"renew deadline .* shorter than the lease"):
        ElectionTiming(10, 10, 2)
    with pytest.raises(ElectionConfigError, match=r"renew deadline .* shorter than the lease"):
        ElectionTiming(10, 12, 2)
    with pytest.raises(ElectionConfigError, match=r"retry period .* shorter than the renew"):
        ElectionTiming(10, 5, 5)
    with pytest.raises(ElectionConfigError, match="whole number"):
        ElectionTiming(2.5, 1, 0.2)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ElectionConfigError, match="must be > 0"):
            ElectionTiming(10, 7, bad)


def test_cli_rejects_a_renew_deadline_not_shorter_than_the_lease(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from warmserve.cli import main

    assert main(["operator", "--lease-seconds", "10", "--renew-deadline-seconds", "10"]) == 2
    err = capsys.readouterr().err
    assert "renew deadline (10.0 s) must be shorter than the lease duration (10.0 s)" in err
    assert "--renew-deadline-seconds" in err
    assert main(["operator", "--retry-period-seconds", "7"]) == 2
    assert "retry period (7.0 s) must be shorter" in capsys.readouterr().err


def test_help_documents_the_election_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from warmserve.cli import main

    with pytest.raises(SystemExit):
        main(["operator", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--lease-seconds", "--renew-deadline-seconds", "--retry-period-seconds"):
        assert flag in out
    assert "stops acting" in out and "0.7 x --lease-seconds, 7 s" in out
    assert "0.2 x --lease-seconds, 2 s" in out


# ---------------------------------------------------------------------------- the fence


def test_fence_follows_the_last_successful_renewal() -> None:
    t = ElectionTiming(4, 3, 1)
    s = after_round(Leadership(), 10.0, True)
    assert leading(s, t, 10.0) and leading(s, t, 12.99) and not leading(s, t, 13.0)
    s2 = after_round(s, 11.0, None)  # a failed round changes nothing
    assert s2 == s and not leading(s2, t, 13.5)
    s3 = after_round(s2, 12.0, True)  # renewed: 3 s from the round's start
    assert leading(s3, t, 14.9) and not leading(s3, t, 15.0)
    s4 = after_round(s3, 13.0, False)  # another holds it: at once
    assert not leading(s4, t, 13.0)


delays = st.one_of(st.floats(0.0, 0.1), st.floats(0.0, 3.0))  # mostly quick, some stalls


@st.composite
def schedules(draw: st.DrawFn) -> tuple[ElectionTiming, list[list[tuple[float, ...]]]]:
    """Timings, and per replica its rounds: (gap before it, read takes, write takes, the
    answer takes)."""
    lease = draw(st.integers(1, 4))
    deadline = draw(st.floats(0.1, lease - 0.01))
    timing = ElectionTiming(lease, deadline, deadline / 2)
    plans = [
        draw(st.lists(st.tuples(delays, delays, delays, delays), min_size=1, max_size=12))
        for _ in range(draw(st.integers(2, 3)))
    ]
    return timing, plans


@given(schedules(), st.lists(st.integers(0, 3), min_size=3, max_size=3))
@settings(max_examples=400, deadline=None)
def test_no_two_replicas_lead_at_once(
    sched: tuple[ElectionTiming, list[list[tuple[float, ...]]]], prios: list[int]
) -> None:
    replay(*sched, prios)


Fence = Callable[[Leadership, ElectionTiming, float], bool]


def replay(
    timing: ElectionTiming,
    plans: list[list[tuple[float, ...]]],
    prios: list[int],
    fence: Fence = leading,
) -> None:
    """Run the replicas' rounds on one timeline; assert that at most one passes ``fence`` at
    any moment."""
    rd = timing.renew_deadline_s
    names = [f"r{i}" for i in range(len(plans))]
    lease: LeaseRecord | None = None
    version = 0
    states = [Leadership() for _ in names]
    # (replica, round) -> (version read, decision) once read before the round timed out
    reads: dict[tuple[int, int], tuple[int, bool, LeaseRecord | None]] = {}
    results: dict[tuple[int, int], tuple[bool | None, int | None]] = {}
    terms: list[int] = []  # leaseTransitions of every version written
    finished: set[tuple[int, int]] = set()
    starts: dict[tuple[int, int], float] = {}
    events: list[tuple[float, int, int, int, str]] = []
    seq = itertools.count()

    def start(i: int, j: int, t: float) -> None:
        if j >= len(plans[i]):
            return
        gap, read, write, answer = plans[i][j]
        t0 = t + gap
        starts[i, j] = t0
        left = states[i].renewed_at + rd - t0
        budget = left if states[i].holder and left > 0 else rd
        events.append((t0 + read, next(seq), i, j, "read"))
        events.append((t0 + read + write, next(seq), i, j, "write"))
        events.append((t0 + read + write + answer, next(seq), i, j, "answer"))
        events.append((t0 + budget, next(seq), i, j, "timeout"))

    def check(t: float) -> None:
        """At most one replica passes the fence at ``t`` (states change only at events, and
        the fence only closes between them, so events are the moments to look at)."""
        now = [k for k in range(len(names)) if fence(states[k], timing, t)]
        assert len(now) <= 1, f"{[names[k] for k in now]} all lead at {t:.3f}: {states}"
        # Fencing tokens: the leader's is the Lease's current term, so every later leader's
        # token is higher (leaseTransitions never decreases) and the agent refuses this one's
        # late calls once it has seen the next.
        assert terms == sorted(terms), f"leaseTransitions went down: {terms}"
        for k in now:
            assert lease is not None and states[k].token == lease.token >= 1, (
                f"{names[k]} leads with token {states[k].token}, the Lease is at {lease}"
            )

    for i in range(len(names)):
        start(i, 0, 0.0)
    while events:
        events.sort()
        t, _, i, j, kind = events.pop(0)
        check(t)
        if kind == "read":
            if (i, j) in finished:
                continue  # timed out first: the round was cancelled before it could write
            lead, write = next_lease(lease, names[i], prios[i], t, float(timing.lease_s))
            if lease is not None and lease.holder == names[i] and write and not write.holder:
                states[i] = Leadership(False, states[i].renewed_at, states[i].token)
            reads[i, j] = (version, lead, write)
        elif kind == "write":
            if (i, j) not in reads:
                continue
            read_version, lead, write = reads[i, j]
            if write is None:
                results[i, j] = (lead, None)
            elif read_version == version:  # compare-and-swap on resourceVersion
                lease, version = replace(write, resource_version=str(version + 1)), version + 1
                terms.append(write.transitions)
                results[i, j] = (lead, write.token)
            else:
                results[i, j] = (None, None)  # conflict: unknown
        elif (i, j) not in finished:  # the answer, or the timeout, whichever comes first
            finished.add((i, j))
            held, token = results.get((i, j), (None, None)) if kind == "answer" else (None, None)
            states[i] = after_round(states[i], starts[i, j], held, token)
            start(i, j + 1, t)
        check(t)


def test_the_replay_catches_a_fence_that_outlives_the_lease() -> None:
    """Not vacuous: a leader whose renewal stalls (5 s answer) is replaced by a polling
    standby; the real fence keeps them apart, a fence without a deadline (the old loop: lead
    until the next round says otherwise) or one as long as the Lease does not."""
    timing = ElectionTiming(2, 1.5, 0.75)
    quick = (0.5, 0.01, 0.01, 0.01)
    plans = [[(0, 0.01, 0.01, 0.01), (0.5, 0.01, 0.01, 5.0), quick], [quick] * 10]
    replay(timing, plans, [1, 0])
    for bad in (
        lambda s, t, now: s.holder,
        lambda s, t, now: s.holder and now - s.renewed_at < t.lease_s + 0.5,
    ):
        with pytest.raises(AssertionError, match=r"all lead|leads with token"):
            replay(timing, plans, [1, 0], bad)


# ---------------------------------------------------------------------------- the Elector


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_elector_fences_at_the_deadline_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    """A leader whose renewals fail stops at the renew deadline, says why, reports it once."""
    clock = FakeClock()
    answers: list[bool | Exception | None] = [True, RuntimeError("etcd down"), None]
    changes: list[tuple[bool, str]] = []

    async def round_() -> bool | None:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    e = Elector(round_, ElectionTiming(4, 3, 1), clock)
    e.on_change = lambda lead, why: changes.append((lead, why))

    async def go() -> None:
        await e.run_round()
        assert e.leading() and changes == [(True, "acquired")]
        clock.t += 2.0
        await e.run_round()  # an API error: still leading until the deadline
        assert e.leading()
        clock.t += 0.9
        await e.run_round()  # unknown (a conflict)
        assert e.leading()
        clock.t += 0.2  # 3.1 s since the last successful renewal started
        assert not e.leading() and not e.leading()

    with caplog.at_level("INFO", logger="warmserve.operator"):
        asyncio.run(go())
    assert changes == [(True, "acquired"), (False, "renew_deadline")]
    lost = [r.getMessage() for r in caplog.records if "leadership_lost" in r.getMessage()]
    assert lost == [
        "event=leadership_lost reason=renew_deadline since_renewal_s=3.10 renew_deadline_s=3.00"
    ]


def test_elector_renews_while_a_poll_blocks_and_stops_on_stop() -> None:
    """Renewal runs on its own task: a poll that takes longer than the Lease does not stop it."""
    rounds: list[float] = []

    async def round_() -> bool:
        rounds.append(asyncio.get_running_loop().time())
        return True

    async def go() -> None:
        e = Elector(round_, ElectionTiming(1, 0.5, 0.05))
        stop = asyncio.Event()
        task = asyncio.create_task(e.run(stop))
        await asyncio.sleep(0.6)  # "a slow poll" on the same loop
        assert e.leading() and len(rounds) >= 5
        stop.set()
        await task
        assert not e.leading()

    asyncio.run(go())


def test_a_released_lease_fences_before_the_write() -> None:
    """hold_lease calls before_release before writing the hand-over (the asker may take the
    Lease as soon as that write lands)."""
    from warmserve_operator.leader import (
        PREEMPT_ANNOTATION,
        PRIORITY_ANNOTATION,
        LeaseTarget,
        hold_lease,
    )

    order: list[str] = []

    obj = SimpleNamespace(
        metadata=SimpleNamespace(
            annotations={PRIORITY_ANNOTATION: "1", PREEMPT_ANNOTATION: "other"},
            resource_version="5",
        ),
        spec=SimpleNamespace(
            holder_identity="me", renew_time="2999-01-01T00:00:00Z", lease_duration_seconds=10
        ),
    )

    class Coord:
        def read_namespaced_lease(self, name: str, ns: str) -> SimpleNamespace:
            return obj

        def replace_namespaced_lease(self, name: str, ns: str, body: object) -> None:
            order.append("write")

    async def run(fn: object, *a: object) -> object:
        return fn(*a)  # type: ignore[operator]

    got = asyncio.run(
        hold_lease(
            LeaseTarget(Coord(), RuntimeError, run, "ns", "l", "m"),
            "me",
            1,
            10.0,
            lambda: order.append("fenced"),
        )
    )
    assert got == (False, 0) and order == ["fenced", "write"]


# ---------------------------------------------------------------------------- release on stop


def test_only_the_holder_releases() -> None:
    from warmserve_operator.leader import released

    mine = LeaseRecord("me", 5.0, 10.0, 3, "other", "7")
    assert released(mine, "me") == LeaseRecord("", 5.0, 10.0, 3, "", "7")
    assert released(replace(mine, holder="other"), "me") is None
    assert released(replace(mine, holder=""), "me") is None
    assert released(None, "me") is None


@pytest.mark.parametrize("outcome", ["ok", "fails", "hangs"])
def test_a_clean_stop_fences_then_releases_a_held_lease(
    outcome: str, caplog: pytest.LogCaptureFixture
) -> None:
    """client-go's ReleaseOnCancel: on stop the leader stops acting first, then empties the
    Lease (best effort, bounded by one retry period); a replica that does not hold it writes
    nothing."""
    calls: list[bool] = []

    async def go(holds: bool) -> None:
        e: Elector

        async def round_() -> bool:
            return holds

        async def release() -> None:
            calls.append(e.leading())  # the fence is already down when the write goes out
            if outcome == "fails":
                raise RuntimeError("etcd down")
            if outcome == "hangs":
                await asyncio.sleep(3600)

        e = Elector(round_, ElectionTiming(1, 0.5, 0.05), release_=release)
        stop = asyncio.Event()
        task = asyncio.create_task(e.run(stop))
        await asyncio.sleep(0.12)
        assert e.leading() is holds
        stop.set()
        await asyncio.wait_for(task, 1.0)  # a hanging release is cut at one retry period
        assert not e.leading()

    with caplog.at_level("INFO", logger="warmserve.operator"):
        asyncio.run(go(holds=True))
        asyncio.run(go(holds=False))
    assert calls == [False]
    logged = [r.getMessage() for r in caplog.records if "lease_release" in r.getMessage()]
    assert logged == (
        ["event=lease_released"]
        if outcome == "ok"
        else [m for m in logged if m.startswith("event=lease_release_failed")]
    ) and len(logged) == 1


# ---------------------------------------------------------------------------- fencing tokens


def test_every_new_term_increments_lease_transitions() -> None:
    """The token of a term is the Lease's leaseTransitions: a renewal, a hand-over request and a
    release keep it; anything that makes a replica the holder of a Lease that was not live and
    its own increments it (a re-acquire by the same holder after losing it included)."""
    d = 10.0
    lead, w = next_lease(None, "a", 1, 100.0, d)
    assert lead and w is not None and w.transitions == 1
    lead, w = next_lease(w, "a", 1, 105.0, d)
    assert lead and w is not None and w.transitions == 1, "a renewal keeps the term"
    lead, asked = next_lease(w, "b", 5, 106.0, d)
    assert not lead and asked is not None and asked.transitions == 1
    lead, gone = next_lease(asked, "a", 1, 107.0, d)
    assert not lead and gone is not None and gone.holder == "" and gone.transitions == 1
    lead, back = next_lease(gone, "a", 1, 107.5, d)
    assert lead and back is not None and back.transitions == 2, "re-acquired after a release"
    lead, same = next_lease(back, "a", 1, 200.0, d)
    assert lead and same is not None and same.transitions == 3, "re-acquired after expiry"
    lead, other = next_lease(same, "b", 1, 300.0, d)
    assert lead and other is not None and other.holder == "b" and other.transitions == 4


def test_a_recreated_lease_starts_above_every_token_of_the_old_one() -> None:
    """The token is (creationTimestamp, leaseTransitions): a Lease deleted and created again (a
    reinstall) does not restart at 1 below what the agents remember."""
    from warmserve_operator.lease import fencing_token

    old = LeaseRecord("a", 100.0, 10.0, transitions=1000, created_s=1_700_000_000)
    lead, w = next_lease(old, "b", 1, 200.0, 10.0)
    assert lead and w is not None and w.created_s == old.created_s and w.token == old.token + 1
    renewed = next_lease(replace(w, resource_version="9"), "b", 1, 201.0, 10.0)[1]
    assert renewed is not None and renewed.token == w.token, "a renewal keeps the token"
    again = replace(next_lease(None, "a", 1, 300.0, 10.0)[1], created_s=old.created_s + 1)
    assert again.transitions == 1 and again.token > w.token
    assert fencing_token(0, 5) == 5 and fencing_token(1, 0) == 2**32
    with pytest.raises(ValueError, match="no fencing token"):
        fencing_token(1, 2**32)


def test_the_elector_carries_its_terms_token_and_a_refusal_of_it_ends_the_term(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    answers: list[tuple[bool | None, int]] = [(True, 3), (True, 3), (True, 5)]
    changes: list[tuple[bool, str]] = []

    async def round_() -> tuple[bool | None, int]:
        return answers.pop(0)

    e = Elector(round_, ElectionTiming(4, 3, 1), clock)
    e.on_change = lambda lead, why: changes.append((lead, why))

    async def go() -> None:
        assert e.token() == 0  # never led: an unfenced caller
        await e.run_round()
        assert e.leading() and e.token() == 3
        e.refused(2)  # a call of an earlier term of ours: nothing to do
        assert e.leading() and changes == [(True, "acquired")]
        e.refused(3)  # the agent has seen a newer term: another replica leads
        assert not e.leading() and e.token() == 3
        assert changes == [(True, "acquired"), (False, "fenced_by_agent")]
        await e.run_round()  # the Lease still says us (the next round decides)
        assert e.leading()
        clock.t += 10  # paused past the Lease; nobody took it: a new term, the same leader
        await e.run_round()
        assert e.leading() and e.token() == 5

    with caplog.at_level("INFO", logger="warmserve.operator"):
        asyncio.run(go())
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("event=leadership_lost reason=fenced_by_agent") for m in logged)
    assert "event=stale_call_fenced token=2 current=3" in logged
    assert "event=leadership_acquired lease_s=4 fencing_token=3" in logged


def test_a_fenced_refusal_reaches_the_elector_through_the_grpc_port() -> None:
    """GrpcAgent sends the Elector's token and reports the agent's refusal of it back."""
    import grpc
    from warmserve_operator.agents import AgentAuth, GrpcAgent
    from warmserve_operator.snapshot import AgentCallError

    from warmserve.api.agent.client import AgentError

    sent: list[int] = []
    refused: list[int] = []

    class Term:
        def token(self) -> int:
            return 7

        def refused(self, token: int) -> None:
            refused.append(token)

    async def evict(slot_id: str, *, request_id: str, fencing_token: int) -> None:
        sent.append(fencing_token)
        code = grpc.StatusCode.FAILED_PRECONDITION
        if slot_id == "fenced":
            raise AgentError(code, "fenced: Evict carries fencing token 7, but ...")
        raise AgentError(code, "slot is serving; end the instance first")

    async def go() -> None:
        agent = GrpcAgent("n1", "127.0.0.1:1", AgentAuth(), Term())  # no connection is made
        agent._client.evict = evict  # type: ignore[method-assign]
        for slot, fenced in (("fenced", True), ("other", False)):
            with pytest.raises(AgentCallError) as info:
                await agent.evict(slot, "r1")
            assert info.value.fenced is fenced
        await agent.close()

    asyncio.run(go())
    assert sent == [7, 7] and refused == [7]
