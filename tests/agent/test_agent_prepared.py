"""Prepared engines through the agent's gRPC API with real worker processes (simulated engine):
Describe's view of them (per slot and per worker), the activation's stages on the wire,
Prewarm's engine checks, eviction and a worker crash with a prepared engine."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import cfg_for, wait_for
from warmserve_agent.testing import AgentThread

from warmserve.api.agent.client import AgentError, SyncAgentClient, pb

ARGS = ["--max-model-len", "512"]
# reached when Activate answers (weights_resident: with a full prewarm only); kv_mapped comes
# when the background KV mapping completes, possibly later
STAGES = ("process_taken", "engine_ready", "weights_resident", "endpoint_up")


def _prepared(c: SyncAgentClient, slot_id: str) -> pb.SlotInfo:
    def ready() -> pb.SlotInfo | None:
        s = next((s for s in c.describe().slots if s.slot_id == slot_id), None)
        if s is not None and s.prepared_engine.state == pb.PREPARED_ENGINE_STATE_FAILED:
            raise AssertionError(s.prepared_engine.message)
        ok = s is not None and s.prepared_engine.state == pb.PREPARED_ENGINE_STATE_READY
        return s if ok else None

    return wait_for(ready, what=f"slot {slot_id}'s prepared engine")


def _complete(endpoint: str) -> dict:
    req = urllib.request.Request(
        f"{endpoint}/v1/completions",
        data=json.dumps({"prompt": "hello warm world", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("memory_in_workers", [False, True], ids=["agent-memory", "worker-memory"])
def test_prepared_engine_in_the_worker_and_the_stages_of_its_hit(
    tmp_path: Path, model_root: Path, memory_in_workers: bool
) -> None:
    cfg = cfg_for(tmp_path, model_root, use_workers=True, memory_in_workers=memory_in_workers)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        last = c.prewarm_wait("alpha", [0], 2, engine="simulated", engine_args=ARGS)
        sid = last.slot_id
        s = _prepared(c, sid)
        pe = s.prepared_engine
        assert (pe.engine, pe.worker_gpu) == ("simulated", 0) and pe.build_seconds > 0
        # a second slot on the same worker waits: one prepared engine per worker process
        other = c.prewarm_wait("gamma", [0], engine_args=ARGS).slot_id
        d = c.describe()
        (g0,) = [g for g in d.gpus if g.index == 0]
        assert g0.prepared_slot_id == sid
        assert g0.prepared_engine_host_bytes == pe.host_bytes
        (s2,) = [s for s in d.slots if s.slot_id == other]
        assert s2.prepared_engine.state == pb.PREPARED_ENGINE_STATE_UNSPECIFIED
        worker = a.server.pool.worker(0)
        assert worker.call("prepared_state", slot_id=sid).state == "ready"

        act = c.activate("alpha", [0], engine="simulated", engine_args=ARGS)
        st = act.instance.stages
        assert act.prewarm_hit and st.engine_prepared
        assert all(st.HasField(f"{k}_seconds") for k in STAGES if k != "weights_resident")
        assert not st.HasField("first_token_seconds")
        assert st.endpoint_up_seconds <= act.activation_seconds
        assert _complete(act.instance.endpoint)["usage"]["completion_tokens"] == 4

        def streamed() -> pb.InstanceInfo | None:
            (i,) = c.describe().instances
            done = i.stages.HasField("first_token_seconds")
            done = done and i.stages.HasField("kv_mapped_seconds")
            return i if done and i.stages.HasField("weights_resident_seconds") else None

        i = wait_for(streamed, what="the first token, the KV range and the rest of the layers")
        assert i.stages.kv_mapped_seconds >= i.stages.engine_ready_seconds
        assert i.stages.first_token_seconds > i.stages.endpoint_up_seconds
        assert worker.call("ping")["engine_builds"] == 0  # no vLLM here
        d = c.describe()
        assert not [g for g in d.gpus if g.prepared_slot_id], "its engine serves now"
        assert other not in {s.slot_id for s in d.slots}, "activation evicted the other slot"


def test_prewarm_checks_the_engine_before_anything_changes(
    tmp_path: Path, model_root: Path
) -> None:
    with AgentThread(cfg_for(tmp_path, model_root)) as a, SyncAgentClient(a.address) as c:
        gen = c.describe().generation
        cases = [
            ({"engine_args": ["--max-model-lenn", "64"]}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"engine_args": ["--trust-remote-code"]}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"engine": "nope"}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"engine": "vllm"}, grpc.StatusCode.FAILED_PRECONDITION),  # not hosted here
        ]
        for kw, code in cases:
            with pytest.raises(AgentError) as e:
                c.prewarm_wait("alpha", [0], **kw)  # type: ignore[arg-type]
            assert e.value.code == code, (kw, e.value)
        assert c.describe().generation == gen and not c.describe().slots


def test_evict_tears_the_workers_prepared_engine_down(tmp_path: Path, model_root: Path) -> None:
    cfg = cfg_for(tmp_path, model_root, use_workers=True)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        sid = c.prewarm_wait("alpha", [0], engine_args=ARGS).slot_id
        waiting = c.prewarm_wait("gamma", [0], engine_args=ARGS).slot_id
        _prepared(c, sid)
        worker = a.server.pool.worker(0)
        assert worker.call("prepared_state", slot_id=sid).state == "ready"
        c.evict(sid)
        assert worker.call("prepared_state", slot_id=sid).state == "none"
        # the worker is free: the slot that waited gets its engine, in the same process
        assert _prepared(c, waiting).prepared_engine.worker_gpu == 0
        assert worker.call("prepared_state", slot_id=waiting).state == "ready"
        assert a.server.pool.worker(0) is worker


def test_a_worker_crash_loses_its_prepared_engine_and_the_new_worker_prepares_again(
    tmp_path: Path, model_root: Path
) -> None:
    """Agent-owned memory: the slot survives its worker; the engine prepared in the dead
    process is forgotten and prepared again in the replacement, and the hit uses that one."""
    cfg = cfg_for(tmp_path, model_root, use_workers=True)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        sid = c.prewarm_wait("alpha", [0], engine_args=ARGS).slot_id
        _prepared(c, sid)
        old = a.server.pool.worker(0)
        os.kill(old.pid, signal.SIGKILL)
        wait_for(lambda: a.server.pool.worker(0).pid != old.pid, what="the worker's replacement")
        new = a.server.pool.worker(0)
        s = _prepared(c, sid)
        assert s.slot_id == sid and new.call("prepared_state", slot_id=sid).state == "ready"
        (g0,) = [g for g in c.describe().gpus if g.index == 0]
        assert g0.worker_pid == new.pid and g0.prepared_slot_id == sid
        act = c.activate("alpha", [0], engine_args=ARGS)
        assert act.prewarm_hit and act.instance.stages.engine_prepared
        assert _complete(act.instance.endpoint)["usage"]["completion_tokens"] == 4
