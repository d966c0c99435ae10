"""An implausible fencing token is refused over real gRPC and never persisted, and an admin
recovers a fenced agent with ``warmserve agent reset-fence`` (agent/warmserve_agent/fencing.py;
docs/security.md, "Recovering a fenced agent").  The pure rule's properties are in
test_agent_fencing.py; tokens here are built as the operator builds them.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from warmserve_agent.testing import AgentThread
from warmserve_operator.lease import fencing_token as token_of

from tests.agent.agent_support import cfg_for
from warmserve.api.agent.client import AgentClient, AgentError

MAX_TOKEN = 2**64 - 1  # the uint64 maximum on the wire
J = 1024  # the agent's default --fencing-max-term-jump


def test_a_forced_maximum_is_refused_not_persisted_and_the_real_term_survives_a_restart(
    tmp_path: Path, model_root: Path
) -> None:
    """Any caller could send 2**64-1: the agent persisted it and refused the operator's real
    term for good, also after a restart.  Now a token no Lease can carry is refused (not as
    ``fenced:``, so the operator does not step down) and never reaches the file."""
    from warmserve_operator.snapshot import AgentCallError

    fence_file = tmp_path / "fence.json"
    now = int(time.time())
    real = token_of(now - 3600, 3)
    forced = {
        "maximum": MAX_TOKEN,
        "far future": token_of(now + 86_400, 1),
        "term jump": token_of(now - 3600, 3 + J + 1),
    }

    async def attempts(c: AgentClient) -> dict[str, str]:
        await c.describe(fencing_token=real)
        out = {}
        for what, token in forced.items():
            with pytest.raises(AgentError) as info:
                await c.prewarm_wait("alpha", [0], 0, request_id=f"p-{token}", fencing_token=token)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            out[what] = info.value.message
        await c.prewarm_wait("alpha", [0], 0, request_id="p-real", fencing_token=real)
        return out

    cfg = cfg_for(tmp_path, model_root, fencing_file=fence_file, require_fencing_token=True)
    with AgentThread(cfg) as a:

        async def first() -> dict[str, str]:
            async with AgentClient(a.address) as c:
                return await attempts(c)

        msgs = a.run(first())
        assert a.server.fence.highest == real
        assert a.server.fence.refused == {("Prewarm", "future"): 2, ("Prewarm", "jump"): 1}
    for what, msg in msgs.items():
        assert msg.startswith(f"implausible fencing token {forced[what]}"), msg
        assert not AgentCallError("FAILED_PRECONDITION", msg).fenced, "the leader stays"
        assert "reset-fence" in msg
    assert "past this agent's clock" in msgs["maximum"] and "--fencing-max-skew" in msgs["maximum"]
    assert f"past the fence {real}" in msgs["term jump"]
    assert json.loads(fence_file.read_text())["highest_token"] == real, "never persisted"

    with AgentThread(cfg_for(tmp_path, model_root, fencing_file=fence_file)) as a:

        async def after_restart() -> None:
            async with AgentClient(a.address) as c:
                await attempts(c)  # the real term acts again after the refusals

        a.run(after_restart())
        assert a.server.fence.highest == real


def _reset_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "warmserve", "agent", "reset-fence", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_admin_resets_a_fenced_agent_while_it_runs(
    tmp_path: Path, model_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plausible but wrong term (a Lease deleted since, another install's operator) raised
    the fence above the real leader's: the admin runs ``warmserve agent reset-fence`` on the
    node; the running agent takes it at its next call, logs and counts it."""
    from prometheus_client import CollectorRegistry, generate_latest
    from warmserve_agent.metrics import AgentCollector

    fence_file = tmp_path / "fence.json"
    now = int(time.time())
    real, wrong = token_of(now - 3600, 5), token_of(now - 60, 1)
    cfg = cfg_for(tmp_path, model_root, fencing_file=fence_file)
    with AgentThread(cfg) as a, caplog.at_level(logging.INFO, logger="warmserve.agent.fencing"):

        async def call(token: int) -> None:
            async with AgentClient(a.address) as c:
                await c.describe(fencing_token=token)

        a.run(call(real))
        a.run(call(wrong))
        with pytest.raises(AgentError, match=f"fenced: .* token {real}, .* seen token {wrong}"):
            a.run(call(real))

        bad = _reset_cli("--fencing-file", str(fence_file), "--to", str(MAX_TOKEN), "--reason", "x")
        assert bad.returncode == 2 and "lies in the future" in bad.stderr, bad.stderr
        assert _reset_cli("--fencing-file", str(fence_file)).returncode == 2  # --reason required
        assert json.loads(fence_file.read_text())["highest_token"] == wrong

        done = _reset_cli("--fencing-file", str(fence_file), "--reason", "Lease recreated")
        assert done.returncode == 0, done.stderr
        assert f"reset: {wrong} -> 0 by " in done.stdout
        assert "event=fence_reset_written" in done.stderr and "Lease recreated" in done.stderr
        record = json.loads(fence_file.read_text())
        assert record["highest_token"] == 0
        assert record["reset"]["previous"] == wrong
        assert record["reset"]["reason"] == "Lease recreated"

        a.run(call(real))  # the operator's real term is accepted again, and raises the fence
        assert a.server.fence.highest == real
        reg = CollectorRegistry()
        reg.register(AgentCollector(a.server.core, fence=a.server.fence))
        text = generate_latest(reg).decode()
        assert 'warmserve_agent_fence_resets_total{node="node-a"} 1.0' in text
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"event=fence_reset path={fence_file} previous={wrong} highest=0")
               for m in logged), logged
    assert json.loads(fence_file.read_text())["highest_token"] == real
    with AgentThread(cfg_for(tmp_path, model_root, fencing_file=fence_file)) as a:
        assert a.server.fence.highest == real  # what the reset led to outlives a restart


def test_reset_fence_refuses_a_bad_place(tmp_path: Path) -> None:
    missing = _reset_cli("--model-dir", str(tmp_path / "nope"), "--reason", "r")
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    done = _reset_cli("--model-dir", str(tmp_path), "--reason", "first install")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / ".warmserve-fencing.json").read_text())["reset"]["previous"] == 0
