"""Prepared vLLM engines and per-layer readiness with real vLLM on CPU (group ``vllm``).

* a prewarm prepares vLLM's engine over the slot; the hit builds no engine (vLLM's own build
  counter and the activation's stages), reads no weight file (they are garbage by then) and gives
  exactly plain vLLM's greedy tokens, its parameters and KV cache inside the slot;
* a hit with 1 of 4 layers resident serves while the rest streams in: the request's forward runs
  (and waits at the first missing layer) before the last layer lands, tokens still identical;
* evicting the slot tears the prepared engine down (its threads, its slot registration);
* a worker crash loses the prepared engine; the replacement worker prepares again and the hit
  uses it, built once in that process.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from warmserve_agent.engines.spec import PreparedState
from warmserve_agent.node import NodeCore

from tests.engines.test_vllm_engine import (
    ARGS,
    GPU,
    PAGE,
    _check_inside_slot,
    _garble_weight_files,
    _tokens,
    reference,  # noqa: F401  (fixture)
    tiny_root,  # noqa: F401  (fixture)
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def _vllm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("vllm-server", "vllm-engine")]


def _prepared(core: NodeCore, slot_id: str) -> None:
    core.preparer.settle(600)
    rec = core.preparer.prepared[slot_id]
    assert rec.report.state == PreparedState.READY, rec.report


def test_a_prepared_hit_builds_nothing_reads_no_file_and_equals_plain_vllm(
    make_core: Callable[..., NodeCore],
    tiny_root: Path,  # noqa: F811
    reference: list[int],  # noqa: F811
    tmp_path: Path,
) -> None:
    from warmserve_agent.engines.vllm.engine import VllmEngine

    root = tmp_path / "own-models"  # this test garbles its weight files
    shutil.copytree(tiny_root, root)
    core = make_core(gpus=1, gpu_bytes=GPU, page=PAGE, root=root, engines=("vllm",))
    slot = core.prewarm("tiny", [0], engine="vllm", engine_args=ARGS)
    slot.loader.join()
    _prepared(core, slot.slot_id)
    assert core.preparer.prepared[slot.slot_id].report.host_bytes > 0
    assert _garble_weight_files(root / "tiny") > 1_000_000
    builds = VllmEngine.builds
    inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
    assert VllmEngine.builds == builds, "vLLM's engine was built during Activate"
    assert inst.prewarm_hit and inst.stages.engine_prepared
    assert _tokens(inst.endpoint) == reference
    _check_inside_slot(inst.engine.engine)
    core.engine_stats(inst)
    assert core.kv_idle()  # the KV range is mapped in the background
    st = inst.stages
    assert st.weights_resident == 0.0 and st.first_token is not None and st.kv_mapped is not None
    assert st.engine_ready <= st.endpoint_up < st.first_token  # type: ignore[operator]
    # the KV stage: in the engine's start if the range was mapped by then, else after it
    assert st.kv_mapped >= (st.endpoint_up if st.kv_in_background else st.engine_ready)  # type: ignore[operator]


def test_a_partial_hit_serves_while_its_layers_stream_in(
    tmp_path: Path,
    tiny_root: Path,  # noqa: F811
    reference: list[int],  # noqa: F811
) -> None:
    """1 of 4 layers resident, the rest copied at 1.5 MB/s (about a second): the request is sent
    at once; its forward reaches the missing layers before they land and waits for each."""
    from warmserve_agent.backends.simulated import SimulatedBackend
    from warmserve_agent.engine_host import InProcessEngine
    from warmserve_agent.memory import MemoryManager
    from warmserve_agent.store import WeightStore

    backend = SimulatedBackend(tmp_path / "gpus", page_bytes=PAGE, copy_bytes_per_s=1.5e6)
    core = NodeCore(
        MemoryManager(backend),
        WeightStore(tiny_root),
        {0: GPU},
        lambda g: InProcessEngine(g),
        engines=("vllm",),
    )
    try:
        slot = core.prewarm("tiny", [0], layers=1, engine="vllm", engine_args=ARGS)
        slot.loader.join()
        _prepared(core, slot.slot_id)
        inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        assert inst.stages.engine_prepared and slot.layers_resident < 4
        assert _tokens(inst.endpoint) == reference
        gate = inst.engine.engine._gate
        # The forward ran the resident layers and waited at each missing one in turn (a gate on
        # the whole model would only ever wait for all 4).
        assert len(set(gate.waited)) >= 2 and min(gate.waited) < 4, gate.waited
        core.engine_stats(inst)
        st = inst.stages
        assert st.endpoint_up < st.weights_resident <= st.first_token  # type: ignore[operator]
    finally:
        core.shutdown()
        core.mm.close()


def test_evicting_the_slot_tears_the_prepared_vllm_engine_down(
    make_core: Callable[..., NodeCore],
    tiny_root: Path,  # noqa: F811
) -> None:
    from warmserve_agent.engines.vllm import loader

    core = make_core(gpus=1, gpu_bytes=GPU, page=PAGE, root=tiny_root, engines=("vllm",))
    before = _vllm_threads()
    slot = core.prewarm("tiny", [0], engine="vllm", engine_args=ARGS)
    slot.loader.join()
    _prepared(core, slot.slot_id)
    assert slot.slot_id in loader._ACTIVE
    engine_threads = [t for t in _vllm_threads() if t not in before]
    assert len(engine_threads) == 2, engine_threads  # its loop and its engine core
    core.evict(slot.slot_id)
    for t in engine_threads:
        t.join(60)
    assert not any(t.is_alive() for t in engine_threads), "the prepared engine still runs"
    deadline = time.monotonic() + 30
    while slot.slot_id in loader._ACTIVE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slot.slot_id not in loader._ACTIVE


def test_a_worker_crash_loses_the_prepared_engine_and_the_new_worker_prepares_again(
    tmp_path: Path,
    tiny_root: Path,  # noqa: F811
    reference: list[int],  # noqa: F811
) -> None:
    """Agent-owned memory: the slot survives the crash of the worker holding its prepared vLLM
    engine; the replacement prepares it again and the hit uses that engine."""
    from warmserve_agent.config import AgentConfig
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient, pb

    cfg = AgentConfig(
        model_dir=tiny_root,
        simulate_gpus=[GPU],
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / "mem",
        spare_workers=1,
        engines=("vllm",),
        monitor_interval_s=0.1,
    )

    def ready(c: SyncAgentClient) -> pb.SlotInfo:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            (s,) = c.describe().slots
            state = s.prepared_engine.state
            assert state != pb.PREPARED_ENGINE_STATE_FAILED, s.prepared_engine.message
            if state == pb.PREPARED_ENGINE_STATE_READY:
                return s
            time.sleep(0.1)
        raise AssertionError("no prepared engine")

    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as c:
        sid = c.prewarm_wait("tiny", [0], engine="vllm", engine_args=ARGS).slot_id
        ready(c)
        old = agent.server.pool.worker(0)
        os.kill(old.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while agent.server.pool.worker(0).pid == old.pid and time.monotonic() < deadline:
            time.sleep(0.1)
        new = agent.server.pool.worker(0)
        assert new.pid != old.pid
        s = ready(c)
        assert s.slot_id == sid and s.prepared_engine.host_bytes > 0
        res = c.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        assert res.prewarm_hit and res.instance.stages.engine_prepared
        assert _tokens(res.instance.endpoint) == reference
        assert new.call("ping")["engine_builds"] == 1, "built once: prepared, not at Activate"
        assert new.call("prepared_state", slot_id=sid).state == PreparedState.NONE


def test_a_partial_hit_in_a_pooled_worker_is_not_held_by_its_kv_growth(
    tmp_path: Path,
    tiny_root: Path,  # noqa: F811
    reference: list[int],  # noqa: F811
) -> None:
    """The engine in a pooled worker, 1 of 4 layers resident, the rest copied at 1.5 MB/s, KV
    mapped in the background: the pager's KV raises reach the worker while the request's forward
    waits for a layer, which arrives through the same worker's command pipe.  A raise that waited
    for the engine thread held that pipe until the forward gave up (~30 s, kv_grow_failed); the
    tokens come now within seconds, identical to plain vLLM's."""
    from warmserve_agent.config import AgentConfig
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient, pb

    cfg = AgentConfig(
        model_dir=tiny_root,
        simulate_gpus=[GPU],
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / "mem",
        spare_workers=0,
        engines=("vllm",),
        sim_copy_bytes_per_s=1.5e6,
    )
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as c:
        sid = c.prewarm_wait("tiny", [0], layers=1, engine="vllm", engine_args=ARGS).slot_id
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            (s,) = c.describe().slots
            if s.prepared_engine.state == pb.PREPARED_ENGINE_STATE_READY:
                break
            assert s.prepared_engine.state != pb.PREPARED_ENGINE_STATE_FAILED, s
            time.sleep(0.1)
        res = c.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        assert res.prewarm_hit and res.instance.stages.engine_prepared
        assert res.instance.instance_id and sid
        t0 = time.monotonic()
        assert _tokens(res.instance.endpoint) == reference
        took = time.monotonic() - t0
        # the rest of the model (3 layers) streams in ~1 s at 1.5 MB/s; 30 s was the stall
        assert took < 20, f"first answer took {took:.1f}s: the forward waited on a held pipe"
