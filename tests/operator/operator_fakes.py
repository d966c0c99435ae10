"""In-memory stand-ins for the node agents and the Kubernetes API, for the operator's unit tests.

``FakeAgent`` follows the agent API's contract (warmserve.agent.v1): idempotent request ids,
memory accounting per GPU, prewarm hits when a slot of the model sits on exactly the GPUs,
activation evicting other slots on the group, grace and end.  It is a test double of the
*contract*, not of the real agent's internals; the e2e test runs the real agent.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from warmserve_agent.engines.args import EngineArgsError, validate_engine_args
from warmserve_operator.agents import (
    ActivateResult,
    AgentCallError,
    GpuView,
    InstanceView,
    NodeSnapshot,
    SlotView,
)
from warmserve_operator.kube import ObjRef
from warmserve_operator.spec import CatalogEntry

from warmserve.policy.cluster import GiB, InstancePhase, WorkerState


@dataclass
class _Slot:
    slot_id: str
    model: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    layers: int
    total: int
    active: bool = False


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


class FakeAgent:
    def __init__(
        self,
        node: str,
        gpus: int = 4,
        memory: int = 80 * GiB,
        catalog: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.node = node
        self.memory = memory
        self.n = gpus
        self.catalog = catalog or {}
        self.slots: dict[str, _Slot] = {}
        self.instances: dict[str, _Inst] = {}
        self.generation = 1
        self.agent_id = f"agent-{node}"
        self.ids = itertools.count(1)
        self.done: dict[str, Any] = {}
        self.calls: list[tuple[str, str]] = []
        # (model, gpus) -> (engine, engine args) of the last activation
        self.engine_args: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[str, ...]]] = {}
        self.down = False

    # ------------------------------------------------------------------ helpers
    def _check_up(self) -> None:
        if self.down:
            raise OSError(f"agent {self.node} unreachable")

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
        if rid in self.done:
            prev_key, result = self.done[rid]
            if prev_key != key:
                raise AgentCallError(
                    "ALREADY_EXISTS", f"request id {rid} reused with other arguments"
                )
            return result
        return None

    def set_load(self, model: str, running: int) -> None:
        for i in self.instances.values():
            if i.model == model and i.phase == InstancePhase.SERVING:
                i.running = running
                return
        raise AssertionError(f"no serving instance of {model}")

    # ------------------------------------------------------------------ AgentPort
    async def describe(self) -> NodeSnapshot:
        self._check_up()
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
            )
            for i in self.instances.values()
        )
        models = {m: CatalogEntry(m, w, n) for m, (w, n) in self.catalog.items()}
        return NodeSnapshot(
            self.node, self.agent_id, self.generation, gpus, slots, insts, models, "fake", "0"
        )

    async def prewarm(
        self, model: str, gpus: tuple[int, ...], layers: int, request_id: str
    ) -> SlotView:
        self._check_up()
        self.calls.append(("prewarm", request_id))
        key = ("prewarm", model, gpus, layers)
        if (prev := self._idem(request_id, key)) is not None:
            return prev
        if model not in self.catalog:
            raise AgentCallError("NOT_FOUND", f"unknown model {model}")
        weight, total = self.catalog[model]
        n_layers = layers or total
        per_gpu = -(-weight // len(gpus)) * n_layers // total
        for g in gpus:
            if self._state(g) == WorkerState.DEDICATED:
                raise AgentCallError("FAILED_PRECONDITION", f"gpu {g} is dedicated")
            if self.memory - self._used(g) < per_gpu:
                raise AgentCallError("RESOURCE_EXHAUSTED", f"gpu {g} lacks memory")
        sid = f"slot-{self.node}-{next(self.ids)}"
        self.slots[sid] = _Slot(sid, model, gpus, per_gpu, n_layers, total)
        self.generation += 1
        view = (await self.describe()).slot(sid)
        self.done[request_id] = (key, view)
        return view

    async def evict(self, slot_id: str, request_id: str) -> None:
        self._check_up()
        self.calls.append(("evict", request_id))
        if self._idem(request_id, ("evict", slot_id)) is not None:
            return
        if slot_id not in self.slots or self.slots[slot_id].active:
            raise AgentCallError("NOT_FOUND", f"no slot {slot_id}")
        del self.slots[slot_id]
        self.generation += 1
        self.done[request_id] = (("evict", slot_id), True)

    async def activate(
        self,
        model: str,
        gpus: tuple[int, ...],
        slot_id: str,
        request_id: str,
        engine: str = "",
        engine_args: tuple[str, ...] = (),
    ) -> ActivateResult:
        self._check_up()
        self.calls.append(("activate", request_id))
        try:  # the real agent refuses what the engine-args schema refuses, before any change
            validate_engine_args(engine_args)
        except EngineArgsError as exc:
            raise AgentCallError("INVALID_ARGUMENT", str(exc)) from None
        self.engine_args[(model, gpus)] = (engine, tuple(engine_args))
        key = ("activate", model, gpus, slot_id)
        if (prev := self._idem(request_id, key)) is not None:
            return prev
        for g in gpus:
            if self._state(g) in (WorkerState.DEDICATED, WorkerState.GRACE):
                raise AgentCallError("FAILED_PRECONDITION", f"gpu {g} is serving")
        hit_slot = slot_id or next(
            (s.slot_id for s in self.slots.values() if s.model == model and s.gpus == gpus), ""
        )
        evicted = tuple(
            s.slot_id
            for s in self.slots.values()
            if s.slot_id != hit_slot and set(s.gpus) & set(gpus)
        )
        for sid in evicted:
            del self.slots[sid]
        if not hit_slot:
            weight, total = self.catalog[model]
            hit_slot = f"slot-{self.node}-{next(self.ids)}"
            self.slots[hit_slot] = _Slot(
                hit_slot, model, gpus, -(-weight // len(gpus)), total, total
            )
            hit = False
        else:
            hit = True
        self.slots[hit_slot].active = True
        iid = f"inst-{self.node}-{next(self.ids)}"
        self.instances[iid] = _Inst(iid, model, gpus, hit_slot, hit, engine=engine or "simulated")
        self.generation += 1
        snap = await self.describe()
        inst = next(i for i in snap.instances if i.instance_id == iid)
        res = ActivateResult(inst, hit, 0.1 if hit else 2.0, evicted)
        self.done[request_id] = (key, res)
        return res

    async def begin_grace(self, instance_id: str, request_id: str) -> None:
        self._check_up()
        self.calls.append(("grace", request_id))
        if instance_id not in self.instances:
            raise AgentCallError("NOT_FOUND", f"no instance {instance_id}")
        self.instances[instance_id].phase = InstancePhase.GRACE
        self.generation += 1

    async def end_instance(self, instance_id: str, evict_weights: bool, request_id: str) -> None:
        self._check_up()
        self.calls.append(("end", request_id))
        if self._idem(request_id, ("end", instance_id)) is not None:
            return
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            raise AgentCallError("NOT_FOUND", f"no instance {instance_id}")
        slot = self.slots[inst.slot_id]
        if evict_weights:
            del self.slots[inst.slot_id]
        else:
            slot.active = False
        self.generation += 1
        self.done[request_id] = (("end", instance_id), True)

    async def close(self) -> None:
        return None


@dataclass
class FakeKube:
    """KubePort in memory: objects are dicts as the API returns them."""

    mds: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    configmaps: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    events: list[tuple[str, str, str, str]] = field(default_factory=list)
    leader: bool = True
    status_writes: int = 0

    def add_md(
        self,
        name: str,
        model: str,
        ns: str = "default",
        uid: str | None = None,
        created: str = "2026-01-01T00:00:00Z",
        **spec: Any,
    ) -> None:
        body = {"model": {"name": model}, **spec}
        self.mds[(ns, name)] = {
            "metadata": {
                "name": name,
                "namespace": ns,
                "uid": uid or f"uid-{name}",
                "generation": 1,
                "creationTimestamp": created,
            },
            "spec": body,
        }

    def add_node(self, name: str, address: str = "127.0.0.1:1") -> None:
        self.nodes[name] = {"metadata": {"name": name}, "spec": {"agentAddress": address}}

    def reasons(self, kind_name: str | None = None) -> list[str]:
        return [r for (ref, _t, r, _m) in self.events if kind_name is None or ref == kind_name]

    async def list_model_deployments(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.mds.values()]

    async def list_gpu_nodes(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.nodes.values()]

    async def patch_md_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        if (namespace, name) in self.mds:
            self.status_writes += 1
            self.mds[(namespace, name)]["status"] = {
                **self.mds[(namespace, name)].get("status", {}),
                **status,
            }

    async def patch_node_status(self, name: str, status: dict[str, Any]) -> None:
        if name in self.nodes:
            self.nodes[name]["status"] = status

    async def read_history(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.configmaps.get((namespace, name))

    async def write_history(
        self, namespace: str, name: str, data: dict[str, str], owner_uid: str, owner_name: str
    ) -> None:
        self.configmaps[(namespace, name)] = dict(data)

    async def delete_history(self, namespace: str, name: str) -> None:
        self.configmaps.pop((namespace, name), None)

    async def emit_event(self, ref: ObjRef, type_: str, reason: str, message: str) -> None:
        self.events.append((f"{ref.kind}/{ref.name}", type_, reason, message))

    async def is_leader(self) -> bool:
        return self.leader

    async def sync_agent_nodes(self) -> None:
        return None


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
