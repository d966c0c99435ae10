"""Prepared engines and per-layer readiness with the simulated engine (no vLLM; the same
lifecycle as the ``vllm`` engine's, which tests/engines/test_vllm_prepared.py checks for real).

* a prewarm prepares the slot's engine; the hit's activation builds none and answers exactly as
  an activation that built its engine does;
* the activation's stages: all reached, the engine's from the prepared one;
* a prepared engine is torn down when its slot is evicted (or destroyed by another activation);
  other arguments at Activate build a new engine;
* a partially prewarmed slot serves before its last layer lands: the request is admitted and its
  prefill runs layer by layer while the rest streams in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from warmserve_agent.activation_stages import Stage
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.engines.simulated import SimulatedEngine
from warmserve_agent.engines.spec import PreparedState
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore

from tests.agent.conftest import write_model
from tests.engines.conftest import PAGE
from tests.engines.helpers import post_json

ARGS = ("--max-model-len", "512")


class CountingHost(InProcessEngine):
    """The in-process host, counting the engines it builds (prepared or at start)."""

    builds = 0

    def prepare(self, spec):  # type: ignore[no-untyped-def]
        CountingHost.builds += 1
        super().prepare(spec)

    def start(self, spec):  # type: ignore[no-untyped-def]
        if self._prepared is None:
            CountingHost.builds += 1
        return super().start(spec)


def _core(tmp_path: Path, root: Path, gpus: int = 1, copy_bytes_per_s: float | None = None):  # type: ignore[no-untyped-def]
    backend = SimulatedBackend(
        tmp_path / f"gpus-{time.monotonic_ns()}", page_bytes=PAGE, copy_bytes_per_s=copy_bytes_per_s
    )
    hosts: list[CountingHost] = []

    def host(group):  # type: ignore[no-untyped-def]
        hosts.append(CountingHost(group))
        return hosts[-1]

    core = NodeCore(
        MemoryManager(backend), WeightStore(root), dict.fromkeys(range(gpus), 4 * 1024**2), host
    )
    return core, hosts


def _text(endpoint: str, prompt: str = "warm serve") -> str:
    status, body = post_json(f"{endpoint}/v1/completions", {"prompt": prompt, "max_tokens": 8})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_a_hit_uses_the_prepared_engine_and_answers_as_a_built_one(
    tmp_path: Path, model_root: Path
) -> None:
    core, _ = _core(tmp_path, model_root)
    try:
        # The reference: a hit whose engine is built at start (prepared for other arguments).
        core.prewarm("alpha", [0], engine_args=("--max-model-len", "1024")).loader.join()  # type: ignore[union-attr]
        built = core.activate("alpha", [0], engine_args=ARGS)[0]
        reference = _text(built.endpoint)
        assert built.prewarm_hit and not built.stages.engine_prepared
        core.begin_grace(built.instance_id)
        core.end_instance(built.instance_id, evict_weights=True)

        slot = core.prewarm("alpha", [0], engine_args=ARGS)
        slot.loader.join()
        core.preparer.settle()
        rec = core.preparer.prepared[slot.slot_id]
        assert rec.report.state == PreparedState.READY and rec.gpu == 0
        before = CountingHost.builds
        inst, _ = core.activate("alpha", [0], engine_args=ARGS)
        assert CountingHost.builds == before, "an engine was built at activation"
        assert inst.prewarm_hit and inst.stages.engine_prepared
        assert isinstance(inst.engine, CountingHost) and inst.engine is rec.host
        assert _text(inst.endpoint) == reference
        st = core.engine_stats(inst).stages
        assert st.prepared and st.first_token_s is not None
        assert core.kv_idle()  # the KV range is mapped in the background
        known = inst.stages.known()
        assert set(known) == set(Stage), known
        assert known[Stage.WEIGHTS_RESIDENT] == 0.0  # resident before Activate
        assert known[Stage.ENGINE_READY] <= known[Stage.ENDPOINT_UP]
        # The KV stage: during the engine's start if the pager had mapped the range by then,
        # else when it completed it, after the start
        after = Stage.ENDPOINT_UP if inst.stages.kv_in_background else Stage.ENGINE_READY
        assert known[after] <= known[Stage.KV_MAPPED]
        assert known[Stage.ENDPOINT_UP] <= inst.activation_seconds < known[Stage.FIRST_TOKEN]
        assert not core.preparer.prepared, "the prepared engine became the instance's"
        hist = core.activator.stage_histograms.snapshot()
        assert {(s.value, k.value) for s, k in hist} >= {
            ("endpoint_up", "hit_prepared"),
            ("first_token", "hit_prepared"),
            ("endpoint_up", "hit"),
        }
    finally:
        core.shutdown()
        core.mm.close()


def test_other_arguments_at_activate_build_their_own_engine(
    tmp_path: Path, model_root: Path
) -> None:
    core, hosts = _core(tmp_path, model_root)
    try:
        slot = core.prewarm("alpha", [0], engine_args=ARGS)
        slot.loader.join()
        core.preparer.settle()
        thread = hosts[-1]._prepared.engine._thread  # type: ignore[union-attr]
        before = CountingHost.builds
        inst, _ = core.activate("alpha", [0], engine_args=("--max-model-len", "64"))
        assert CountingHost.builds == before + 1 and not inst.stages.engine_prepared
        assert thread is not None
        thread.join(10)  # the prepared one is torn down in the background
        assert not thread.is_alive()
        status, body = post_json(
            f"{inst.endpoint}/v1/completions", {"prompt": "a b c", "max_tokens": 100}
        )
        assert status == 400 and "64" in body["error"]["message"], "its arguments apply"
    finally:
        core.shutdown()
        core.mm.close()


def test_evicting_the_slot_tears_its_prepared_engine_down(tmp_path: Path, model_root: Path) -> None:
    core, hosts = _core(tmp_path, model_root, gpus=1)
    try:
        a = core.prewarm("alpha", [0], engine_args=ARGS)
        b = core.prewarm("beta", [0], layers=1, engine_args=ARGS)
        for s in (a, b):
            s.loader.join()
        core.preparer.settle()
        # one prepared engine per worker: the first slot's; the second waits for the worker
        assert set(core.preparer.prepared) == {a.slot_id}
        eng: SimulatedEngine = hosts[-1]._prepared.engine  # type: ignore[union-attr]
        thread = eng._thread
        assert eng._loop is not None and thread is not None and thread.is_alive()
        core.evict(a.slot_id)
        core.preparer.settle()
        thread.join(10)  # the teardown runs in the background
        assert not thread.is_alive() and not eng._mem, "torn down with its slot"
        # the worker is free again: the waiting slot gets its engine
        assert set(core.preparer.prepared) == {b.slot_id}
        assert core.preparer.prepared[b.slot_id].report.state == PreparedState.READY
        # a cold start on the GPU destroys the waiting slot, and its engine with it
        waiting = hosts[-1]._prepared.engine._thread  # type: ignore[union-attr]
        assert waiting is not None and waiting.is_alive()
        inst, evicted = core.activate("gamma", [0])
        assert evicted == [b.slot_id] and not inst.prewarm_hit
        waiting.join(10)
        assert not waiting.is_alive() and not core.preparer.prepared
    finally:
        core.shutdown()
        core.mm.close()


def test_a_partial_prewarm_serves_before_its_last_layer_lands(tmp_path: Path) -> None:
    """1 of 8 layers resident, the rest copied at a slow rate: the request is admitted and its
    prefill starts at once (layer by layer), its first token comes right after the last layer."""
    root = tmp_path / "models"
    write_model(root, "deep", layers=8, hidden=64, seed=5)
    core, _ = _core(tmp_path, root, copy_bytes_per_s=2e6)  # ~60 KiB per layer: ~30 ms each
    try:
        slot = core.prewarm("deep", [0], layers=1, engine_args=ARGS)
        slot.loader.join()
        core.preparer.settle()
        inst, _ = core.activate("deep", [0], engine_args=ARGS)
        assert inst.stages.engine_prepared and inst.stages.weights_resident is None
        seen: list[tuple[int, int]] = []  # (layers resident, requests running) while it ran
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                st = inst.engine.stats()
                seen.append((st.layers_resident, st.running))
                time.sleep(0.005)

        t = threading.Thread(target=watch)
        t.start()
        try:
            text = _text(inst.endpoint)
        finally:
            done.set()
            t.join()
        assert text
        assert any(running and layers < 8 for layers, running in seen), seen
        stages = inst.stages
        core.engine_stats(inst)
        assert stages.weights_resident is not None and stages.first_token is not None
        assert stages.endpoint_up < stages.weights_resident <= stages.first_token  # type: ignore[operator]
    finally:
        core.shutdown()
        core.mm.close()


def test_stage_metrics_are_exported(make_core: Callable[..., NodeCore]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from warmserve_agent.metrics import AgentCollector

    core = make_core(gpus=1)
    s = core.prewarm("alpha", [0])
    s.loader.join()
    core.preparer.settle()
    inst, _ = core.activate("alpha", [0])
    reg = CollectorRegistry()
    reg.register(AgentCollector(core))
    text = generate_latest(reg).decode()
    line = (
        'warmserve_agent_activation_stage_seconds_count{node="test-node",stage="endpoint_up",'
        'start="hit_prepared"} 1.0'
    )
    assert line in text, text
    assert 'stage="process_taken",start="hit_prepared"' in text
    assert inst.stages.engine_prepared


class HeldHost(InProcessEngine):
    """The in-process host whose preparations first wait for ``HeldHost.gate``: as a worker's
    preparation waits for the engine of the slot before it, still being torn down
    (``PreparedEngine(after=...)``), the window in which the slot may go."""

    gate = threading.Event()

    def prepare(self, spec):  # type: ignore[no-untyped-def]
        from warmserve_agent.engines import engine_info
        from warmserve_agent.engines.prepared import PreparedEngine

        teardown = threading.Thread(target=HeldHost.gate.wait, daemon=True)
        teardown.start()
        self._prepared = PreparedEngine(engine_info(spec.engine).create(), spec, after=(teardown,))


def test_a_slot_evicted_while_its_engine_prepares_cancels_the_preparation(
    tmp_path: Path, model_root: Path, caplog
) -> None:  # type: ignore[no-untyped-def]
    """The slot goes while its engine's build waits for the engine before it: the build is
    cancelled at once (the eviction's teardown does not wait for the engine before it, however
    long that takes) and never runs over the slot that is gone (before: it did once that engine
    was down, and failed, ``engine_prepare_failed ... FileNotFoundError`` at WARNING: the
    slot's page table was gone); nothing is left of the engine, and the process prepares the
    next slot."""
    import logging

    backend = SimulatedBackend(tmp_path / "gpus", page_bytes=PAGE)
    hosts: list[HeldHost] = []

    def host(group):  # type: ignore[no-untyped-def]
        hosts.append(HeldHost(group))
        return hosts[-1]

    core = NodeCore(MemoryManager(backend), WeightStore(model_root), {0: 4 * 1024**2}, host)
    HeldHost.gate.clear()
    caplog.set_level(logging.INFO, logger="warmserve.agent")
    try:
        a = core.prewarm("alpha", [0], engine_args=ARGS)
        a.loader.join()
        deadline = time.monotonic() + 10
        while not hosts or hosts[-1]._prepared is None:
            assert time.monotonic() < deadline, "no preparation began"
            time.sleep(0.01)
        prep = hosts[-1]._prepared
        assert prep is not None and prep.report().state == PreparedState.PREPARING
        core.evict(a.slot_id)
        assert core.kv_idle(), "the slot's pages are unmapped, its page table removed"
        prep.thread.join(5)
        ended_while_held = not prep.thread.is_alive()
        HeldHost.gate.set()  # the engine before it is down
        prep.thread.join(10)
        core.preparer.settle()
        said = [r.getMessage() for r in caplog.records]
        assert not [m for m in said if "engine_prepare_failed" in m], said
        assert ended_while_held, "the evicted slot's preparation waited for the engine before it"
        assert [m for m in said if "engine_prepare_cancelled" in m], said
        eng: SimulatedEngine = prep.engine
        assert eng._thread is None and not eng._mem, "nothing of the engine was built"
        # the process is free: the next slot's engine is prepared in it and serves
        b = core.prewarm("beta", [0], layers=1, engine_args=ARGS)
        b.loader.join()
        core.preparer.settle()
        assert core.preparer.prepared[b.slot_id].report.state == PreparedState.READY
        inst, _ = core.activate("beta", [0], engine_args=ARGS)
        assert inst.prewarm_hit and inst.stages.engine_prepared
        assert _text(inst.endpoint)
    finally:
        HeldHost.gate.set()
        core.shutdown()
        core.mm.close()


def test_shutdown_tears_the_prepared_engines_down(tmp_path: Path, model_root: Path) -> None:
    """A node that shuts down takes its prepared engines along (before: an in-process one kept
    serving nothing over a slot whose memory was closed, and a build under way then failed
    over it, logged as a failed preparation in whatever ran next)."""
    core, hosts = _core(tmp_path, model_root)
    try:
        core.prewarm("alpha", [0], engine_args=ARGS).loader.join()  # type: ignore[union-attr]
        core.preparer.settle()
        eng: SimulatedEngine = hosts[-1]._prepared.engine  # type: ignore[union-attr]
        thread = eng._thread
        assert thread is not None and thread.is_alive()
    finally:
        core.shutdown()
        core.mm.close()
    deadline = time.monotonic() + 10  # torn down in the background
    while (thread.is_alive() or eng._mem) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not thread.is_alive() and not eng._mem, "the prepared engine outlived its node"
    assert not core.preparer.prepared and not core.preparer.wanted
