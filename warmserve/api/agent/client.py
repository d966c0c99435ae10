"""Client for the node agent's gRPC API (``warmserve.agent.v1``).

:class:`AgentClient` is asyncio (``grpc.aio``) because the operator is kopf/asyncio;
:class:`SyncAgentClient` wraps it for the CLI and scripts.  Both return the generated protobuf
messages (``warmserve.api.agent.v1.agent_pb2``) so callers see every field the agent reports.

Every mutating call (and ``describe``) takes an optional ``fencing_token`` (the operator's
leadership term, checked by the agent's fence; 0: unfenced).  Every mutating call takes an
optional ``request_id``; pass the same id when retrying after a lost
answer and the agent returns the first result without redoing the work (idempotency).  When
omitted, a fresh id is generated (retries are then *not* deduplicated).

Failures raise :class:`~.errors.AgentError` carrying the gRPC status code and the agent's
message, e.g. ``AgentError(NOT_FOUND, "unknown model 'x': the weight store has ...")``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from warmserve.api.agent.errors import AgentError
from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.api.agent.v1 import agent_pb2_grpc as pb_grpc

__all__ = ["AgentClient", "AgentError", "SyncAgentClient", "new_request_id", "pb"]


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _wrap(exc: grpc.aio.AioRpcError) -> AgentError:
    return AgentError(exc.code(), exc.details() or "")


class _TokenAuth(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context: Any, callback: Any) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)


class AgentClient:
    """asyncio client.  Use as ``async with AgentClient("127.0.0.1:50051") as c: ...``.

    TLS: pass ``ca_cert`` (PEM path of the CA that signed the agent's certificate) and, for mutual
    TLS, ``client_cert``/``client_key``.  ``token`` (or ``token_file``) adds the bearer token;
    without TLS it is sent as plain metadata (loopback/dev only).
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        ca_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if token_file is not None:
            token = Path(token_file).read_text().strip()
        self.address = address
        self.timeout_s = timeout_s
        self._token = token
        options: list[tuple[str, Any]] = []
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if ca_cert is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=Path(ca_cert).read_bytes(),
                private_key=Path(client_key).read_bytes() if client_key else None,
                certificate_chain=Path(client_cert).read_bytes() if client_cert else None,
            )
            if token:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.metadata_call_credentials(_TokenAuth(token))
                )
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
            self._metadata: tuple[tuple[str, str], ...] = ()
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
            self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = pb_grpc.NodeAgentStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await method(
                request, metadata=self._metadata, timeout=timeout_s or self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise _wrap(exc) from None

    async def health(self, service: str = "") -> str:
        """Standard gRPC health: "SERVING" / "NOT_SERVING" / ... ("" = the whole agent)."""
        resp = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def describe(self, *, fencing_token: int = 0) -> pb.NodeDescription:
        return await self._unary(
            self._stub.Describe, pb.DescribeRequest(fencing_token=fencing_token)
        )

    async def prewarm(
        self,
        model: str,
        gpus: Sequence[int],
        layers: int = 0,
        *,
        request_id: str | None = None,
        timeout_s: float | None = 600.0,
        source: str = "",
        owner: str = "",
        fencing_token: int = 0,
        engine: str = "",
        engine_args: Sequence[str] = (),
    ) -> AsyncIterator[pb.PrewarmProgress]:
        """Stream progress of loading ``model`` (first ``layers``, 0 = all) onto ``gpus``.

        With ``source``, a model missing from the node's store is fetched first (messages with
        ``fetch`` set, no slot yet).  The last message has ``done=True`` and the final
        :class:`SlotInfo`.  ``engine``/``engine_args``: what the slot will be activated with
        (its worker prepares that engine meanwhile).
        """
        req = pb.PrewarmRequest(
            request_id=request_id or new_request_id("prewarm"),
            model=model,
            gpus=list(gpus),
            layers=layers,
            source=source,
            owner=owner,
            fencing_token=fencing_token,
            engine=engine,
            engine_args=list(engine_args),
        )
        call = self._stub.Prewarm(req, metadata=self._metadata, timeout=timeout_s)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise _wrap(exc) from None

    async def prewarm_wait(
        self,
        model: str,
        gpus: Sequence[int],
        layers: int = 0,
        *,
        request_id: str | None = None,
        source: str = "",
        timeout_s: float | None = 600.0,
        on_progress: Callable[[pb.PrewarmProgress], Any] | None = None,
        owner: str = "",
        fencing_token: int = 0,
        engine: str = "",
        engine_args: Sequence[str] = (),
    ) -> pb.PrewarmProgress:
        """Prewarm and return the final progress message (``.slot`` is the resident slot)."""
        last: pb.PrewarmProgress | None = None
        async for msg in self.prewarm(
            model,
            gpus,
            layers,
            request_id=request_id,
            source=source,
            timeout_s=timeout_s,
            owner=owner,
            fencing_token=fencing_token,
            engine=engine,
            engine_args=engine_args,
        ):
            last = msg
            if on_progress is not None:
                on_progress(msg)
        if last is None:  # pragma: no cover - the server always sends a final message
            raise AgentError(grpc.StatusCode.UNKNOWN, "prewarm stream ended without a message")
        return last

    async def evict(
        self, slot_id: str, *, request_id: str | None = None, fencing_token: int = 0
    ) -> pb.EvictResponse:
        req = pb.EvictRequest(
            request_id=request_id or new_request_id("evict"),
            slot_id=slot_id,
            fencing_token=fencing_token,
        )
        return await self._unary(self._stub.Evict, req)

    async def activate(
        self,
        model: str,
        gpus: Sequence[int],
        *,
        slot_id: str = "",
        engine: str = "",
        engine_args: Sequence[str] = (),
        request_id: str | None = None,
        timeout_s: float | None = 600.0,
        source: str = "",
        owner: str = "",
        fencing_token: int = 0,
    ) -> pb.ActivateResponse:
        req = pb.ActivateRequest(
            request_id=request_id or new_request_id("activate"),
            model=model,
            gpus=list(gpus),
            slot_id=slot_id,
            source=source,
            engine=engine,
            engine_args=list(engine_args),
            owner=owner,
            fencing_token=fencing_token,
        )
        return await self._unary(self._stub.Activate, req, timeout_s)

    async def begin_grace(
        self, instance_id: str, *, request_id: str | None = None, fencing_token: int = 0
    ) -> pb.BeginGraceResponse:
        req = pb.BeginGraceRequest(
            request_id=request_id or new_request_id("grace"),
            instance_id=instance_id,
            fencing_token=fencing_token,
        )
        return await self._unary(self._stub.BeginGrace, req)

    async def end_instance(
        self,
        instance_id: str,
        *,
        evict_weights: bool = False,
        request_id: str | None = None,
        fencing_token: int = 0,
    ) -> pb.EndInstanceResponse:
        req = pb.EndInstanceRequest(
            request_id=request_id or new_request_id("end"),
            instance_id=instance_id,
            evict_weights=evict_weights,
            fencing_token=fencing_token,
        )
        return await self._unary(self._stub.EndInstance, req)

    async def lendable(self, instance_ids: Iterable[str] = ()) -> pb.LendableResponse:
        return await self._unary(
            self._stub.GetLendable, pb.LendableRequest(instance_ids=list(instance_ids))
        )

    async def inspect_model(self, model: str, source: str = "") -> pb.ModelInfo:
        """Layers and weight bytes of ``model`` (from the store, else from ``source``)."""
        return await self._unary(
            self._stub.InspectModel, pb.InspectModelRequest(model=model, source=source)
        )

    async def watch(self, include_snapshot: bool = True) -> AsyncIterator[pb.WatchEvent]:
        """Server-streaming state changes; runs until the caller stops iterating."""
        call = self._stub.Watch(
            pb.WatchRequest(include_snapshot=include_snapshot), metadata=self._metadata
        )
        try:
            async for ev in call:
                yield ev
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise _wrap(exc) from None
        finally:
            call.cancel()


class SyncAgentClient:
    """Blocking wrapper over :class:`AgentClient` for the CLI (owns a private event loop)."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client: AgentClient = self._loop.run_until_complete(self._make(address, kwargs))

    @staticmethod
    async def _make(address: str, kwargs: dict[str, Any]) -> AgentClient:
        return AgentClient(address, **kwargs)

    def __enter__(self) -> SyncAgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def health(self, service: str = "") -> str:
        return self._run(self._client.health(service))

    def describe(self) -> pb.NodeDescription:
        return self._run(self._client.describe())

    def prewarm(
        self, model: str, gpus: Sequence[int], layers: int = 0, **kw: Any
    ) -> Iterator[pb.PrewarmProgress]:
        agen = self._client.prewarm(model, gpus, layers, **kw)
        while True:
            try:
                yield self._run(agen.__anext__())
            except StopAsyncIteration:
                return

    def prewarm_wait(self, model: str, gpus: Sequence[int], layers: int = 0, **kw: Any) -> Any:
        return self._run(self._client.prewarm_wait(model, gpus, layers, **kw))

    def inspect_model(self, model: str, source: str = "") -> pb.ModelInfo:
        return self._run(self._client.inspect_model(model, source))

    def evict(self, slot_id: str, **kw: Any) -> pb.EvictResponse:
        return self._run(self._client.evict(slot_id, **kw))

    def activate(self, model: str, gpus: Sequence[int], **kw: Any) -> pb.ActivateResponse:
        return self._run(self._client.activate(model, gpus, **kw))

    def begin_grace(self, instance_id: str, **kw: Any) -> pb.BeginGraceResponse:
        return self._run(self._client.begin_grace(instance_id, **kw))

    def end_instance(self, instance_id: str, **kw: Any) -> pb.EndInstanceResponse:
        return self._run(self._client.end_instance(instance_id, **kw))

    def lendable(self, instance_ids: Iterable[str] = ()) -> pb.LendableResponse:
        return self._run(self._client.lendable(instance_ids))
