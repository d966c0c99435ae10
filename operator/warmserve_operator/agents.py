"""Where the node agents are, and a narrow asyncio port to drive them.

Registry choice: each agent is a cluster-scoped ``GPUNode`` custom resource whose
``spec.agentAddress`` says where its gRPC API listens (the chart's agent DaemonSet pods, or a
local process in tests).  A custom resource rather than a static list or DNS of the DaemonSet:
it works the same for a DaemonSet, a hand-run agent and the e2e test's local processes; a person
can cordon a node (``spec.cordoned``); and its ``status`` is where the operator mirrors what the
agent reports, so ``warmserve status`` and ``kubectl get gpunodes`` need no gRPC access.

The reconciler sees agents only through :class:`AgentPort` and plain snapshot dataclasses, so
its decision-to-action translation is tested with an in-memory fake, without gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from warmserve_agent.wire import SlotState, instance_phase, slot_state, worker_state

from warmserve.policy.cluster import InstancePhase, WorkerState

from .spec import CatalogEntry

log = logging.getLogger("warmserve.operator.agents")



class AgentCallError(Exception):
    """An agent refused or failed a call; ``code`` is the gRPC status name (e.g. NOT_FOUND)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    memory_bytes: int
    free_bytes: int
    state: WorkerState
    slot_ids: tuple[str, ...] = ()
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class SlotView:
    slot_id: str
    model: str
    gpus: tuple[int, ...]
    layers_resident: int
    layers_total: int
    layers_target: int
    resident_bytes_per_gpu: int
    weight_bytes_per_gpu: int
    state: SlotState
    owner: str = ""  # the owning ModelDeployment's UID ("" : set by no operator / older agent)

    @property
    def target_bytes_per_gpu(self) -> int:
        """Bytes per GPU the slot holds once loaded (what placement must account for)."""
        if self.layers_total <= 0:
            return self.resident_bytes_per_gpu
        target = self.layers_target or self.layers_total
        return max(
            self.resident_bytes_per_gpu, self.weight_bytes_per_gpu * target // self.layers_total
        )


@dataclass(frozen=True, slots=True)
class InstanceView:
    instance_id: str
    model: str
    gpus: tuple[int, ...]
    endpoint: str
    phase: InstancePhase
    running: int = 0
    waiting: int = 0
    max_batch: int = 0
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    lendable_bytes: int = 0
    lent_bytes: int = 0
    prewarm_hit: bool = False
    slot_id: str = ""
    started_unix: float = 0.0
    engine: str = ""
    ttft_p95_s: float = 0.0  # the engine's p95 TTFT over its window (ttft_samples requests)
    ttft_samples: int = 0
    ttft_window_s: float = 0.0
    owner: str = ""  # the owning ModelDeployment's UID (see SlotView.owner)
    grace_started_unix: float = 0.0  # agent clock; 0 when not in grace or unknown

    @property
    def load(self) -> int:
        """Requests in flight at this instance (running + queued), the paper's load (§2.2)."""
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class FetchView:
    """A model being fetched into a node's store from its source (agent's FetchInfo)."""

    model: str
    source: str
    state: str  # listing | downloading | verifying | done | failed
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0
    eta_s: float = 0.0
    attempt: int = 0
    message: str = ""
    started_unix: float = 0.0


_FETCH = {1: "listing", 2: "downloading", 3: "verifying", 4: "done", 5: "failed"}


def fetch_from_pb(f: Any) -> FetchView:
    return FetchView(
        model=f.model,
        source=f.source,
        state=_FETCH.get(int(f.state), "listing"),
        bytes_done=int(f.bytes_done),
        bytes_total=int(f.bytes_total),
        bytes_per_s=float(f.bytes_per_second),
        eta_s=float(f.eta_seconds),
        attempt=int(f.attempt),
        message=f.message,
        started_unix=float(f.started_unix),
    )


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What one agent reported in one Describe call."""

    node: str  # the GPUNode name
    agent_id: str
    generation: int
    gpus: tuple[GpuView, ...]
    slots: tuple[SlotView, ...] = ()
    instances: tuple[InstanceView, ...] = ()
    models: Mapping[str, CatalogEntry] = field(default_factory=dict)
    backend: str = ""
    version: str = ""
    fetches: tuple[FetchView, ...] = ()
    store: tuple[int, int, int] = (0, 0, 0)  # used bytes, budget bytes (0: none), evictions

    def slot(self, slot_id: str) -> SlotView | None:
        return next((s for s in self.slots if s.slot_id == slot_id), None)


def snapshot_from_pb(node: str, desc: Any) -> NodeSnapshot:
    """Convert a ``warmserve.agent.v1.NodeDescription`` into a :class:`NodeSnapshot`."""
    gpus = tuple(
        GpuView(
            index=int(g.index),
            memory_bytes=int(g.memory_bytes),
            free_bytes=min(int(g.free_bytes), int(g.memory_bytes)),
            state=worker_state(int(g.state)),
            slot_ids=tuple(g.slot_ids),
            instance_id=g.instance_id,
        )
        for g in desc.gpus
    )
    slots = tuple(
        SlotView(
            slot_id=s.slot_id,
            model=s.model,
            gpus=tuple(sorted(int(x) for x in s.gpus)),
            layers_resident=int(s.layers_resident),
            layers_total=int(s.layers_total),
            layers_target=int(s.layers_target),
            resident_bytes_per_gpu=int(s.resident_bytes_per_gpu),
            weight_bytes_per_gpu=int(s.weight_bytes_per_gpu),
            state=slot_state(int(s.state)),
            owner=s.owner,
        )
        for s in desc.slots
    )
    instances = tuple(
        InstanceView(
            instance_id=i.instance_id,
            model=i.model,
            gpus=tuple(sorted(int(x) for x in i.gpus)),
            endpoint=i.endpoint,
            phase=instance_phase(int(i.phase)),
            running=int(i.running),
            waiting=int(i.waiting),
            max_batch=int(i.max_batch),
            kv_capacity_bytes=int(i.kv_capacity_bytes),
            kv_used_bytes=int(i.kv_used_bytes),
            lendable_bytes=int(i.lendable_bytes),
            lent_bytes=int(i.lent_bytes),
            prewarm_hit=bool(i.prewarm_hit),
            slot_id=i.slot_id,
            started_unix=float(i.started_unix),
            engine=getattr(i, "engine", ""),
            ttft_p95_s=float(getattr(i, "ttft_p95_seconds", 0.0)),
            ttft_samples=int(getattr(i, "ttft_samples", 0)),
            ttft_window_s=float(getattr(i, "ttft_window_seconds", 0.0)),
            owner=i.owner,
            grace_started_unix=float(i.grace_started_unix),
        )
        for i in desc.instances
    )
    models = {
        m.name: CatalogEntry(
            m.name,
            int(m.weight_bytes),
            int(m.num_layers),
            getattr(m, "source", ""),
            int(getattr(m, "disk_bytes", 0)),
        )
        for m in desc.models
    }
    store = getattr(desc, "store", None)
    return NodeSnapshot(
        node=node,
        agent_id=desc.agent_id,
        generation=int(desc.generation),
        gpus=gpus,
        slots=slots,
        instances=instances,
        models=models,
        backend=desc.backend,
        version=desc.agent_version,
        fetches=tuple(fetch_from_pb(f) for f in getattr(desc, "fetches", ())),
        store=(
            (int(store.used_bytes), int(store.budget_bytes), int(store.evictions))
            if store is not None
            else (0, 0, 0)
        ),
    )


@dataclass(frozen=True, slots=True)
class ActivateResult:
    instance: InstanceView
    hit: bool
    activation_s: float
    evicted_slot_ids: tuple[str, ...] = ()


class AgentPort(Protocol):
    """The calls the reconciler makes on one agent (asyncio)."""

    async def describe(self) -> NodeSnapshot: ...

    async def prewarm(
        self,
        model: str,
        gpus: tuple[int, ...],
        layers: int,
        request_id: str,
        owner: str = "",
    ) -> SlotView:
        """Also takes ``source=`` (fetch the model first if the node lacks it) and
        ``on_fetch=`` (called with each :class:`FetchView` while it is fetched)."""

    async def evict(self, slot_id: str, request_id: str) -> None: ...

    async def activate(
        self,
        model: str,
        gpus: tuple[int, ...],
        slot_id: str,
        request_id: str,
        owner: str = "",
        engine: str = "",
        engine_args: tuple[str, ...] = (),
    ) -> ActivateResult:
        """Also takes ``source=`` (fetch the model first if the node lacks it)."""

    async def inspect_model(self, model: str, source: str) -> CatalogEntry:
        """A model's size and layers, from the node's store or its source (no download)."""

    async def begin_grace(self, instance_id: str, request_id: str) -> None: ...

    async def end_instance(
        self, instance_id: str, evict_weights: bool, request_id: str
    ) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AgentAuth:
    """How the operator authenticates to agents (token and/or TLS), from the operator's flags."""

    token_file: str | None = None
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None
    timeout_s: float = 10.0


class GrpcAgent:
    """:class:`AgentPort` over the agent's gRPC API (``warmserve_agent.client.AgentClient``)."""

    def __init__(self, node: str, address: str, auth: AgentAuth) -> None:
        from warmserve_agent.client import AgentClient

        self.node = node
        self.address = address
        self._client = AgentClient(
            address,
            token_file=auth.token_file,
            ca_cert=auth.ca_cert,
            client_cert=auth.client_cert,
            client_key=auth.client_key,
            server_name=auth.server_name,
            timeout_s=auth.timeout_s,
        )

    async def _call(self, coro: Any) -> Any:
        from warmserve_agent.client import AgentError

        try:
            return await coro
        except AgentError as exc:
            raise AgentCallError(exc.code.name, exc.message) from None

    async def describe(self) -> NodeSnapshot:
        return snapshot_from_pb(self.node, await self._call(self._client.describe()))

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
    ) -> SlotView:
        def progress(msg: Any) -> None:
            if on_fetch is not None and msg.HasField("fetch"):
                on_fetch(fetch_from_pb(msg.fetch))

        last = await self._call(
            self._client.prewarm_wait(
                model,
                gpus,
                layers,
                request_id=request_id,
                owner=owner,
                source=source,
                # A fetch of many GB can take a while; loading itself is bounded by the agent.
                timeout_s=3600.0 if source else 600.0,
                on_progress=progress,
            )
        )
        snap = snapshot_from_pb(self.node, _FakeDesc(slots=[last.slot]))
        return snap.slots[0]

    async def inspect_model(self, model: str, source: str) -> CatalogEntry:
        m = await self._call(self._client.inspect_model(model, source))
        return CatalogEntry(model, int(m.weight_bytes), int(m.num_layers), m.source)

    async def evict(self, slot_id: str, request_id: str) -> None:
        await self._call(self._client.evict(slot_id, request_id=request_id))

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
        resp = await self._call(
            self._client.activate(
                model,
                gpus,
                slot_id=slot_id,
                request_id=request_id,
                owner=owner,
                engine=engine,
                engine_args=engine_args,
                source=source,
                timeout_s=3600.0 if source else 600.0,
            )
        )
        inst = snapshot_from_pb(self.node, _FakeDesc(instances=[resp.instance])).instances[0]
        return ActivateResult(
            inst,
            bool(resp.prewarm_hit),
            float(resp.activation_seconds),
            tuple(resp.evicted_slot_ids),
        )

    async def begin_grace(self, instance_id: str, request_id: str) -> None:
        await self._call(self._client.begin_grace(instance_id, request_id=request_id))

    async def end_instance(self, instance_id: str, evict_weights: bool, request_id: str) -> None:
        await self._call(
            self._client.end_instance(
                instance_id, evict_weights=evict_weights, request_id=request_id
            )
        )

    async def watch(self) -> AsyncIterator[str]:
        """The agent's state-change stream, as event kind names (``KIND_INSTANCE_REMOVED``...)."""
        from warmserve_agent.client import pb

        async for ev in self._client.watch(include_snapshot=False):
            yield pb.WatchEvent.Kind.Name(ev.kind)

    async def close(self) -> None:
        await self._client.close()


@dataclass
class _FakeDesc:
    """A NodeDescription-shaped holder, to reuse :func:`snapshot_from_pb` for single messages."""

    slots: list[Any] = field(default_factory=list)
    instances: list[Any] = field(default_factory=list)
    gpus: list[Any] = field(default_factory=list)
    models: list[Any] = field(default_factory=list)
    agent_id: str = ""
    generation: int = 0
    backend: str = ""
    agent_version: str = ""


class AgentPool:
    """One client per GPUNode, re-created when the node's address changes."""

    def __init__(self, auth: AgentAuth | None = None, factory: Any = None) -> None:
        self.auth = auth or AgentAuth()
        self._factory = factory or (lambda node, addr: GrpcAgent(node, addr, self.auth))
        self._clients: dict[str, tuple[str, AgentPort]] = {}

    def get(self, node: str, address: str) -> AgentPort:
        cur = self._clients.get(node)
        if cur is not None and cur[0] == address:
            return cur[1]
        if cur is not None:
            _close_later(cur[1])
        client = self._factory(node, address)
        self._clients[node] = (address, client)
        return client

    def forget_except(self, nodes: set[str]) -> None:
        for name in list(self._clients):
            if name not in nodes:
                _close_later(self._clients.pop(name)[1])

    async def close(self) -> None:
        for _, client in self._clients.values():
            await client.close()
        self._clients.clear()


def _close_later(client: AgentPort) -> None:
    try:
        asyncio.get_running_loop().create_task(client.close())
    except RuntimeError:  # no loop: nothing to close asynchronously
        log.debug("event=agent_close_skipped reason=no_loop")
