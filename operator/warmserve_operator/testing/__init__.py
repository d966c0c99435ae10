"""In-process stand-ins for the node agents, for the operator's tests and the benchmarks.

:class:`FakeAgent` follows the agent API's contract (warmserve.agent.v1) through the operator's
:class:`~warmserve_operator.agents.AgentPort`: idempotent request ids (a replay gets the first
outcome, a reuse with other arguments ALREADY_EXISTS), ids in the agent's formats, memory
accounting per GPU, prewarm hits when a slot of the model sits on exactly the GPUs, activation
evicting other slots on the group, the owner recorded on slots and instances, and the same
refusals as the real agent: EndInstance only for a grace instance, BeginGrace only for a serving
one, no eviction of a serving slot, no prewarm or activation on a serving GPU, nesting of GPU
groups; and fencing tokens (the same :class:`warmserve_agent.fencing.Fence` rule: a call whose
token is lower than the highest seen is refused FAILED_PRECONDITION ``fenced: ...`` and reported
to ``fencing``, as :class:`~warmserve_operator.agents.GrpcAgent` reports it).  It is a test double
of the *contract*, not of the real agent's internals: ``tests/operator/test_agent_contract.py``
runs the same cases against it and the real agent.  :class:`FakeAgents` is a fleet of them, one
per node, that an operator process uses instead of gRPC clients
(``python -m warmserve_operator.testing``).

Not used in production.  Over 400 lines: one class per contract, kept whole so that the
contract test reads against one place.

Over 400 lines: FakeAgent is the agent's whole RPC contract in one class, held against the real
agent by tests/operator/test_agent_contract.py.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from warmserve_agent.fencing import Fence

from warmserve.engine_args import DEFAULT_POLICY, EngineArgsError, validate_engine_args
from warmserve.policy.cluster import GiB, InstancePhase, WorkerState
from warmserve.policy.tensor_parallel import heads_problem
from warmserve_operator.agents import Fencing, Unfenced
from warmserve_operator.model_spec import CatalogEntry, MeasuredProfile
from warmserve_operator.snapshot import (
    ActivateResult,
    AgentCallError,
    FetchView,
    GpuView,
    InstanceView,
    NodeSnapshot,
    SlotView,
)


@dataclass
class _Slot:
    slot_id: str
    model: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    layers: int
    total: int
    active: bool = False
    owner: str = ""
    prepared: tuple[str, tuple[str, ...]] | None = None  # the engine prepared for it at prewarm


@dataclass
class _Inst:
    instance_id: str
    model: str
    gpus: tuple[int, ...]
    slot_id: str
    hit: bool
    phase: InstancePhase = InstancePhase.SERVING
    running: int = 0
    engine: str = ""
    ttft: tuple[float, int] = (0.0, 0)  # (p95 seconds, samples) the engine reports
    owner: str = ""
    grace_started: float = 0.0


class FakeAgent:
    def __init__(
        self,
        node: str,
        gpus: int = 4,
        memory: int = 80 * GiB,
        catalog: dict[str, tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.time,
        remote: dict[str, tuple[int, int]] | None = None,
        fencing: Fencing | None = None,
        require_fencing_token: bool = False,
    ) -> None:
        self.node = node
        self.fencing = fencing if fencing is not None else Unfenced()
        self.fence = Fence(require_token=require_fencing_token)
        self.memory = memory
        self.n = gpus
        self.catalog = catalog or {}
        self.heads: dict[str, tuple[int, int]] = {}  # model -> (attention, KV heads) declared
        self.clock = clock
        # Model sources this agent can fetch from: source URI -> (weight bytes, layers).
        self.remote = remote or {}
        self.fetched: list[tuple[str, str]] = []
        self.inspected: list[tuple[str, str]] = []  # (model, source) of InspectModel calls
        self.fetched_from: dict[str, str] = {}  # model -> source, reported as the real agent does
        self.profiles: dict[str, MeasuredProfile] = {}  # model -> what Describe reports measured
        self.slots: dict[str, _Slot] = {}
        self.instances: dict[str, _Inst] = {}
        self.generation = 1
        self.agent_id = f"agent-{node}"
        self.ids = itertools.count(1)
        self.done: dict[str, Any] = {}
        self.calls: list[tuple[str, str]] = []
        # (model, gpus) -> (engine, engine args) of the last activation
        self.engine_args: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[str, ...]]] = {}
        self.engine_policy = DEFAULT_POLICY  # the agent's --allow-engine-arg
        self.down = False

    # ------------------------------------------------------------------ helpers
    def _check_up(self) -> None:
        if self.down:
            raise OSError(f"agent {self.node} unreachable")

    def _fenced(self, method: str) -> None:
        """The agent's first check on every mutating call and Describe."""
        token = self.fencing.token()
        verdict = self.fence.check(method, token, read=method == "Describe")
        if verdict.refused is not None:
            self.fencing.refused(token)
            raise AgentCallError("FAILED_PRECONDITION", self.fence.message(method, token, verdict))

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self.ids):012x}"

    def _used(self, g: int) -> int:
        return sum(s.bytes_per_gpu for s in self.slots.values() if g in s.gpus and not s.active)

    def _state(self, g: int) -> WorkerState:
        for i in self.instances.values():
            if g in i.gpus:
                return (
                    WorkerState.GRACE if i.phase == InstancePhase.GRACE else WorkerState.DEDICATED
                )
        return (
            WorkerState.UNIVERSAL
            if any(g in s.gpus for s in self.slots.values())
            else WorkerState.IDLE
        )

    def _idem(self, rid: str, key: tuple[Any, ...]) -> Any:
        if not rid:
            raise AgentCallError("INVALID_ARGUMENT", "request_id is required")
        if rid in self.done:
            prev_key, result = self.done[rid]
            if prev_key != key:
                raise AgentCallError(
                    "ALREADY_EXISTS", f"request id {rid} reused with other arguments"
                )
            if isinstance(result, AgentCallError):
                raise result
            return result
        return None

    def _refuse(self, rid: str, key: tuple[Any, ...], code: str, message: str) -> None:
        err = AgentCallError(code, message)
        self.done[rid] = (key, err)  # a replay gets the same refusal, as at the real agent
        raise err

    def _group(self, rid: str, key: tuple[Any, ...], gpus: tuple[int, ...]) -> tuple[int, ...]:
        if not gpus or len(set(gpus)) != len(gpus) or any(not 0 <= g < self.n for g in gpus):
            self._refuse(rid, key, "INVALID_ARGUMENT", f"bad GPU group {list(gpus)}")
        return tuple(sorted(gpus))

    def _check_owner(self, rid: str, key: tuple[Any, ...], owner: str) -> None:
        if len(owner) > 128:
            self._refuse(rid, key, "INVALID_ARGUMENT", "owner longer than 128 characters")

    def set_load(self, model: str, running: int) -> None:
        for i in self.instances.values():
            if i.model == model and i.phase == InstancePhase.SERVING:
                i.running = running
                return
        raise AssertionError(f"no serving instance of {model}")

    # ------------------------------------------------------------------ AgentPort
    async def describe(self) -> NodeSnapshot:
        self._check_up()
        self._fenced("Describe")
        gpus = tuple(
            GpuView(
                g,
                self.memory,
                0 if self._state(g) == WorkerState.DEDICATED else self.memory - self._used(g),
                self._state(g),
                tuple(s.slot_id for s in self.slots.values() if g in s.gpus),
                next((i.instance_id for i in self.instances.values() if g in i.gpus), ""),
            )
            for g in range(self.n)
        )
        slots = tuple(
            SlotView(
                s.slot_id,
                s.model,
                s.gpus,
                s.layers,
                s.total,
                s.layers,
                s.bytes_per_gpu,
                s.bytes_per_gpu * s.total // max(s.layers, 1),
                "active" if s.active else "ready",
                s.owner,
            )
            for s in self.slots.values()
        )
        insts = tuple(
            InstanceView(
                i.instance_id,
                i.model,
                i.gpus,
                f"http://127.0.0.1:9/{i.instance_id}",
                i.phase,
                running=i.running,
                max_batch=4,
                kv_capacity_bytes=GiB,
                prewarm_hit=i.hit,
                slot_id=i.slot_id,
                engine=i.engine,
                ttft_p95_s=i.ttft[0],
                ttft_samples=i.ttft[1],
                ttft_window_s=300.0 if i.ttft[1] else 0.0,
                owner=i.owner,
                grace_started_unix=i.grace_started,
            )
            for i in self.instances.values()
        )
        models = {
            m: CatalogEntry(
                m, w, n, self.fetched_from.get(m, ""), profile=self.profiles.get(m),
                heads=self.heads.get(m, (0, 0))[0], kv_heads=self.heads.get(m, (0, 0))[1],
            )
            for m, (w, n) in self.catalog.items()
        }
        return NodeSnapshot(
            self.node, self.agent_id, self.generation, gpus, slots, insts, models, "fake", "0"
        )

    def _fetch(
        self,
        request_id: str,
        key: tuple[Any, ...],
        model: str,
        source: str,
        on_fetch: Callable[[FetchView], Any] | None = None,
    ) -> None:
        """As the real agent: a model missing from the store is fetched from ``source`` before
        the call's own work; a failed fetch is not remembered for the request id (a replay
        tries the fetch again), as at the real agent."""
        if model in self.catalog or not source:
            return
        if source not in self.remote:
            raise AgentCallError("FAILED_PRECONDITION", f"{source}: repository not found")
        weight, layers = self.remote[source]
        if on_fetch is not None:
            on_fetch(FetchView(model, source, "downloading", 0, weight, attempt=1))
        self.catalog[model] = (weight, layers)
        self.fetched.append((model, source))
        self.fetched_from[model] = source
        if on_fetch is not None:
            on_fetch(FetchView(model, source, "done", weight, weight, attempt=1))

    async def inspect_model(self, model: str, source: str) -> CatalogEntry:
        self._check_up()
        self.inspected.append((model, source))
        if model in self.catalog:
            w, n = self.catalog[model]
        elif source in self.remote:
            w, n = self.remote[source]
        else:
            raise AgentCallError("FAILED_PRECONDITION", f"{source}: repository not found")
        return CatalogEntry(model, w, n, source)

    def _check_tp(
        self, request_id: str, key: tuple[Any, ...], model: str, group: Any, engine: str
    ) -> None:
        """The real agent's refusal of a vLLM tensor-parallel group the heads cannot split."""
        heads, kv = self.heads.get(model, (0, 0))
        why = heads_problem(len(group), heads, kv or heads) if heads else None
        if engine == "vllm" and len(group) > 1 and why:
            msg = f"engine 'vllm' cannot serve tensorParallel={len(group)}: model {model}: {why}"
            self._refuse(request_id, key, "FAILED_PRECONDITION", msg)

    async def prewarm(
        self,
        model: str,
        gpus: tuple[int, ...],
        layers: int,
        request_id: str,
        owner: str = "",
        *,
        source: str = "",
        on_fetch: Callable[[FetchView], Any] | None = None,
        engine: str = "",
        engine_args: tuple[str, ...] = (),
    ) -> SlotView:
        self._check_up()
        self._fenced("Prewarm")
        self.calls.append(("prewarm", request_id))
        key = ("prewarm", model, tuple(sorted(gpus)), layers, owner, source, engine, engine_args)
        if (prev := self._idem(request_id, key)) is not None:
            return prev
        self._check_owner(request_id, key, owner)
        group = self._group(request_id, key, gpus)
        try:  # the real agent checks the engine and its arguments first, as Activate's
            validate_engine_args(engine_args, self.engine_policy)
        except EngineArgsError as exc:
            self._refuse(request_id, key, "INVALID_ARGUMENT", str(exc))
        self._fetch(request_id, key, model, source, on_fetch)
        if model not in self.catalog:
            self._refuse(request_id, key, "NOT_FOUND", f"unknown model {model}")
        self._check_tp(request_id, key, model, group, engine)
        weight, total = self.catalog[model]
        if layers < 0 or layers > total:
            self._refuse(request_id, key, "INVALID_ARGUMENT", f"layers must be 0..{total}")
        n_layers = layers or total
        per_gpu = -(-weight // len(group)) * n_layers // total
        for g in group:
            if self._state(g) == WorkerState.DEDICATED:
                self._refuse(request_id, key, "FAILED_PRECONDITION", f"gpu {g} is dedicated")
        for s in self.slots.values():
            a, b = set(group), set(s.gpus)
            if a & b and not (a <= b or b <= a):
                self._refuse(request_id, key, "FAILED_PRECONDITION", "groups must nest")
            if s.model == model and a & b:
                self._refuse(request_id, key, "FAILED_PRECONDITION", f"{model} already resident")
        for g in group:
            if self.memory - self._used(g) < per_gpu:
                self._refuse(request_id, key, "RESOURCE_EXHAUSTED", f"gpu {g} lacks memory")
        sid = self._new_id("slot")
        self.slots[sid] = _Slot(
            sid,
            model,
            group,
            per_gpu,
            n_layers,
            total,
            owner=owner,
            prepared=(engine or "simulated", tuple(engine_args)),
        )
        self.generation += 1
        view = (await self.describe()).slot(sid)
        self.done[request_id] = (key, view)
        return view

    async def evict(self, slot_id: str, request_id: str) -> None:
        self._check_up()
        self._fenced("Evict")
        self.calls.append(("evict", request_id))
        key = ("evict", slot_id)
        if self._idem(request_id, key) is not None:
            return
        if not slot_id.startswith("slot-"):
            self._refuse(request_id, key, "INVALID_ARGUMENT", f"malformed slot id {slot_id!r}")
        if slot_id not in self.slots:
            self._refuse(request_id, key, "NOT_FOUND", f"no slot {slot_id}")
        if self.slots[slot_id].active:
            self._refuse(
                request_id,
                key,
                "FAILED_PRECONDITION",
                f"slot {slot_id} is serving; end the instance first",
            )
        del self.slots[slot_id]
        self.generation += 1
        self.done[request_id] = (key, True)

    async def activate(
        self,
        model: str,
        gpus: tuple[int, ...],
        slot_id: str,
        request_id: str,
        owner: str = "",
        engine: str = "",
        engine_args: tuple[str, ...] = (),
        *,
        source: str = "",
    ) -> ActivateResult:
        self._check_up()
        self._fenced("Activate")
        self.calls.append(("activate", request_id))
        key = (
            "activate",
            model,
            tuple(sorted(gpus)),
            slot_id,
            owner,
            source,
            engine,
            tuple(engine_args),
        )
        if (prev := self._idem(request_id, key)) is not None:
            return prev
        self._check_owner(request_id, key, owner)
        group = self._group(request_id, key, gpus)
        try:  # the real agent refuses what the schema or its allowlist refuses, before any change
            validate_engine_args(engine_args, self.engine_policy)
        except EngineArgsError as exc:
            self._refuse(request_id, key, "INVALID_ARGUMENT", str(exc))
        self._fetch(request_id, key, model, source)
        if model not in self.catalog:
            self._refuse(request_id, key, "NOT_FOUND", f"unknown model {model}")
        self._check_tp(request_id, key, model, group, engine)
        for g in group:
            if self._state(g) in (WorkerState.DEDICATED, WorkerState.GRACE):
                self._refuse(request_id, key, "FAILED_PRECONDITION", f"gpu {g} is serving")
        if slot_id:
            chosen = self.slots.get(slot_id)
            if chosen is None:
                self._refuse(request_id, key, "NOT_FOUND", f"no slot {slot_id}")
            if chosen.model != model or chosen.gpus != group:
                self._refuse(request_id, key, "FAILED_PRECONDITION", "slot holds another group")
        hit_slot = slot_id or next(
            (s.slot_id for s in self.slots.values() if s.model == model and s.gpus == group), ""
        )
        evicted = tuple(
            s.slot_id
            for s in self.slots.values()
            if s.slot_id != hit_slot and set(s.gpus) & set(group)
        )
        for sid in evicted:
            del self.slots[sid]
        prepared = hit_slot and self.slots[hit_slot].prepared == (
            engine or "simulated",
            tuple(engine_args),
        )
        if not hit_slot:
            weight, total = self.catalog[model]
            hit_slot = self._new_id("slot")
            self.slots[hit_slot] = _Slot(
                hit_slot, model, group, -(-weight // len(group)), total, total
            )
            hit = False
        else:
            hit = True
        self.slots[hit_slot].active = True
        self.slots[hit_slot].owner = owner
        iid = self._new_id("inst")
        self.instances[iid] = _Inst(
            iid, model, group, hit_slot, hit, owner=owner, engine=engine or "simulated"
        )
        self.engine_args[(model, group)] = (engine, tuple(engine_args))
        self.generation += 1
        snap = await self.describe()
        inst = next(i for i in snap.instances if i.instance_id == iid)
        stages = (
            ("process", 0.0),
            ("engine", 0.0 if prepared else 1.0),
            ("weights", 0.0),
            ("KV", 0.01),
            ("endpoint", 0.05),
        )
        res = ActivateResult(inst, hit, 0.1 if hit else 2.0, evicted, stages, bool(prepared))
        self.done[request_id] = (key, res)
        return res

    def _instance(self, rid: str, key: tuple[Any, ...], instance_id: str) -> _Inst:
        if not instance_id.startswith("inst-"):
            self._refuse(rid, key, "INVALID_ARGUMENT", f"malformed instance id {instance_id!r}")
        inst = self.instances.get(instance_id)
        if inst is None:
            self._refuse(rid, key, "NOT_FOUND", f"no instance {instance_id}")
        return inst

    async def begin_grace(self, instance_id: str, request_id: str) -> None:
        self._check_up()
        self._fenced("BeginGrace")
        self.calls.append(("grace", request_id))
        key = ("grace", instance_id)
        if self._idem(request_id, key) is not None:
            return
        inst = self._instance(request_id, key, instance_id)
        if inst.phase != InstancePhase.SERVING:
            self._refuse(
                request_id,
                key,
                "FAILED_PRECONDITION",
                f"instance {instance_id} is {inst.phase.value}; only a serving instance can "
                "begin a grace period",
            )
        inst.phase = InstancePhase.GRACE
        inst.grace_started = self.clock()
        self.generation += 1
        self.done[request_id] = (key, True)

    async def end_instance(self, instance_id: str, evict_weights: bool, request_id: str) -> None:
        self._check_up()
        self._fenced("EndInstance")
        self.calls.append(("end", request_id))
        key = ("end", instance_id, evict_weights)
        if self._idem(request_id, key) is not None:
            return
        inst = self._instance(request_id, key, instance_id)
        if inst.phase != InstancePhase.GRACE:
            self._refuse(
                request_id,
                key,
                "FAILED_PRECONDITION",
                f"instance {instance_id} is {inst.phase.value}; begin its grace period first "
                "(BeginGrace) so in-flight requests drain",
            )
        del self.instances[instance_id]
        slot = self.slots[inst.slot_id]
        if evict_weights:
            del self.slots[inst.slot_id]
        else:
            slot.active = False
        self.generation += 1
        self.done[request_id] = (key, True)

    async def watch(self) -> Any:
        """The agent's Watch stream, coarsely: a KIND_SLOT event whenever its state changed."""
        import asyncio

        seen = self.generation
        while True:
            await asyncio.sleep(0.05)
            if self.generation != seen:
                seen = self.generation
                yield "KIND_SLOT"

    async def close(self) -> None:
        return None


class FakeAgents:
    """The agents of a whole cluster for one operator process: ``nodes`` maps a GPUNode's name
    to (GPUs, bytes per GPU); every agent starts with ``catalog`` (model -> (weight bytes,
    layers)) in its store.  :meth:`connect` is how the operator's agent pool reaches a node in
    place of a gRPC client; a GPUNode with no agent here answers every call as an unreachable
    agent does."""

    def __init__(
        self, nodes: Mapping[str, tuple[int, int]], catalog: Mapping[str, tuple[int, int]]
    ) -> None:
        self.nodes = dict(nodes)
        self.catalog = dict(catalog)
        self.agents: dict[str, FakeAgent] = {}

    def connect(self, node: str, address: str, fencing: Fencing) -> FakeAgent:
        """The node's agent (one per node, whatever its address), calling with ``fencing``'s
        tokens, as :class:`~warmserve_operator.agents.GrpcAgent` does."""
        agent = self.agents.get(node)
        if agent is None:
            gpus, memory = self.nodes.get(node, (0, 0))
            agent = FakeAgent(node, gpus, memory, dict(self.catalog), fencing=fencing)
            agent.down = node not in self.nodes
            self.agents[node] = agent
        agent.fencing = fencing
        return agent

    def to_json(self) -> str:
        return json.dumps(
            {
                "nodes": {n: {"gpus": g, "memory": m} for n, (g, m) in self.nodes.items()},
                "catalog": {m: [w, n] for m, (w, n) in self.catalog.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str) -> FakeAgents:
        """The inverse of :meth:`to_json`; a malformed document is a ``ValueError``."""
        try:
            doc = json.loads(text)
            nodes = {str(n): (int(v["gpus"]), int(v["memory"])) for n, v in doc["nodes"].items()}
            catalog = {str(m): (int(w), int(n)) for m, (w, n) in doc["catalog"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a FakeAgents document: {exc!r}") from exc
        return cls(nodes, catalog)
