"""Fencing tokens at the agent (agent/warmserve_agent/fencing.py): the pure rule, its
persistence across agent restarts, and the servicer applying it before any mutation.

The same refusals through the operator's port, against the real agent and the unit tests'
fake, are contract cases in tests/operator/test_agent_contract.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_agent.config import ConfigError
from warmserve_agent.fencing import MAX_TOKEN, Bounds, Fence, FenceError, Refused, admit, split
from warmserve_agent.testing import AgentThread

from tests.agent.agent_support import cfg_for
from warmserve.api.agent.client import AgentClient, AgentError

NOW = 1_750_000_000  # the agent's clock in the pure rule's tests (unix seconds)
BOUNDS = Bounds()
J = BOUNDS.max_term_jump


def token_of(created_s: int, term: int) -> int:
    """What the operator sends (warmserve_operator.lease.fencing_token)."""
    from warmserve_operator.lease import fencing_token

    return fencing_token(created_s, term)


# Tokens of a few Leases around NOW (the agent's clock), some far in the future, terms small and
# huge, and any uint64 at all.
created = st.sampled_from([0, NOW - 86_400, NOW - 5, NOW + 299, NOW + 301, 2**32 - 1])
terms = st.one_of(st.integers(0, 3 * J), st.sampled_from([2**32 - 1, 2**31]))
tokens = st.one_of(
    st.just(0),
    st.builds(token_of, created, terms),
    st.integers(1, 20),
    st.integers(0, MAX_TOKEN),
)


def plausible(highest: int, token: int, now: float = NOW) -> bool:
    """The bounds, restated: not from a Lease created in the future, no jump of more than J
    terms within one Lease."""
    c, t = split(token)
    hc, ht = split(highest)
    return c <= now + BOUNDS.max_skew_s and not (c == hc and t - ht > J)


@given(st.lists(st.tuples(tokens, st.booleans()), max_size=60))
@settings(max_examples=400, deadline=None)
def test_the_rule_is_monotonic_refuses_lower_accepts_equal_and_bounds_a_rise(
    calls: list[tuple[int, bool]],
) -> None:
    highest = 0
    accepted: list[int] = []
    for token, require in calls:
        v = admit(highest, token, NOW, require)
        assert v.highest >= highest, "the fence never goes down"
        if token == 0:
            assert v.highest == highest, "an unfenced call never moves the fence"
            assert v.refused is (Refused.UNFENCED if require else None)
        elif token < highest:
            assert v.refused is Refused.STALE and v.highest == highest
        elif token == highest:
            assert v.accepted and v.highest == token
        elif plausible(highest, token):
            assert v.accepted and v.highest == token
            accepted.append(token)
        else:  # a rise no real Lease can make: refused, the fence stays
            assert v.refused in (Refused.FUTURE, Refused.JUMP) and v.highest == highest
        highest = v.highest
        # Whatever was sent, the fence is a term a Lease created by now could carry.
        assert split(highest)[0] <= NOW + BOUNDS.max_skew_s
    assert highest == max(accepted, default=0)
    assert accepted == sorted(accepted), "accepted tokens never go down"


@given(
    st.integers(NOW - 10 * 86_400, NOW),  # the real Lease's creation time
    st.lists(st.integers(0, J), max_size=40),  # leader changes between calls an agent sees
    st.lists(st.builds(token_of, created, terms), max_size=5),  # forced tokens, in between
)
@settings(max_examples=300, deadline=None)
def test_the_operators_real_terms_pass_unless_a_plausible_term_overtook_them(
    lease_created: int, gaps: list[int], forced: list[int]
) -> None:
    """A real Lease's terms rise by at most J between the calls an agent sees: all accepted
    while only real terms raised the fence.  Forced tokens in between can only raise it to a
    plausible term; a real term refused after one is ``stale`` or ``jump`` (a reset-fence
    case), and the fence is never a term no Lease created by now can carry."""
    highest, term, last_real = 0, 1, 0
    for i, gap in enumerate(gaps):
        term = min(term + gap, 2**32 - 1)
        real = token_of(lease_created, term)
        if i < len(forced):
            highest = admit(highest, forced[i], NOW).highest
        v = admit(highest, real, NOW)
        if highest in (0, last_real):  # no forced token moved the fence
            assert v.accepted, (highest, real)
        else:
            assert v.accepted or v.refused in (Refused.STALE, Refused.JUMP)
        assert split(v.highest)[0] <= NOW + BOUNDS.max_skew_s
        if v.accepted:
            last_real = real
        highest = v.highest


def test_the_rule_refuses_what_is_not_a_uint64_and_the_maximum() -> None:
    for bad in (-1, MAX_TOKEN + 1):
        with pytest.raises(ValueError, match="uint64"):
            admit(0, bad, NOW)
    assert admit(5, 5, NOW).accepted and not admit(5, 4, NOW).accepted
    assert admit(5, 6, NOW).highest == 6
    real = token_of(NOW - 3600, 7)
    for forced in (MAX_TOKEN, token_of(NOW + 86_400, 1), token_of(2**32 - 1, 0)):
        assert admit(real, forced, NOW).refused is Refused.FUTURE
    assert admit(real, token_of(NOW - 3600, 7 + J + 1), NOW).refused is Refused.JUMP
    assert admit(real, token_of(NOW - 3600, 7 + J), NOW).accepted
    assert admit(real, token_of(NOW + 300, 2**32 - 1), NOW).accepted  # a newer Lease, in skew
    with pytest.raises(ValueError, match="max_term_jump"):
        Bounds(max_term_jump=0)


def test_the_fence_survives_a_restart_and_a_bad_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "fence.json"
    f = Fence(path)
    assert f.highest == 0 and not path.exists()
    assert f.check("Evict", 7).accepted
    assert json.loads(path.read_text())["highest_token"] == 7
    assert f.check("Evict", 0).accepted and f.check("Evict", 7).accepted
    again = Fence(path)  # the agent restarted
    assert again.highest == 7 and not again.check("Activate", 6).accepted
    assert again.refused == {("Activate", "stale"): 1}
    path.write_text("{not json")
    with pytest.raises(FenceError, match=r"fencing file .* is unreadable"):
        Fence(path)
    path.write_text(json.dumps({"highest_token": -3}))
    with pytest.raises(FenceError, match="uint64"):
        Fence(path)


def test_a_fence_it_cannot_write_still_holds_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")  # writing under it fails, also for root (a read-only store)
    f = Fence(not_a_dir / "fence.json")
    with caplog.at_level(logging.ERROR, logger="warmserve.agent.fencing"):
        assert f.check("Evict", 3).accepted
    assert f.highest == 3 and not f.check("Evict", 2).accepted
    assert any("event=fence_persist_failed" in r.getMessage() for r in caplog.records)


def _metric(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name)]


def test_the_agent_refuses_a_deposed_leader_across_a_restart(
    tmp_path: Path, model_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The servicer checks the token before any mutation, logs ``event=call_fenced``, counts
    it in ``warmserve_agent_fenced_calls_total``; a restarted agent remembers the fence."""
    from prometheus_client import CollectorRegistry, generate_latest
    from warmserve_agent.metrics import AgentCollector

    fence_file = tmp_path / "fence.json"

    async def as_new_leader(c: AgentClient) -> str:
        await c.describe(fencing_token=9)  # raises the fence before deciding
        msg = await c.prewarm_wait("alpha", [0], 0, request_id="p1", fencing_token=9)
        return msg.slot.slot_id

    async def as_old_leader(c: AgentClient, slot_id: str) -> list[str]:
        out = []
        for call in (
            lambda: c.evict(slot_id, request_id="e1", fencing_token=8),
            lambda: c.activate("beta", [1], request_id="a1", fencing_token=8),
            lambda: c.prewarm_wait("beta", [1], 0, request_id="p2", fencing_token=8),
        ):
            with pytest.raises(AgentError) as info:
                await call()
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            out.append(info.value.message)
        return out

    cfg = cfg_for(tmp_path, model_root, fencing_file=fence_file)
    with AgentThread(cfg) as a, caplog.at_level(logging.INFO, logger="warmserve.agent.fencing"):

        async def first() -> tuple[list[str], int]:
            async with AgentClient(a.address) as c:
                sid = await as_new_leader(c)
                msgs = await as_old_leader(c, sid)
                return msgs, len((await c.describe()).slots)

        msgs, slots = a.run(first())
        assert slots == 1, "the refused calls changed nothing"
        assert all(m.startswith("fenced:") and "token 8" in m and "token 9" in m for m in msgs)
        reg = CollectorRegistry()
        reg.register(AgentCollector(a.server.core, fence=a.server.fence))
        text = generate_latest(reg).decode()
        assert 'warmserve_agent_fencing_token{node="node-a"} 9.0' in text
        fenced = _metric(text, "warmserve_agent_fenced_calls_total")
        assert sorted(fenced) == [
            f'warmserve_agent_fenced_calls_total{{method="{m}",node="node-a",reason="stale"}} 1.0'
            for m in ("Activate", "Evict", "Prewarm")
        ], fenced
    logged = [r.getMessage() for r in caplog.records]
    assert "event=call_fenced method=Evict token=8 highest=9 reason=stale" in logged
    assert any(m.startswith("event=fence_raised method=Describe token=9") for m in logged)
    assert json.loads(fence_file.read_text())["highest_token"] == 9

    cfg2 = cfg_for(tmp_path, model_root, fencing_file=fence_file)
    with AgentThread(cfg2) as a:  # a restarted agent: the stale leader is still refused

        async def after_restart() -> None:
            async with AgentClient(a.address) as c:
                with pytest.raises(AgentError, match="token 9"):
                    await c.prewarm_wait("alpha", [0], 0, request_id="p3", fencing_token=8)
                await c.prewarm_wait("alpha", [0], 0, request_id="p4", fencing_token=9)

        a.run(after_restart())


def test_require_fencing_token_refuses_unfenced_mutations_only(
    tmp_path: Path, model_root: Path
) -> None:
    cfg = cfg_for(tmp_path, model_root, require_fencing_token=True)
    with AgentThread(cfg) as a:

        async def go() -> None:
            async with AgentClient(a.address) as c:
                await c.describe()  # reads stay open to the CLI
                with pytest.raises(AgentError, match="carries no fencing_token") as info:
                    await c.prewarm_wait("alpha", [0], 0, request_id="p1")
                assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
                await c.prewarm_wait("alpha", [0], 0, request_id="p2", fencing_token=1)

        a.run(go())


def test_an_unreadable_fencing_file_stops_the_agent_with_one_line(
    tmp_path: Path, model_root: Path
) -> None:
    bad = tmp_path / "fence.json"
    bad.write_text("garbage")
    with pytest.raises(ConfigError, match="fencing file"):
        AgentThread(cfg_for(tmp_path, model_root, fencing_file=bad)).__enter__()


def test_the_cli_flags_reach_the_config(tmp_path: Path) -> None:
    import argparse

    from warmserve_agent.cli import register
    from warmserve_agent.cli.run import _config

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    base = ["agent", "--gpus", "auto", "--model-dir", str(tmp_path)]
    cfg = _config(ap.parse_args(base))
    assert cfg.fencing_path == tmp_path / ".warmserve-fencing.json"
    assert not cfg.require_fencing_token
    flags = ["--fencing-file", str(tmp_path / "f.json"), "--require-fencing-token"]
    cfg = _config(ap.parse_args([*base, *flags]))
    assert cfg.fencing_path == tmp_path / "f.json" and cfg.require_fencing_token
