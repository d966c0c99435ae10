"""The agent over gRPC on loopback: the end-to-end flow, bad requests, idempotency, streams,
auth, worker replacement and restart behaviour."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from warmserve_agent.testing import AgentThread, write_model

from tests.agent.agent_support import MiB, cfg_for, wait_for
from tests.tls_support import warmserve_pki
from warmserve.api.agent.client import AgentError, SyncAgentClient, pb


def http(url: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return r.read()


@pytest.fixture
def fast_agent(tmp_path: Path, model_root: Path) -> Iterator[tuple[AgentThread, SyncAgentClient]]:
    """Agent with engines in-process (no worker processes): for the refusal tests."""
    with AgentThread(cfg_for(tmp_path, model_root)) as a:
        c = SyncAgentClient(a.address)
        yield a, c
        c.close()


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(AgentError) as ei:
        fn()
    return ei.value.code, ei.value.message


# ---- the done-criterion flow, with real worker processes --------------------------------------
@pytest.mark.parametrize("memory_in_workers", [False, True], ids=["agent-memory", "worker-memory"])
def test_loopback_prewarm_activate_stream_grace_lend_end(
    tmp_path: Path, model_root: Path, memory_in_workers: bool
) -> None:
    cfg = cfg_for(tmp_path, model_root, use_workers=True, memory_in_workers=memory_in_workers)
    with AgentThread(cfg) as a:
        owner = type(a.server.core.mm.backend).__name__
        assert owner == ("WorkerMemoryBackend" if memory_in_workers else "SimulatedBackend")
        c = SyncAgentClient(a.address)
        assert c.health() == "SERVING"
        d = c.describe()
        assert [g.state for g in d.gpus] == [pb.WORKER_STATE_IDLE] * 2
        assert d.spare_workers == 1 and all(g.worker_pid > 0 for g in d.gpus)
        assert {m.name for m in d.models} == {"alpha", "beta", "gamma"}

        msgs = list(c.prewarm("alpha", [0], 2, request_id="pw-alpha"))
        assert msgs[-1].done and msgs[-1].layers_loaded == 2 and msgs[-1].layers_target == 2
        assert msgs[-1].slot.layers_total == 4 and msgs[-1].bandwidth_bytes_per_s > 0
        slot_alpha = msgs[-1].slot_id

        act = c.activate("alpha", [0], request_id="act-alpha")
        assert act.prewarm_hit and act.instance.slot_id == slot_alpha
        ep = act.instance.endpoint
        assert ep.startswith("http://127.0.0.1:")
        # The engine runs in GPU 0's worker process, not in the agent.
        assert json.loads(http(ep + "/v1/models"))["data"][0]["id"] == "alpha"
        body = {"model": "alpha", "prompt": "hello warm world", "max_tokens": 6, "stream": True}
        raw = http(ep + "/v1/completions", body).decode()
        events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert len([p for p in pieces if p]) == 6
        chat = json.loads(
            http(ep + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        )
        assert chat["choices"][0]["message"]["role"] == "assistant"
        metrics = http(ep + "/metrics").decode()
        assert 'vllm:num_requests_running{model_name="alpha"}' in metrics
        assert "vllm:generation_tokens_total" in metrics
        # The remaining layers of the partial prewarm load while the instance serves.
        wait_for(
            lambda: c.describe().instances[0].layers_resident == 4, what="rest of alpha's layers"
        )

        g = c.begin_grace(act.instance.instance_id, request_id="grace-alpha")
        assert g.instance.phase == pb.INSTANCE_PHASE_GRACE
        lend = c.lendable()
        row = lend.instances[0]
        assert row.reservation_target_bytes < row.kv_capacity_bytes
        assert row.lendable_bytes > 0 and row.lent_bytes > 0
        d = c.describe()
        assert d.gpus[0].state == pb.WORKER_STATE_GRACE and d.gpus[0].free_bytes > 0

        # Prewarm a second model into the lent KV memory (Figure 6b).
        beta = c.prewarm_wait("beta", [0], request_id="pw-beta")
        assert beta.slot.state == pb.SLOT_STATE_READY
        end = c.end_instance(act.instance.instance_id, request_id="end-alpha")
        assert [x.state for x in end.gpus] == [pb.WORKER_STATE_UNIVERSAL]
        assert {s.model for s in end.slots} == {"alpha", "beta"}
        d = c.describe()
        assert d.gpus[0].state == pb.WORKER_STATE_UNIVERSAL and not d.instances
        assert {(s.model, s.layers_resident) for s in d.slots} == {("alpha", 4), ("beta", 3)}
        with pytest.raises(urllib.error.URLError):
            http(ep + "/v1/models")

        # The weights prewarmed into lent memory serve: the worker's engine verifies them.
        act2 = c.activate("beta", [0], request_id="act-beta")
        assert act2.prewarm_hit and act2.evicted_slot_ids == [slot_alpha]
        out = json.loads(http(act2.instance.endpoint + "/v1/completions", {"prompt": "x"}))
        assert out["usage"]["completion_tokens"] == 16
        a.run(asyncio.to_thread(a.server.core.check))  # page tables == each worker's MMU
        c.close()


# ---- bad requests ----------------------------------------------------------------------
def test_bad_requests_get_clear_status(fast_agent) -> None:
    a, c = fast_agent
    code, msg = code_of(lambda: c.prewarm_wait("nope", [0]))
    assert code == grpc.StatusCode.NOT_FOUND and "models here: alpha, beta, gamma" in msg
    code, msg = code_of(lambda: c.prewarm_wait("alpha", [0, 7]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not on node node-a" in msg
    code, msg = code_of(lambda: c.prewarm_wait("alpha", []))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at least one GPU" in msg
    code, msg = code_of(lambda: c.prewarm_wait("alpha", [0], layers=9))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1..4" in msg
    code, msg = code_of(lambda: c.prewarm_wait("../x", [0]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed model name" in msg
    code, msg = code_of(lambda: c.evict("slot-zz"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed slot id" in msg
    code, msg = code_of(lambda: c.evict("slot-0123456789ab"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, msg = code_of(lambda: c.begin_grace("i-1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed instance id" in msg
    code, msg = code_of(lambda: c.end_instance("inst-0123456789ab"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, msg = code_of(lambda: c.evict("slot-0123456789ab", request_id="bad id!"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed request_id" in msg

    # Not enough memory: a model larger than one GPU ...
    write_model(Path(a.cfg.model_dir), "big", layers=2, hidden=320, seed=8)
    write_model(Path(a.cfg.model_dir), "big2", layers=2, hidden=320, seed=9)
    code, msg = code_of(lambda: c.prewarm_wait("big", [0]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "per GPU" in msg and "free" in msg
    code, msg = code_of(lambda: c.activate("big", [0]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger tensor-parallel group" in msg
    # ... and a prewarm that would fit an empty GPU but not next to what is resident.
    big = c.prewarm_wait("big", [0], layers=1)
    code, msg = code_of(lambda: c.prewarm_wait("big2", [0], layers=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Evict slots" in msg
    c.evict(big.slot_id)
    assert c.describe().gpus[0].state == pb.WORKER_STATE_IDLE
    # Same model twice on overlapping GPUs.
    c.prewarm_wait("gamma", [1])
    code, msg = code_of(lambda: c.prewarm_wait("gamma", [0, 1]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already resident" in msg
    d = c.describe()
    code, msg = code_of(lambda: c.activate("beta", [1], slot_id=d.slots[0].slot_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "omit slot_id" in msg

    # Illegal transitions.
    act = c.activate("gamma", [1])
    iid = act.instance.instance_id
    code, msg = code_of(lambda: c.end_instance(iid))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "BeginGrace" in msg
    code, msg = code_of(lambda: c.activate("beta", [1]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "serving" in msg
    code, msg = code_of(lambda: c.prewarm_wait("beta", [1]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "grace period" in msg
    code, msg = code_of(lambda: c.evict(act.instance.slot_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "end the instance first" in msg
    code, msg = code_of(lambda: c.lendable([iid]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    c.begin_grace(iid)
    code, msg = code_of(lambda: c.begin_grace(iid))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    c.end_instance(iid, evict_weights=True)
    assert all(s.model != "gamma" for s in c.describe().slots)


def test_overlapping_groups_refused(tmp_path: Path, model_root: Path) -> None:
    with AgentThread(cfg_for(tmp_path, model_root, simulate_gpus=[4 * MiB] * 3)) as a:
        c = SyncAgentClient(a.address)
        c.prewarm_wait("gamma", [0, 1])
        c.prewarm_wait("beta", [1])  # nested: fine
        code, msg = code_of(lambda: c.prewarm_wait("alpha", [1, 2]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "must nest" in msg
        # Activation is different: it takes the group exclusively and evicts every slot that
        # touches it (Fig. 6a), including gamma's on {0,1}; GPU 0 loses its last slot.
        before = {x.model: x.slot_id for x in c.describe().slots}
        act = c.activate("alpha", [1, 2])
        assert sorted(act.evicted_slot_ids) == sorted([before["gamma"], before["beta"]])
        states = [g.state for g in c.describe().gpus]
        assert states == [
            pb.WORKER_STATE_IDLE,
            pb.WORKER_STATE_DEDICATED,
            pb.WORKER_STATE_DEDICATED,
        ]
        c.close()


def test_requests_are_idempotent(fast_agent) -> None:
    _, c = fast_agent
    first = c.prewarm_wait("alpha", [0], request_id="same-1")
    again = c.prewarm_wait("alpha", [0], request_id="same-1")
    assert again.slot_id == first.slot_id and again.done
    assert len(c.describe().slots) == 1
    code, msg = code_of(lambda: c.prewarm_wait("beta", [0], request_id="same-1"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "new id" in msg
    a1 = c.activate("alpha", [0], request_id="act-1")
    a2 = c.activate("alpha", [0], request_id="act-1")
    assert a1.instance.instance_id == a2.instance.instance_id
    assert len(c.describe().instances) == 1
    # A refusal replays as the same refusal.
    e1 = code_of(lambda: c.end_instance(a1.instance.instance_id, request_id="end-1"))
    c.begin_grace(a1.instance.instance_id, request_id="grace-1")
    e2 = code_of(lambda: c.end_instance(a1.instance.instance_id, request_id="end-1"))
    assert e1 == e2 and e1[0] == grpc.StatusCode.FAILED_PRECONDITION
    c.end_instance(a1.instance.instance_id, request_id="end-2")
    assert c.end_instance(a1.instance.instance_id, request_id="end-2").instance_id


def test_watch_streams_changes(fast_agent) -> None:
    a, c = fast_agent
    from warmserve.api.agent.client import AgentClient

    async def watch_some() -> list[pb.WatchEvent]:
        out: list[pb.WatchEvent] = []
        async with AgentClient(a.address) as ac:
            async for ev in ac.watch():
                out.append(ev)
                if ev.kind == pb.WatchEvent.KIND_SLOT and ev.slot.state == pb.SLOT_STATE_READY:
                    break
        return out

    import threading

    box: dict[str, list[pb.WatchEvent]] = {}
    t = threading.Thread(
        target=lambda: box.setdefault("ev", asyncio.run(watch_some())), daemon=True
    )
    t.start()
    wait_for(lambda: a.server.service.watcher_count, what="the watch to subscribe")
    c.prewarm_wait("gamma", [1])
    t.join(20)
    assert "ev" in box, "the watch never saw the slot become ready"
    evs = box["ev"]
    assert evs[0].kind == pb.WatchEvent.KIND_SNAPSHOT and len(evs[0].snapshot.gpus) == 2
    kinds = {e.kind for e in evs}
    assert pb.WatchEvent.KIND_GPU in kinds and pb.WatchEvent.KIND_SLOT in kinds
    gens = [e.generation for e in evs[1:]]
    assert gens == sorted(gens)


# ---- security -----------------------------------------------------------------------------------
def test_token_auth(tmp_path: Path, model_root: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    with AgentThread(cfg_for(tmp_path, model_root, token_file=tok)) as a:
        with SyncAgentClient(a.address) as anon:
            assert anon.health() == "SERVING"  # probes stay open
            code, msg = code_of(anon.describe)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in msg
            code, _ = code_of(lambda: anon.prewarm_wait("alpha", [0]))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        with SyncAgentClient(a.address, token="wrong") as bad:
            assert code_of(bad.describe)[0] == grpc.StatusCode.UNAUTHENTICATED
        with SyncAgentClient(a.address, token_file=tok) as good:
            assert good.describe().node_name == "node-a"


def test_mutual_tls(tmp_path: Path, model_root: Path) -> None:
    # Who may call beyond the chain (identities, usages): tests/agent/test_agent_identity.py.
    pki = warmserve_pki(tmp_path / "pki")
    cfg = cfg_for(
        tmp_path,
        model_root,
        tls_cert=pki.agent.crt,
        tls_key=pki.agent.key,
        client_ca=pki.agent.ca,
    )
    with AgentThread(cfg) as a:
        refused = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        tls = dict(ca_cert=pki.agent.ca, server_name="warmserve-agent", timeout_s=5)
        with SyncAgentClient(a.address, **tls) as nocert:
            assert code_of(nocert.describe)[0] in refused  # handshake fails: no client cert
        with SyncAgentClient(a.address, timeout_s=5) as plain:
            assert code_of(plain.describe)[0] in refused
        with SyncAgentClient(
            a.address, client_cert=pki.operator.crt, client_key=pki.operator.key, **tls
        ) as ok:
            assert ok.describe().gpus[0].index == 0


# ---- failures and restarts ------------------------------------------------------------
def test_crashed_worker_is_replaced(tmp_path: Path, model_root: Path) -> None:
    with AgentThread(cfg_for(tmp_path, model_root, use_workers=True)) as a:
        c = SyncAgentClient(a.address)
        act = c.activate("gamma", [0])
        assert not act.prewarm_hit
        pid = c.describe().gpus[0].worker_pid
        os.kill(pid, 9)
        d = wait_for(
            lambda: (x := c.describe()).gpus[0].worker_restarts == 1 and not x.instances and x,
            what="worker replacement",
        )
        assert d.gpus[0].worker_pid not in (0, pid)
        assert d.gpus[0].state == pb.WORKER_STATE_UNIVERSAL  # gamma's weights stay resident
        assert [s.model for s in d.slots] == ["gamma"]
        wait_for(lambda: c.describe().spare_workers == 1, what="spare refilled")
        act2 = c.activate("gamma", [0])  # served by the replacement worker
        assert act2.prewarm_hit
        assert json.loads(http(act2.instance.endpoint + "/v1/models"))["data"][0]["id"] == "gamma"
        c.close()


def test_a_failed_replacement_is_retried_and_the_monitor_lives_on(
    tmp_path: Path, model_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure while replacing one dead worker must not end the monitor: it is logged, tried
    again at the next tick, and later deaths are still handled."""
    with AgentThread(cfg_for(tmp_path, model_root, use_workers=True)) as a:
        c = SyncAgentClient(a.address)
        pool = a.server.pool
        real_replace, calls = pool.replace, []

        def flaky(g: int) -> Any:
            calls.append(g)
            if len(calls) == 1:
                raise OSError("no spare could be started")
            return real_replace(g)

        pool.replace = flaky
        pid = c.describe().gpus[0].worker_pid
        os.kill(pid, 9)
        wait_for(lambda: c.describe().gpus[0].worker_restarts == 1, what="replacement, retried")
        assert calls[:2] == [0, 0]
        assert any("event=worker_replace_failed gpu=0" in r.getMessage() for r in caplog.records)
        pid1 = c.describe().gpus[1].worker_pid  # the loop still runs: a later death on GPU 1
        os.kill(pid1, 9)
        wait_for(lambda: c.describe().gpus[1].worker_restarts == 1, what="second replacement")
        c.close()


def test_recycled_worker_is_replaced_from_spares(tmp_path: Path, model_root: Path) -> None:
    cfg = cfg_for(tmp_path, model_root, use_workers=True, recycle_workers=True)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        act = c.activate("gamma", [1])
        before = c.describe().gpus[1].worker_pid
        spare_pid = a.server.pool._spares[0].pid
        c.begin_grace(act.instance.instance_id)
        c.end_instance(act.instance.instance_id)
        d = c.describe()
        assert d.gpus[1].worker_pid == spare_pid != before  # the spare took over at once
        assert d.gpus[1].worker_restarts == 1 and d.gpus[0].worker_restarts == 0
        wait_for(lambda: not _alive(before), what="old worker to exit")
        again = c.activate("gamma", [1])
        assert again.prewarm_hit
        assert json.loads(http(again.instance.endpoint + "/v1/models"))["data"][0]["id"] == "gamma"


def test_worker_owned_memory_dies_with_the_worker(tmp_path: Path, model_root: Path) -> None:
    cfg = cfg_for(tmp_path, model_root, use_workers=True, memory_in_workers=True)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        c.prewarm_wait("alpha", [0, 1])
        c.prewarm_wait("beta", [1])
        act = c.activate("gamma", [0])  # evicts alpha (touches GPU 0)
        pid = c.describe().gpus[0].worker_pid
        os.kill(pid, 9)
        d = wait_for(
            lambda: (
                (x := c.describe()).gpus[0].worker_restarts == 1
                and x.gpus[0].worker_pid
                and not x.instances
                # the new worker has its fresh page pool (gpu_restored comes after the replace)
                and x.gpus[0].pages_total > 0
                and x
            ),
            what="worker replacement",
        )
        # GPU 0's memory is gone with its worker: gamma's slot too; GPU 1 keeps beta.
        assert [(s.model, list(s.gpus)) for s in d.slots] == [("beta", [1])]
        assert d.gpus[0].state == pb.WORKER_STATE_IDLE
        assert d.gpus[0].pages_free == d.gpus[0].pages_total > 0
        assert d.gpus[1].state == pb.WORKER_STATE_UNIVERSAL
        with pytest.raises(urllib.error.URLError):
            http(act.instance.endpoint + "/v1/models")
        again = c.activate("gamma", [0])  # cold start on the fresh pool of the new worker
        assert not again.prewarm_hit
        assert json.loads(http(again.instance.endpoint + "/v1/models"))["data"][0]["id"] == "gamma"
        a.run(asyncio.to_thread(a.server.core.check))


def test_restart_reports_a_fresh_node(tmp_path: Path, model_root: Path) -> None:
    """Documented restart semantics: workers and simulated memory go with the agent; the new
    agent reports a new agent_id and an empty node, which the operator reconciles against."""
    cfg = cfg_for(tmp_path, model_root, use_workers=True)
    with AgentThread(cfg) as a:
        with SyncAgentClient(a.address) as c:
            act = c.activate("gamma", [0])
            d1 = c.describe()
        pids = [g.worker_pid for g in d1.gpus]
        port = a.server.port
    for pid in pids:
        wait_for(lambda pid=pid: not _alive(pid), what=f"worker {pid} to exit")
    with pytest.raises(urllib.error.URLError):
        http(act.instance.endpoint + "/v1/models")
    assert not list(Path(cfg.memory_dir).glob("*.mem"))
    cfg2 = cfg_for(tmp_path, model_root, listen=f"127.0.0.1:{port}")
    with AgentThread(cfg2) as b, SyncAgentClient(b.address) as c:
        d2 = c.describe()
        assert d2.agent_id != d1.agent_id
        assert not d2.slots and not d2.instances
        assert all(g.state == pb.WORKER_STATE_IDLE for g in d2.gpus)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_prometheus_metrics_and_advertised_endpoint(tmp_path: Path, model_root: Path) -> None:
    cfg = cfg_for(tmp_path, model_root, metrics_port=0, advertise_host="localhost")
    with AgentThread(cfg) as a:
        with SyncAgentClient(a.address) as c:
            c.prewarm_wait("alpha", [0])
            act = c.activate("alpha", [0])
            c.activate("gamma", [1])
            assert act.instance.endpoint.startswith("http://localhost:")
            assert json.loads(http(act.instance.endpoint + "/v1/models"))["object"] == "list"
        text = http(f"http://127.0.0.1:{a.server.metrics_port}/metrics").decode()
    assert 'warmserve_agent_worker_state{gpu="0",node="node-a",state="dedicated"} 1.0' in text
    assert 'warmserve_agent_worker_state{gpu="0",node="node-a",state="idle"} 0.0' in text
    assert f'slot="{act.instance.slot_id}"' in text and "warmserve_agent_slot_bytes" in text
    assert "warmserve_agent_load_bandwidth_bytes_per_second" in text
    assert 'warmserve_agent_activation_seconds_count{node="node-a",prewarm_hit="true"} 1.0' in text
    assert 'warmserve_agent_activation_seconds_count{node="node-a",prewarm_hit="false"} 1.0' in text


def test_incompatible_settings_are_refused(tmp_path: Path, model_root: Path) -> None:
    from warmserve_agent.config import ConfigError

    bad = [
        (dict(memory_in_workers=True, use_workers=False), "needs worker processes"),
        (dict(memory_in_workers=True, use_workers=True, recycle_workers=True), "recycling"),
        (dict(token_file=tmp_path / "missing-token"), "missing-token"),
        (dict(tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem"), "accept any caller"),
        (dict(tls_cert=tmp_path / "c.pem"), "go together"),
        (dict(engine_host="0.0.0.0"), "advertise-host"),
    ]
    for kw, needle in bad:
        with pytest.raises((ConfigError, FileNotFoundError), match=needle):
            AgentThread(cfg_for(tmp_path, model_root, **kw)).__enter__()


def test_corrupted_slot_fails_activation_and_is_quarantined(fast_agent) -> None:
    a, c = fast_agent
    slot = c.prewarm_wait("gamma", [1]).slot
    core = a.server.core
    lay = core.slots[slot.slot_id].layout
    core.mm.write(slot.slot_id, 1, lay.placements[0].slot_offset, b"\xde\xad\xbe\xef")
    code, msg = code_of(lambda: c.activate("gamma", [1]))
    assert code == grpc.StatusCode.UNAVAILABLE and "evict the slot and prewarm again" in msg
    d = c.describe()
    assert d.slots[0].state == pb.SLOT_STATE_FAILED and "verification" in d.slots[0].message
    assert d.gpus[1].state == pb.WORKER_STATE_UNIVERSAL and not d.instances
    code, msg = code_of(lambda: c.activate("gamma", [1], slot_id=slot.slot_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "evict it" in msg
    c.evict(slot.slot_id)
    assert c.activate("gamma", [1]).instance.endpoint  # cold start with good bytes


def test_worker_memory_tensor_parallel_verifies_every_rank(
    tmp_path: Path, model_root: Path
) -> None:
    """TP=2 with memory owned by the workers: rank 0's worker hosts the engine and reads its own
    GPU by virtual address; rank 1's shard is verified by rank 1's worker (initially and as the
    remaining layers land), so corrupt bytes on either rank are caught."""
    cfg = cfg_for(tmp_path, model_root, use_workers=True, memory_in_workers=True)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        core = a.server.core
        slot = c.prewarm_wait("alpha", [0, 1], layers=2).slot
        act = c.activate("alpha", [0, 1])
        assert act.prewarm_hit
        wait_for(lambda: c.describe().instances[0].layers_resident == 4, what="remaining layers")
        out = json.loads(http(act.instance.endpoint + "/v1/completions", {"prompt": "tp"}))
        assert out["usage"]["completion_tokens"] == 16
        c.begin_grace(act.instance.instance_id)
        c.end_instance(act.instance.instance_id)
        # Corrupt rank 1's shard of the (kept) slot: rank 1's worker catches it.
        lay = core.slots[slot.slot_id].layout
        a.run(
            asyncio.to_thread(core.mm.write, slot.slot_id, 1, lay.placements[1].slot_offset, b"!!")
        )
        code, msg = code_of(lambda: c.activate("alpha", [0, 1]))
        assert code == grpc.StatusCode.UNAVAILABLE and "[rank 1]" in msg
        assert c.describe().slots[0].state == pb.SLOT_STATE_FAILED
        a.run(asyncio.to_thread(core.check))


def test_replay_after_a_lost_answer(fast_agent) -> None:
    """The caller gives up (deadline) while Activate runs; retrying with the same request_id
    returns the one instance that was started instead of starting another or hanging."""
    a, c = fast_agent
    impatient = SyncAgentClient(a.address, timeout_s=0.002)
    try:
        impatient.activate("beta", [0], request_id="lost-1", timeout_s=0.002)
    except AgentError as exc:  # the answer is lost (how depends on timing)
        assert exc.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    finally:
        impatient.close()
    r1 = c.activate("beta", [0], request_id="lost-1", timeout_s=20)  # hung here before the fix
    r2 = c.activate("beta", [0], request_id="lost-1", timeout_s=20)
    assert r1.instance.instance_id == r2.instance.instance_id
    assert [i.instance_id for i in c.describe().instances] == [r1.instance.instance_id]


def test_evict_while_loading_aborts_the_prewarm(tmp_path: Path, model_root: Path) -> None:
    """With a slow simulated copy (timing model), evicting a slot mid-load cancels its loader:
    the Prewarm stream ends ABORTED, every page returns to the pool, nothing half-mapped stays."""
    cfg = cfg_for(tmp_path, model_root, sim_copy_bytes_per_s=2e5)  # ~2.3 s for alpha
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        stream = c.prewarm("alpha", [0], request_id="slow-1")
        first = next(stream)
        assert not first.done and first.layers_loaded < first.layers_target
        c.evict(first.slot_id)
        with pytest.raises(AgentError) as ei:
            list(stream)
        assert ei.value.code == grpc.StatusCode.ABORTED and "new request_id" in ei.value.message
        d = c.describe()
        assert not d.slots and d.gpus[0].state == pb.WORKER_STATE_IDLE
        assert d.gpus[0].pages_free == d.gpus[0].pages_total
        a.run(asyncio.to_thread(a.server.core.check))
