"""Fetching models into the node's weight store on demand, for the RPCs that name a ``source``.

``Prewarm`` and ``Activate`` with a ``source`` first make the model present through the
:class:`~warmserve_agent.sources.fetcher.ModelFetcher` (coalesced, verified, under the store's
LRU budget), streaming its progress; the model is pinned (never evicted) from the fetch until its
slot holds it.  ``InspectModel`` answers a model's layers and bytes from the store or its source,
which the operator needs before placing it (the slot layout, §4.1).

:class:`FetchCoordinator` is held by the servicer (:class:`~warmserve_agent.service.AgentService`)
and handed to the prewarm and instance handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.sources.fetch_records import FetchFailed
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.sources.wire import fetch_pb
from warmserve_agent.store import StoreError, UnknownModel


class FetchCoordinator:
    """Fetch-before-use and ``InspectModel`` (see module docstring)."""

    def __init__(self, core: NodeCore, fetcher: ModelFetcher | None) -> None:
        self.core = core
        self.fetcher = fetcher

    # ---- fetching models into the store ----------------------------------------------------
    def pin(self, model: str) -> contextlib.AbstractContextManager[None]:
        """Never evict ``model`` from the store inside this block (fetch until its slot)."""
        return self.fetcher.pinned(model) if self.fetcher else contextlib.nullcontext()

    def touch(self, model: str) -> None:
        """Mark ``model`` used now (LRU order of the store's eviction)."""
        if self.fetcher is not None:
            self.fetcher.touch(model)

    async def fetch(
        self, model: str, source: str, gpus: list[int] | None, context: Any
    ) -> AsyncIterator[pb.FetchInfo]:
        """Make ``model`` present (fetching it from ``source``), yielding progress while a fetch
        runs; aborts the RPC with the fetch's status code when it fails."""
        if self.fetcher is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this agent has no model fetcher"
            )
        assert self.fetcher is not None
        try:
            if gpus is not None:
                self.core.check_gpus(gpus)  # refuse a bad request before a long fetch
            fetch = await asyncio.to_thread(self.fetcher.ensure, model, source)
        except Refusal as r:
            await context.abort(grpc.StatusCode[r.code], r.message)
        except FetchFailed as f:
            await context.abort(grpc.StatusCode[f.code], f.message)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        last = None
        while True:
            st = fetch.status
            if st is not last and st.started_unix:  # nothing to report for a model present
                last = st
                yield fetch_pb(st)
            if (fetch.done.is_set() and fetch.status is last) or not st.started_unix:
                break
            await asyncio.sleep(0.25)
        if fetch.error is not None:
            await context.abort(grpc.StatusCode[fetch.error.code], fetch.error.message)

    async def inspect_model(self, request: pb.InspectModelRequest, context: Any) -> pb.ModelInfo:
        if self.fetcher is None or (not request.source and not self.core.store.has(request.model)):
            try:
                m = await asyncio.to_thread(self.core.store.model, request.model)
            except StoreError as exc:
                code = "NOT_FOUND" if isinstance(exc, UnknownModel) else "INVALID_ARGUMENT"
                await context.abort(grpc.StatusCode[code], str(exc))
            return pb.ModelInfo(
                name=request.model,
                num_layers=m.num_layers,
                weight_bytes=m.weight_bytes,
                num_tensors=len(m.tensors),
                max_batch=m.profile.max_batch,
            )
        try:
            facts = await asyncio.to_thread(self.fetcher.inspect, request.model, request.source)
        except FetchFailed as f:
            await context.abort(grpc.StatusCode[f.code], f.message)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ModelInfo(
            name=request.model,
            num_layers=facts.num_layers,
            weight_bytes=facts.weight_bytes,
            num_tensors=facts.num_tensors,
            max_batch=facts.max_batch,
            source=request.source,
        )
