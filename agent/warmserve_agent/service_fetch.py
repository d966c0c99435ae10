"""Fetching models into the node's weight store on demand, for the RPCs that name a ``source``.

``Prewarm`` and ``Activate`` with a ``source`` first make the model present through the
:class:`~warmserve_agent.sources.fetcher.ModelFetcher` (coalesced, verified, under the store's
LRU budget), streaming its progress; the model is pinned (never evicted) from the fetch until its
slot holds it.  ``InspectModel`` answers a model's layers and bytes from the store or its source,
which the operator needs before placing it (the slot layout, §4.1).

A layer of :class:`~warmserve_agent.service.AgentService` (see that module's docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from warmserve_agent.api.v1 import agent_pb2 as pb
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Refusal
from warmserve_agent.sources.fetch_records import FetchFailed
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.sources.wire import fetch_pb
from warmserve_agent.store import StoreError


class ModelFetching:
    """Fetch-before-use and ``InspectModel`` (see module docstring); the state is set by
    :class:`~warmserve_agent.service.AgentService`."""

    core: NodeCore
    fetcher: ModelFetcher | None

    # ---- fetching models into the store ----------------------------------------------------
    def _pin(self, model: str) -> contextlib.AbstractContextManager[None]:
        return self.fetcher.pinned(model) if self.fetcher else contextlib.nullcontext()

    async def _fetch(
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
                with self.core._lock:
                    self.core._check_gpus(gpus)  # refuse a bad request before a long fetch
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

    async def InspectModel(self, request: pb.InspectModelRequest, context: Any) -> pb.ModelInfo:
        if self.fetcher is None or (not request.source and not self.core.store.has(request.model)):
            try:
                m = await asyncio.to_thread(self.core.store.model, request.model)
            except StoreError as exc:
                code = "NOT_FOUND" if "unknown model" in str(exc) else "INVALID_ARGUMENT"
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
