"""The node agent's state machine with real vLLM activations (group ``vllm``, slow).

The same kind of stateful property test as tests/agent/test_agent_state_machine.py — random
prewarm (whole or first N layers) / activate / grace / lend / end / evict / worker crash on
simulated GPUs, with the page-table and worker-state invariants after every step — but every
activation starts the real ``vllm`` engine over the slot, and additionally:

* prewarms name the engine and its arguments, so slots' workers prepare vLLM's engine while
  they wait (at most one per GPU, never on a serving GPU, gone with its slot);
* every activation serves exactly the greedy tokens plain vLLM gives for that model, whether its
  engine was prepared or built;
* every vLLM parameter is a view of its slot's weights, the KV cache lies after them;
* the prewarmed weights of every slot stay byte-identical to the store (vLLM writes its KV cache
  into the same slot and must never touch the weights).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.engines.spec import PreparedState
from warmserve_agent.loader import verify_layers
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.store import WeightStore

from tests.engines.test_vllm_engine import ARGS, PROMPT, REF_SCRIPT, _check_inside_slot, _env
from tests.engines.test_vllm_engine import _tokens as tokens_of
from warmserve.policy.cluster import WorkerState

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

PAGE = 64 * 1024
MODELS = {"llama-a": (4, 1), "llama-b": (2, 2)}  # name -> (layers, seed)


def _reference(model_dir: Path) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", REF_SCRIPT, str(model_dir), json.dumps(PROMPT), "8"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("TOKENS ")), None)
    assert line, out.stderr[-3000:]
    return json.loads(line[7:])


class VllmNodeMachine(RuleBasedStateMachine):
    root: Path
    base: Path
    refs: dict[str, list[int]]
    runs = 0
    activations = 0  # vLLM engines started over a slot, over all runs
    prepared_activations = 0  # of them, those whose engine was prepared at prewarm

    def __init__(self) -> None:
        super().__init__()
        VllmNodeMachine.runs += 1
        self.backend = SimulatedBackend(self.base / f"gpus-{self.runs}", page_bytes=PAGE)
        self.core = NodeCore(
            MemoryManager(self.backend),
            WeightStore(self.root),
            dict.fromkeys(range(2), 40 * 1024**2),
            lambda group: InProcessEngine(group),
            node_name="prop-vllm",
            engines=("vllm",),
        )

    def _wait_loaders(self) -> None:
        for s in list(self.core.slots.values()):
            if s.loader is not None:
                s.loader.join()
        self.core.preparer.settle(600)

    @rule(model=st.sampled_from(sorted(MODELS)), gpu=st.integers(0, 1), layers=st.integers(0, 4))
    def prewarm(self, model: str, gpu: int, layers: int) -> None:
        try:
            self.core.prewarm(model, [gpu], layers, engine="vllm", engine_args=ARGS)
        except Refusal as r:
            assert r.code in {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
        self._wait_loaders()

    @rule(model=st.sampled_from(sorted(MODELS)), gpu=st.integers(0, 1))
    def activate(self, model: str, gpu: int) -> None:
        try:
            inst, _ = self.core.activate(model, [gpu], engine="vllm", engine_args=ARGS)
        except Refusal as r:
            assert r.code in {"FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
            return
        VllmNodeMachine.activations += 1
        VllmNodeMachine.prepared_activations += inst.stages.engine_prepared
        assert tokens_of(inst.endpoint, 8, model) == self.refs[model]
        _check_inside_slot(inst.engine.engine)
        self._wait_loaders()

    @rule(model=st.sampled_from(sorted(MODELS)), gpu=st.integers(0, 1), layers=st.integers(0, 4))
    def prewarm_then_activate(self, model: str, gpu: int, layers: int) -> None:
        """A prewarm hit with its engine prepared (random rules rarely line up)."""
        self.prewarm(model, gpu, layers)
        self.activate(model, gpu)

    @rule(model=st.sampled_from(sorted(MODELS)), gpu=st.integers(0, 1))
    def activate_too(self, model: str, gpu: int) -> None:
        """Activations are what this machine is for: twice the odds of the other rules."""
        self.activate(model, gpu)

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data())
    def begin_grace(self, data: st.DataObject) -> None:
        iid = data.draw(st.sampled_from(sorted(self.core.instances)))
        try:
            self.core.begin_grace(iid)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @rule()
    def lend(self) -> None:
        for row in self.core.lendable():
            inst = self.core.instances[row["instance_id"]]
            assert row["reservation_target_bytes"] <= row["kv_capacity_bytes"]
            assert inst.kv_pages * PAGE >= inst.engine.stats().kv_used_bytes

    @precondition(lambda self: bool(self.core.instances))
    @rule(data=st.data(), evict=st.booleans())
    def end(self, data: st.DataObject, evict: bool) -> None:
        iid = data.draw(st.sampled_from(sorted(self.core.instances)))
        try:
            self.core.end_instance(iid, evict_weights=evict)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @precondition(lambda self: bool(self.core.slots))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.core.slots)))
        try:
            self.core.evict(sid)
        except Refusal as r:
            assert r.code == "FAILED_PRECONDITION"

    @rule(gpu=st.integers(0, 1))
    def worker_crash(self, gpu: int) -> None:
        self.core.worker_died(gpu)

    @invariant()
    def consistent(self) -> None:
        self._wait_loaders()
        self.core.check()

    @invariant()
    def prepared_engines(self) -> None:
        self._wait_loaders()
        live = {
            sid: rec
            for sid, rec in self.core.preparer.prepared.items()
            if rec.report.state in (PreparedState.PREPARING, PreparedState.READY)
        }
        gpus = [rec.gpu for rec in live.values()]
        assert len(gpus) == len(set(gpus)), "two prepared engines for one worker"
        for sid, rec in live.items():
            assert sid in self.core.slots
            assert self.core.gpus[rec.gpu].state not in (WorkerState.DEDICATED, WorkerState.GRACE)

    @invariant()
    def weights_intact(self) -> None:
        store = self.core.store
        for s in list(self.core.slots.values()):
            digests = [store.digests(s.layout, 0)]
            bad = verify_layers(
                lambda r, o, n, s=s: self.core.mm.read(s.slot_id, s.gpus[r], o, n),
                s.layout,
                digests,
                [0],
                s.layers_resident,
            )
            assert not bad, f"slot {s.slot_id} ({s.model}) corrupted: {bad}"
            need = math.ceil(s.layout.bytes_for_layers(s.layers_resident) / PAGE)
            assert self.core.mm.mapped_prefix(s.slot_id, s.gpus[0]) >= need

    def teardown(self) -> None:
        self.core.shutdown()
        self.core.mm.close()


def test_node_state_machine_with_vllm(tmp_path: Path) -> None:
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama

    root = tmp_path / "models"
    for name, (layers, seed) in MODELS.items():
        make_tiny_llama(root / name, layers=layers, hidden=128, seed=seed)
    VllmNodeMachine.root = root
    VllmNodeMachine.base = tmp_path
    VllmNodeMachine.refs = {name: _reference(root / name) for name in MODELS}
    run = VllmNodeMachine.TestCase()
    run.settings = settings(
        max_examples=3,
        stateful_step_count=10,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    run.runTest()
    assert VllmNodeMachine.runs >= 3 and VllmNodeMachine.activations >= 3
    assert VllmNodeMachine.prepared_activations >= 1, "no activation used a prepared engine"
    assert not list(tmp_path.glob("gpus-*/*.mem")), "simulated GPU files leaked"
