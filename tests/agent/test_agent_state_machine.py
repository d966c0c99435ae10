"""Stateful property test of the node core (hypothesis RuleBasedStateMachine).

Random sequences of prewarm / activate / load changes / grace / lend / end / evict / worker crash
on 4 simulated GPUs.  After every step:

* no physical page is mapped twice and none leaks (``MemoryManager.check``: free + mapped =
  total, owner map = slot tables = the simulated MMU);
* every GPU's worker state agrees with what it holds (Figure 5; ``NodeCore.check``) — an illegal
  transition raises ``IllegalTransition`` and fails the test;
* every slot's resident weights are byte-identical to the store's digests until it is evicted,
  even while instances scribble over their KV cache and lend KV pages to other slots.

The engine here is a scripted double (the test sets R and K); the real engines are exercised
by the loopback tests.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import hypothesis.strategies as st
from conftest import PAGE, write_model
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engines.spec import (
    EngineSpec,
    EngineStages,
    EngineStats,
    PreparedReport,
    PreparedState,
)
from warmserve_agent.loader import verify_layers
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.store import WeightStore

from warmserve.policy.cluster import InstancePhase, WorkerState

GROUPS = [(0,), (1,), (0, 1), (2,), (3,), (2, 3), (0, 1, 2, 3)]
MODELS = ["alpha", "beta", "gamma"]


class ScriptedEngine:
    """InstanceEngine double: R and K are set by the test; it never shrinks below K.  Like the
    real hosts it holds one prepared engine (for a slot) until activated or dropped."""

    prepared_starts = 0  # activations that used a prepared engine, over all runs

    def __init__(self, gpus: tuple[int, ...] = ()) -> None:
        self.gpus = tuple(gpus)
        self.running = 0
        self.kv_used = 0
        self.capacity = 0
        self.started = False
        self.layers = 0
        self.process_taken_at = time.perf_counter()
        self.prepared_for: EngineSpec | None = None
        self.was_prepared = False

    def prepare(self, spec: EngineSpec) -> None:
        assert not spec.instance_id and spec.slot_id, "a preparation names a slot, no instance"
        self.prepared_for = spec

    def prepared(self, wait_s: float = 0.0) -> PreparedReport:
        state = PreparedState.READY if self.prepared_for is not None else PreparedState.NONE
        return PreparedReport(state)

    def drop_prepared(self) -> None:
        self.prepared_for = None

    def start(self, spec: EngineSpec) -> str:
        if self.prepared_for is not None:
            assert self.prepared_for.prepared_key() == spec.prepared_key()
            self.prepared_for = None
            self.was_prepared = True
            ScriptedEngine.prepared_starts += 1
        self.capacity = spec.kv_capacity_bytes
        self.started = True
        return "http://127.0.0.1:1"

    def layers_ready(self, n: int) -> None:
        self.layers = n

    def set_kv_capacity(self, nbytes: int) -> int:
        self.capacity = max(nbytes, self.kv_used)
        return self.capacity

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.running,
            kv_used_bytes=self.kv_used,
            stages=EngineStages(prepared=self.was_prepared),
        )

    def stop(self) -> None:
        self.started = False


_ROOT: Path | None = None


def _model_root(base: Path) -> Path:
    global _ROOT
    if _ROOT is None or not _ROOT.exists():
        _ROOT = base / "models"
        write_model(_ROOT, "alpha", layers=4, hidden=64, seed=1)
        write_model(_ROOT, "beta", layers=3, hidden=48, seed=2)
        write_model(_ROOT, "gamma", layers=2, hidden=32, seed=3, files=1)
    return _ROOT


class NodeMachine(RuleBasedStateMachine):
    base: Path

    def __init__(self) -> None:
        super().__init__()
        root = _model_root(self.base)
        self.backend = SimulatedBackend(
            self.base / f"gpus-{os.getpid()}-{id(self)}", page_bytes=PAGE
        )
        self.hosts: list[ScriptedEngine] = []

        def host(group: tuple[int, ...]) -> ScriptedEngine:
            self.hosts.append(ScriptedEngine(group))
            return self.hosts[-1]

        self.core = NodeCore(
            MemoryManager(self.backend),
            WeightStore(root),
            dict.fromkeys(range(4), 24 * PAGE),
            host,
            node_name="prop",
        )

    def _wait_loaders(self) -> None:
        for s in list(self.core.slots.values()):
            if s.loader is not None:
                s.loader.join()
        self.core.preparer.settle()

    # ---- rules -------------------------------------------------------------------------------
    @rule(model=st.sampled_from(MODELS), group=st.sampled_from(GROUPS), layers=st.integers(0, 4))
    def prewarm(self, model: str, group: tuple[int, ...], layers: int) -> None:
        try:
            self.core.prewarm(model, group, layers)
        except Refusal as r:
            assert r.code in {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
        self._wait_loaders()

    @rule(model=st.sampled_from(MODELS), group=st.sampled_from(GROUPS))
    def activate(self, model: str, group: tuple[int, ...]) -> None:
        try:
            self.core.activate(model, group)
        except Refusal as r:
            assert r.code in {"FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
        self._wait_loaders()

    @rule(model=st.sampled_from(MODELS), group=st.sampled_from(GROUPS), layers=st.integers(0, 4))
    def prewarm_then_activate(self, model: str, group: tuple[int, ...], layers: int) -> None:
        """A prewarm hit, the path prepared engines are for (random rules rarely line up)."""
        self.prewarm(model, group, layers)
        self.activate(model, group)

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data(), running=st.integers(0, 4), frac=st.floats(0, 1))
    def load_changes(self, data: st.DataObject, running: int, frac: float) -> None:
        """Requests arrive/finish: set R and K, and write junk into the live KV cache."""
        iid = data.draw(st.sampled_from(list(self.core.instances)))
        inst = self.core.instances[iid]
        eng: ScriptedEngine = inst.engine  # type: ignore[assignment]
        tp = len(inst.gpus)
        cap = eng.capacity
        eng.running = running
        eng.kv_used = int(cap * frac) // tp * tp
        used_gpu = eng.kv_used // tp
        if used_gpu:
            junk = os.urandom(min(used_gpu, 3 * PAGE))
            for g in inst.gpus:
                self.core.mm.write(inst.slot_id, g, inst.weight_pages * PAGE, junk)

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data())
    def begin_grace(self, data: st.DataObject) -> None:
        iid = data.draw(st.sampled_from(list(self.core.instances)))
        try:
            self.core.begin_grace(iid)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @rule()
    def lend(self) -> None:
        rows = self.core.lendable()
        for row in rows:
            inst = self.core.instances[row["instance_id"]]
            eng: ScriptedEngine = inst.engine  # type: ignore[assignment]
            # Lending never takes KV the instance is using (Eq. 1 target >= K + M/C).
            assert inst.kv_pages * PAGE * len(inst.gpus) >= eng.kv_used
            assert row["reservation_target_bytes"] <= row["kv_capacity_bytes"]

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data(), evict=st.booleans())
    def end(self, data: st.DataObject, evict: bool) -> None:
        iid = data.draw(st.sampled_from(list(self.core.instances)))
        try:
            self.core.end_instance(iid, evict_weights=evict)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"
            assert self.core.instances[iid].phase != InstancePhase.GRACE

    @precondition(lambda self: bool(self.core.slots))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(list(self.core.slots)))
        try:
            self.core.evict(sid)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @rule(gpu=st.integers(0, 3))
    def worker_crash(self, gpu: int) -> None:
        for h in self.hosts:  # what the dead process held is gone with it
            if h.gpus[:1] == (gpu,):
                h.prepared_for = None
        self.core.worker_died(gpu)

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self._wait_loaders()
        self.core.check()

    @invariant()
    def weights_intact(self) -> None:
        store = self.core.store
        for s in list(self.core.slots.values()):
            digests = [store.digests(s.layout, r) for r in range(len(s.gpus))]
            bad = verify_layers(
                lambda r, o, n, s=s: self.core.mm.read(s.slot_id, s.gpus[r], o, n),
                s.layout,
                digests,
                range(len(s.gpus)),
                s.layers_resident,
            )
            assert not bad, f"slot {s.slot_id} ({s.model}) corrupted: {bad}"
            need = math.ceil(s.layout.bytes_for_layers(s.layers_resident) / PAGE)
            assert all(self.core.mm.mapped_prefix(s.slot_id, g) >= need for g in s.gpus)

    @invariant()
    def prepared_engines(self) -> None:
        """At most one prepared engine per worker, only on GPUs serving nothing, each for a
        slot that exists; every engine a host holds prepared belongs to one of them (evicted,
        activated or crashed slots' engines are gone)."""
        self._wait_loaders()
        live = {
            sid: rec
            for sid, rec in self.core.preparer.prepared.items()
            if rec.report.state in (PreparedState.PREPARING, PreparedState.READY)
        }
        gpus = [rec.gpu for rec in live.values()]
        assert len(gpus) == len(set(gpus)), f"two prepared engines in one worker: {live}"
        for sid, rec in live.items():
            slot = self.core.slots[sid]
            assert rec.gpu == slot.gpus[0]
            for g in slot.gpus:
                assert self.core.gpus[g].state not in (WorkerState.DEDICATED, WorkerState.GRACE)
        holders = {id(rec.host) for rec in live.values()}
        for h in self.hosts:
            if h.prepared_for is not None:
                assert id(h) in holders, f"a prepared engine outlived its slot {h.prepared_for}"
        for inst in self.core.instances.values():
            assert inst.stages.endpoint_up is not None and inst.stages.process_taken is not None

    def teardown(self) -> None:
        self.core.shutdown()
        self.core.mm.close()


def test_node_state_machine(tmp_path: Path) -> None:
    NodeMachine.base = tmp_path
    run = NodeMachine.TestCase()
    run.settings = settings(
        max_examples=40,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    run.runTest()
    assert not list((tmp_path).glob("gpus-*/*.mem")), "simulated GPU files leaked"
    assert ScriptedEngine.prepared_starts > 0, "no activation used a prepared engine"
