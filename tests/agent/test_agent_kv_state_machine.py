"""Stateful property test of KV paging and lending (hypothesis RuleBasedStateMachine).

Random interleavings of prewarm / activate / **pager steps** (KV chunks mapped, withdrawn pages
unmapped) / requests admitted, finished (a completion event) or waiting for KV (a KV-wanted
event) / grace / lend / end / evict / worker crash on 4 simulated GPUs.  The engine here keeps
its KV cache with the simulated engine's own :class:`SimKvCache` over the slot's real pages
(``SlotMemory`` with the backend's shared page table); only its requests are scripted.  After
every step:

* the page tables hold (no page twice, none leaked, MMU = tables) and every instance's granted
  blocks touch mapped pages only (``NodeCore.check``);
* **the engine never touched an unmapped page**: every KV write and read went through the
  page-table check (no violation), every page it may use is mapped to the page it reaches, and
  every request's markers read back intact (no other slot wrote into its KV);
* every prewarmed slot's weights equal the store's until it is evicted or cut short.

The pager is driven by the test (no thread), so every interleaving is reproducible.
"""

from __future__ import annotations

import os
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_events import EngineEventKind
from warmserve_agent.engines.simulated_kv import SimKvCache
from warmserve_agent.engines.slotmem import SlotMemory
from warmserve_agent.engines.spec import EngineSpec, EngineStats
from warmserve_agent.loader import verify_layers
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import write_model

from tests.agent.agent_support import PAGE

GROUPS = [(0,), (1,), (0, 1), (2,), (3,), (2, 3), (0, 1, 2, 3)]
MODELS = ["alpha", "beta", "gamma"]


class KvEngine:
    """An engine whose KV cache is the simulated engine's (real pages, checked accesses) and
    whose requests the test scripts."""

    def __init__(self) -> None:
        self.kv: SimKvCache | None = None
        self.mems: dict[int, SlotMemory] = {}
        self.reqs: dict[str, list[int]] = {}
        self.n = 0

    def start(self, spec: EngineSpec) -> str:
        self.mems = {r: SlotMemory(g) for r, g in enumerate(spec.regions) if g.host_file}
        self.kv = SimKvCache(spec, self.mems)
        self.kv.grant(spec.kv_capacity_bytes)
        return "http://127.0.0.1:1"

    def layers_ready(self, n: int) -> None:
        pass

    def set_kv_capacity(self, nbytes: int) -> int:
        assert self.kv is not None
        return self.kv.grant(nbytes)

    def stats(self) -> EngineStats:
        kv = self.kv
        if kv is None:
            return EngineStats()
        used = sum(len(p) for p in self.reqs.values())
        return EngineStats(
            running=len(self.reqs),
            kv_used_bytes=used * kv.page * kv.tp,
            kv_capacity_bytes=kv.capacity_bytes(),
            kv_wanted_bytes=kv.wanted_bytes(),
            kv_geometry=kv.geometry,
        )

    def admit(self, pages: int) -> str | None:
        """A request needing ``pages``: admitted (prefill writes its pages) or waiting."""
        assert self.kv is not None
        self.n += 1
        rid = f"r{self.n}"
        got = self.kv.alloc(rid, pages)
        if got is None:
            self.kv.wait_for_pages(rid, pages)
            return None
        self.reqs[rid] = got
        self.kv.prefill(rid, got)
        for i in range(3):
            self.kv.token(got, i, self.kv.page)
        return rid

    def retry(self) -> None:
        assert self.kv is not None
        for rid, pages in list(self.kv.waiting.items()):
            got = self.kv.alloc(rid, pages)
            if got is not None:
                self.reqs[rid] = got
                self.kv.prefill(rid, got)

    def finish(self, rid: str) -> None:
        assert self.kv is not None
        self.kv.release(rid, self.reqs.pop(rid))

    def stop(self) -> None:
        for m in self.mems.values():
            m.close()
        self.mems = {}


_ROOT: Path | None = None


def _model_root(base: Path) -> Path:
    global _ROOT
    if _ROOT is None or not _ROOT.exists():
        _ROOT = base / "models"
        write_model(_ROOT, "alpha", layers=4, hidden=64, seed=1)
        write_model(_ROOT, "beta", layers=3, hidden=48, seed=2)
        write_model(_ROOT, "gamma", layers=2, hidden=32, seed=3, files=1)
    return _ROOT


class KvNodeMachine(RuleBasedStateMachine):
    base: Path

    def __init__(self) -> None:
        super().__init__()
        self.backend = SimulatedBackend(
            self.base / f"gpus-{os.getpid()}-{id(self)}", page_bytes=PAGE
        )
        self.core = NodeCore(
            MemoryManager(self.backend),
            WeightStore(_model_root(self.base)),
            dict.fromkeys(range(4), 24 * PAGE),
            lambda group: KvEngine(),
            node_name="kv-prop",
            kv_pager_thread=False,
        )
        self.violations = 0
        self.corrupt = 0

    def _engines(self) -> list[tuple[str, KvEngine]]:
        return [(i, inst.engine) for i, inst in self.core.instances.items()]  # type: ignore[misc]

    def _wait_loaders(self) -> None:
        for s in list(self.core.slots.values()):
            if s.loader is not None:
                s.loader.join()

    @staticmethod
    def _pick(data: st.DataObject, ids: list[str]) -> str:
        """One of ``ids`` by position in creation order: ids are random, positions replay the
        same way."""
        return ids[data.draw(st.integers(0, len(ids) - 1))]

    def _event(self, iid: str, kind: EngineEventKind) -> None:
        self.core.lender.on_events({iid: {kind}})

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
            inst, _ = self.core.activate(model, group)
        except Refusal as r:
            assert r.code in {"FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
            return
        assert inst.kv is not None and inst.kv_pages <= inst.kv_pages_initial
        self._wait_loaders()

    @rule(rounds=st.integers(1, 3))
    def pager_step(self, rounds: int) -> None:
        for _ in range(rounds):
            self.core.pager.run_once()

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data(), pages=st.integers(1, 6))
    def request(self, data: st.DataObject, pages: int) -> None:
        iid = self._pick(data, list(self.core.instances))
        eng: KvEngine = self.core.instances[iid].engine  # type: ignore[assignment]
        if eng.kv is None or pages > eng.kv.total:
            return
        if eng.admit(pages) is None:  # no room: the engine tells the agent it waits for KV
            self._event(iid, EngineEventKind.KV_WANTED)

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        iid = self._pick(data, list(self.core.instances))
        eng: KvEngine = self.core.instances[iid].engine  # type: ignore[assignment]
        if eng.reqs:
            eng.finish(self._pick(data, list(eng.reqs)))
            self._event(iid, EngineEventKind.FINISHED)  # Eq. 1 re-checked on completion
        eng.retry()

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data())
    def begin_grace(self, data: st.DataObject) -> None:
        iid = self._pick(data, list(self.core.instances))
        try:
            self.core.begin_grace(iid)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @rule()
    def lend(self) -> None:
        for row in self.core.lendable():
            assert row["reservation_target_bytes"] <= row["kv_capacity_bytes"]

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data(), evict=st.booleans())
    def end(self, data: st.DataObject, evict: bool) -> None:
        iid = self._pick(data, list(self.core.instances))
        eng: KvEngine = self.core.instances[iid].engine  # type: ignore[assignment]
        self._tally(eng)
        try:
            self.core.end_instance(iid, evict_weights=evict)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @precondition(lambda self: bool(self.core.slots))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        sid = self._pick(data, list(self.core.slots))
        try:
            self.core.evict(sid)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @rule(gpu=st.integers(0, 3))
    def worker_crash(self, gpu: int) -> None:
        iid = self.core.gpus[gpu].instance_id
        if iid in self.core.instances:
            self._tally(self.core.instances[iid].engine)  # type: ignore[arg-type]
        self.core.worker_died(gpu)

    def _tally(self, eng: KvEngine) -> None:
        if eng.kv is not None:
            self.violations += eng.kv.violations
            self.corrupt += eng.kv.corrupt

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self._wait_loaders()
        self.core.check()

    @invariant()
    def engines_touch_only_mapped_pages(self) -> None:
        for _, eng in self._engines():
            kv = eng.kv
            if kv is None:
                continue
            assert kv.violations == 0 and kv.corrupt == 0
            held = range(kv.first, kv.first + kv.capacity)
            for m in eng.mems.values():
                m.check_pages(held)  # every page it may touch is mapped to the page it reaches
        assert self.violations == 0 and self.corrupt == 0

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

    def teardown(self) -> None:
        self.core.shutdown()
        self.core.mm.close()


def test_kv_paging_state_machine(tmp_path: Path) -> None:
    KvNodeMachine.base = tmp_path
    run = KvNodeMachine.TestCase()
    run.settings = settings(
        max_examples=40,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    run.runTest()
    assert not list(tmp_path.glob("gpus-*/*.mem")), "simulated GPU files leaked"
    assert not list(tmp_path.glob("gpus-*/*.pt")), "page-table files leaked"
