"""Agent hardening: slow Watch clients, stale /dev/shm directories after ``kill -9``,
error messages that echo unbounded input, and an unauthenticated API on a reachable address."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from warmserve_agent.config import AgentConfig, ConfigError
from warmserve_agent.shm import MemoryDir, remove_stale
from warmserve_agent.testing import AgentThread

from tests.agent.agent_support import cfg_for as agent_cfg
from tests.agent.agent_support import wait_for
from warmserve.api.agent.client import AgentError, SyncAgentClient, pb
from warmserve.api.agent.v1 import agent_pb2_grpc as pb_grpc


def cfg_for(tmp_path: Path, model_root: Path, **kw) -> AgentConfig:
    return agent_cfg(tmp_path, model_root, **{"node_name": "node-h", **kw})


# ---- Watch: stalled clients are bounded and dropped --------------------------------------------
def test_stalled_watch_clients_are_bounded_and_dropped(tmp_path: Path, model_root: Path) -> None:
    cfg = cfg_for(tmp_path, model_root, watch_queue_max=64, watch_write_timeout_s=2.0)
    n_events = 3000
    with AgentThread(cfg) as a:
        svc = a.server.service
        got: list[int] = []

        def healthy() -> None:
            with grpc.insecure_channel(a.address) as ch:
                for ev in pb_grpc.NodeAgentStub(ch).Watch(pb.WatchRequest()):
                    got.append(ev.generation)
                    if len(got) == n_events:
                        return

        reader = threading.Thread(target=healthy, daemon=True)
        reader.start()
        wait_for(lambda: svc.watcher_count == 1, what="the healthy watcher")
        # 20 clients that open a Watch and never read it (each on its own connection).  Without
        # BDP probing their receive window stays at 64 KiB, so the server sees them stall after
        # a few hundred events instead of after megabytes.
        opts = [("grpc.http2.bdp_probe", 0)]
        channels = [grpc.insecure_channel(a.address, options=opts) for _ in range(20)]
        stalled = [pb_grpc.NodeAgentStub(ch).Watch(pb.WatchRequest()) for ch in channels]
        wait_for(lambda: svc.watcher_count == 21, what="the stalled watchers to subscribe")
        peak = 0
        for i in range(n_events):
            a.server.core.emit("gpu", str(i % 2), "load test")
            if i % 32 == 31:  # a steady event rate the healthy client keeps up with
                peak = max(peak, a.run(_queued(svc)))
                wait_for(lambda i=i: len(got) > i - 32, what="the healthy watcher to keep up")
        # Memory is bounded by the queues: never more than max_watch_queue per watcher.
        assert peak <= 64 * 21
        reader.join(60)
        assert len(got) == n_events, f"the healthy watcher got {len(got)} of {n_events} events"
        assert got == list(range(got[0], got[0] + n_events)), "events lost or out of order"
        wait_for(lambda: svc.watcher_count == 0, 30, "stalled watchers to be dropped")
        assert svc.watchers_dropped == 20
        assert a.run(_queued(svc)) == 0
        # A stalled client that finally reads learns why its stream ended.
        with pytest.raises(grpc.RpcError) as ei:
            for _ in stalled[0]:
                pass
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Watch again with include_snapshot" in ei.value.details()
        with SyncAgentClient(a.address) as c:
            assert c.describe().node_name == "node-h"  # still answering
        for ch in channels:
            ch.close()


async def _queued(svc) -> int:
    return svc.queued_events()


# ---- /dev/shm after kill -9 ----------------------------------------------------------------------
def _start_cli_agent(model_root: Path, root: Path, node: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmserve", "agent", "--simulate-gpus", "2x4MiB",
         "--page-size", "64KiB", "--model-dir", str(model_root), "--listen", "127.0.0.1:0",
         "--memory-root", str(root), "--node-name", node, "--spare-workers", "0",
         "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    m = re.search(r"serving on (\S+) ", line)
    assert m, f"agent did not start: {line!r} {proc.stderr.read() if proc.poll() else ''}"
    return proc, m.group(1)


def test_a_killed_agents_shm_directory_is_removed_by_the_next_agent(
    tmp_path: Path, model_root: Path
) -> None:
    root = tmp_path / "shm"
    proc, addr = _start_cli_agent(model_root, root, "dead")
    try:
        with SyncAgentClient(addr) as c:
            c.prewarm_wait("alpha", [0, 1])
        (dead,) = root.glob("warmserve-dead-*")
        assert (dead / "gpu0.mem").stat().st_blocks > 0  # it holds memory
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert dead.exists(), "kill -9 leaves the directory behind (what the cleanup is for)"
    cfg = dict(memory_dir=None, memory_root=root)
    with AgentThread(cfg_for(tmp_path, model_root, node_name="live", **cfg)):
        assert not dead.exists(), "the next agent removes a dead agent's directory"
        (live,) = root.glob("warmserve-live-*")
        # A second agent on the same root leaves the first (live) one's directory alone.
        with AgentThread(cfg_for(tmp_path, model_root, node_name="other", **cfg)):
            assert live.exists()
    assert list(root.iterdir()) == [], "clean stops leave nothing behind"


def test_memory_dir_ownership(tmp_path: Path, model_root: Path) -> None:
    d = tmp_path / "explicit"
    first = MemoryDir.claim(d)
    (d / "gpu0.mem").write_bytes(b"x" * 100)
    with pytest.raises(ConfigError, match="in use by another agent"):
        AgentThread(cfg_for(tmp_path, model_root, memory_dir=d)).__enter__()
    assert remove_stale(tmp_path) == []  # not a warmserve-* dir; and held anyway
    first.release()
    # The dead owner's files are not reused by the next owner.
    again = MemoryDir.claim(d)
    assert not (d / "gpu0.mem").exists()
    again.release()
    assert not d.exists()
    # Legacy directories without a lock file go once they are older than the grace period.
    old = tmp_path / "warmserve-old-1234"
    old.mkdir()
    (old / "gpu0.mem").write_bytes(b"y")
    assert remove_stale(tmp_path, grace_s=3600) == []
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert remove_stale(tmp_path, grace_s=3600) == [old] and not old.exists()
    # Another program's directory that only shares the prefix (a test control plane's etcd data
    # was once /dev/shm/warmserve-etcd.*) is never removed, however old.
    other = tmp_path / "warmserve-etcd.x1y2"
    (other / "member" / "snap").mkdir(parents=True)
    (other / "member" / "snap" / "db").write_bytes(b"etcd")
    os.utime(other, (time.time() - 7200, time.time() - 7200))
    assert remove_stale(tmp_path, grace_s=3600) == []
    assert (other / "member" / "snap" / "db").exists()


# ---- error messages ------------------------------------------------------------------------------
def test_error_messages_do_not_echo_unbounded_input(tmp_path: Path, model_root: Path) -> None:
    def err(fn) -> AgentError:
        with pytest.raises(AgentError) as ei:
            fn()
        msg = ei.value.message
        assert len(msg) <= 1024, len(msg)
        assert msg.isprintable(), repr(msg[:200])
        return ei.value

    with AgentThread(cfg_for(tmp_path, model_root)) as a, SyncAgentClient(a.address) as c:
        e = err(lambda: c.prewarm_wait("m" * 100_000, [0]))
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "(100000 chars)" in e.message
        e = err(lambda: c.prewarm_wait("\x1b[31mred\x1b[0m\n", [0]))
        assert "\\x1b[31m" in e.message  # shown escaped, not interpreted by a terminal
        e = err(lambda: c.prewarm_wait("alpha", list(range(100, 50_100))))
        assert "(50000 in all)" in e.message
        e = err(lambda: c.evict("slot-" + "a" * 200_000))
        assert "malformed slot id" in e.message
        e = err(lambda: c.end_instance("inst-\u202e" + "b" * 100_000))
        assert "malformed instance id" in e.message
        err(lambda: c.prewarm_wait("q" * 5000, [0], request_id="same-1"))
        e = err(lambda: c.prewarm_wait("r" * 5000, [1], request_id="same-1"))
        assert e.code == grpc.StatusCode.ALREADY_EXISTS
        # a store with many models names a few of them, not all
        for i in range(30):
            (model_root / f"extra-{i:02d}").mkdir()
            (model_root / f"extra-{i:02d}" / "config.json").write_text("{}")
        e = err(lambda: c.prewarm_wait("missing", [0]))
        assert e.code == grpc.StatusCode.NOT_FOUND and "in all)" in e.message


# ---- an unauthenticated API on a reachable address -----------------------------------------------
def test_unauthenticated_api_on_a_reachable_address(
    tmp_path: Path, model_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match=r"refusing to serve the agent API on 0\.0\.0\.0:0"):
        AgentThread(cfg_for(tmp_path, model_root, listen="0.0.0.0:0")).__enter__()
    with caplog.at_level(logging.WARNING, "warmserve.agent"):
        cfg = cfg_for(tmp_path, model_root, listen="0.0.0.0:0", allow_insecure_listen=True)
        with AgentThread(cfg) as a:
            port = a.server.port
            with SyncAgentClient(f"127.0.0.1:{port}") as c:
                assert c.describe().node_name == "node-h"
    assert "event=insecure_listen" in caplog.text and "WITHOUT authentication" in caplog.text
    tok = tmp_path / "token"
    tok.write_text("t0k\n")
    caplog.clear()
    tok_cfg = cfg_for(tmp_path, model_root, listen="0.0.0.0:0", token_file=tok)
    with caplog.at_level(logging.WARNING, "warmserve.agent"), AgentThread(tok_cfg):
        pass
    assert "event=plaintext_token" in caplog.text
    # Loopback needs nothing (tests, a sidecar); [::1] and localhost count as loopback.
    for listen in ("127.0.0.1:0", "[::1]:0", "localhost:0"):
        with AgentThread(cfg_for(tmp_path, model_root, listen=listen)):
            pass
