"""Where the node agents are, and a narrow asyncio port to drive them.

Registry choice: each agent is a cluster-scoped ``GPUNode`` custom resource whose
``spec.agentAddress`` says where its gRPC API listens (the chart's agent DaemonSet pods, or a
local process in tests).  A custom resource rather than a static list or DNS of the DaemonSet:
it works the same for a DaemonSet, a hand-run agent and the e2e test's local processes; a person
can cordon a node (``spec.cordoned``); and its ``status`` is where the operator mirrors what the
agent reports, so ``warmserve status`` and ``kubectl get gpunodes`` need no gRPC access.

The reconciler sees agents only through :class:`AgentPort` and plain snapshot dataclasses, so
its decision-to-action translation is tested with an in-memory fake, without gRPC.

Fencing: :class:`GrpcAgent` sends every mutating call and ``Describe`` with the leadership
term's fencing token (:class:`Fencing`, the :class:`~.leader.Elector`), and reports a refusal of
it back (``Fencing.refused``: the replica stops leading, ``reason=fenced_by_agent``), so the
agent refuses a deposed leader's late calls (:mod:`warmserve_agent.fencing`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .model_spec import CatalogEntry
from .snapshot import (
    ActivateResult,
    AgentCallError,
    FetchView,
    NodeSnapshot,
    SlotView,
    activation_from_pb,
    fetch_from_pb,
    slot_from_pb,
    snapshot_from_pb,
)

log = logging.getLogger("warmserve.operator.agents")


class AgentPort(Protocol):
    """The calls the loop makes on one agent (asyncio).  ``source``: where the node fetches the
    model from first if its store lacks it; ``on_fetch``: called with each :class:`FetchView`
    of that fetch.  :class:`GrpcAgent` and the unit tests' fake take exactly these parameters
    (``tests/operator/test_agent_contract.py``)."""

    async def describe(self) -> NodeSnapshot: ...

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
    ) -> SlotView: ...

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
        *,
        source: str = "",
    ) -> ActivateResult: ...

    async def inspect_model(self, model: str, source: str) -> CatalogEntry:
        """A model's size and layers, from the node's store or its source (no download)."""

    async def begin_grace(self, instance_id: str, request_id: str) -> None: ...

    async def end_instance(
        self, instance_id: str, evict_weights: bool, request_id: str
    ) -> None: ...

    async def close(self) -> None: ...


class Fencing(Protocol):
    """Where agent calls get their fencing token and report its refusal (:class:`~.leader.Elector`;
    :class:`Unfenced` for ``--standalone``)."""

    def token(self) -> int: ...

    def refused(self, token: int) -> None: ...


class Unfenced:
    """No election (``--standalone``, tests): token 0, an unfenced caller."""

    def token(self) -> int:
        return 0

    def refused(self, token: int) -> None:
        log.error("event=call_fenced_unfenced_caller: the agent requires a fencing token")


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
    """:class:`AgentPort` over the agent's gRPC API (``warmserve.api.agent.client``)."""

    def __init__(
        self, node: str, address: str, auth: AgentAuth, fencing: Fencing | None = None
    ) -> None:
        from warmserve.api.agent.client import AgentClient

        self.node = node
        self.address = address
        self.fencing = fencing if fencing is not None else Unfenced()
        self._client = AgentClient(
            address,
            token_file=auth.token_file,
            ca_cert=auth.ca_cert,
            client_cert=auth.client_cert,
            client_key=auth.client_key,
            server_name=auth.server_name,
            timeout_s=auth.timeout_s,
        )

    async def _call(self, call: Callable[[int], Any]) -> Any:
        """``call(fencing_token)``: the client call; a fenced refusal is reported to
        :attr:`fencing` with the token this call carried."""
        from warmserve.api.agent.client import AgentError

        token = self.fencing.token()
        try:
            return await call(token)
        except AgentError as exc:
            err = AgentCallError(exc.code.name, exc.message)
            if err.fenced:
                log.warning("event=call_fenced node=%s token=%d message=%r", self.node, token, err)
                self.fencing.refused(token)
            raise err from None

    async def describe(self) -> NodeSnapshot:
        desc = await self._call(lambda t: self._client.describe(fencing_token=t))
        return snapshot_from_pb(self.node, desc)

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
        def progress(msg: Any) -> None:
            if on_fetch is not None and msg.HasField("fetch"):
                on_fetch(fetch_from_pb(msg.fetch))

        last = await self._call(
            lambda t: self._client.prewarm_wait(
                model,
                gpus,
                layers,
                request_id=request_id,
                owner=owner,
                source=source,
                # A fetch of many GB can take a while; loading itself is bounded by the agent.
                timeout_s=3600.0 if source else 600.0,
                on_progress=progress,
                fencing_token=t,
                engine=engine,
                engine_args=engine_args,
            )
        )
        return slot_from_pb(last.slot)

    async def inspect_model(self, model: str, source: str) -> CatalogEntry:
        m = await self._call(lambda t: self._client.inspect_model(model, source))
        return CatalogEntry(model, int(m.weight_bytes), int(m.num_layers), m.source)

    async def evict(self, slot_id: str, request_id: str) -> None:
        await self._call(
            lambda t: self._client.evict(slot_id, request_id=request_id, fencing_token=t)
        )

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
            lambda t: self._client.activate(
                model,
                gpus,
                slot_id=slot_id,
                request_id=request_id,
                owner=owner,
                engine=engine,
                engine_args=engine_args,
                source=source,
                timeout_s=3600.0 if source else 600.0,
                fencing_token=t,
            )
        )
        return activation_from_pb(resp)

    async def begin_grace(self, instance_id: str, request_id: str) -> None:
        await self._call(
            lambda t: self._client.begin_grace(instance_id, request_id=request_id, fencing_token=t)
        )

    async def end_instance(self, instance_id: str, evict_weights: bool, request_id: str) -> None:
        await self._call(
            lambda t: self._client.end_instance(
                instance_id, evict_weights=evict_weights, request_id=request_id, fencing_token=t
            )
        )

    async def watch(self) -> AsyncIterator[str]:
        """The agent's state-change stream, as event kind names (``KIND_INSTANCE_REMOVED``...)."""
        from warmserve.api.agent.client import pb

        async for ev in self._client.watch(include_snapshot=False):
            yield pb.WatchEvent.Kind.Name(ev.kind)

    async def close(self) -> None:
        await self._client.close()


class AgentPool:
    """One client per GPUNode, re-created when the node's address changes."""

    def __init__(
        self, auth: AgentAuth | None = None, factory: Any = None, fencing: Fencing | None = None
    ) -> None:
        self.auth = auth or AgentAuth()
        self.fencing = fencing if fencing is not None else Unfenced()
        self._factory = factory or (
            lambda node, addr: GrpcAgent(node, addr, self.auth, self.fencing)
        )
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
