"""Idempotent mutating calls of the agent's gRPC service, and how every refusal leaves it.

Every mutating call carries a ``request_id``.  The first call with an id runs (in a thread:
loading and engine start-up block); a replay with the same id and the same arguments waits for /
returns the first outcome (the same answer, or the same error) without redoing the work; the same
id with different arguments is refused with ALREADY_EXISTS.  The last ``max_request_ids`` ids are
remembered.  This is what lets the operator retry any call after a lost answer without doubling a
prewarm or an activation (the executor never re-decides; it repeats).

A :class:`~warmserve_agent.node_records.Refusal` carries the gRPC status name and a message a
person can act on; it becomes ``context.abort(code, message)`` through :func:`abort`, which bounds
the message (printable, at most 1 KiB, :mod:`~warmserve_agent.safe_text`).

:class:`IdempotentCalls` is the table of remembered ids; the servicer
(:class:`~warmserve_agent.service.AgentService`) holds one and hands it to the prewarm and
instance handlers.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from warmserve_agent.fencing import Fence, enforce
from warmserve_agent.node_records import ID_RE, Refusal
from warmserve_agent.safe_text import bounded, shown

log = logging.getLogger("warmserve.agent.service")  # one logger for the whole service


@dataclass
class IdemEntry:
    """One remembered request id: its method, its arguments and its (future) outcome."""

    method: str
    fingerprint: tuple[Any, ...]
    future: asyncio.Future[Any]
    final: Any = None  # Prewarm: the last progress message sent


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Every refusal leaves through here: the message bounded and printable."""
    await context.abort(code, bounded(message))


class IdempotentCalls:
    """Request-id checks and run-once semantics (see module docstring)."""

    def __init__(self, fence: Fence, max_request_ids: int = 10000) -> None:
        self.fence = fence
        self.max_request_ids = max_request_ids
        self._entries: OrderedDict[str, IdemEntry] = OrderedDict()

    @staticmethod
    async def check_request_id(rid: str, context: grpc.aio.ServicerContext) -> None:
        if not rid:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id is required: send a unique id per intended action and reuse it "
                "when retrying",
            )
        if not ID_RE.match(rid):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed request_id {rid[:40]!r}: use 1-128 characters of [A-Za-z0-9._:-]",
            )

    async def once(
        self,
        method: str,
        rid: str,
        fingerprint: tuple[Any, ...],
        context: grpc.aio.ServicerContext,
        fn: Callable[[], Any],
        token: int = 0,
    ) -> tuple[Any, IdemEntry]:
        """Run ``fn`` in a thread once per request id; replays get the first outcome.  The
        caller's fencing ``token`` is checked first (:mod:`~warmserve_agent.fencing`), replays
        included: a deposed leader learns it is deposed.  It is not part of the fingerprint: a
        new leader repeating its predecessor's request id gets the first outcome."""
        await enforce(self.fence, method, token, context)
        await self.check_request_id(rid, context)
        entry = self._entries.get(rid)
        if entry is not None:
            if entry.method != method or entry.fingerprint != fingerprint:
                await abort(
                    context,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {rid} was already used for a different request "
                    f"({entry.method} {shown(entry.fingerprint, 160)}); use a new id for a new "
                    "action",
                )
        else:
            # The work runs in its own task: a caller that disconnects (cancelling this RPC)
            # does not cancel it, and replays of the id still get its outcome.
            task: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(fn))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # mark retrieved
            entry = IdemEntry(method, fingerprint, task)
            self._entries[rid] = entry
            while len(self._entries) > self.max_request_ids:
                self._entries.popitem(last=False)
        try:
            return await asyncio.shield(entry.future), entry
        except Refusal as r:
            await abort(context, grpc.StatusCode[r.code], r.message)
        except Exception as exc:
            log.exception("event=internal_error method=%s", method)
            await abort(context, grpc.StatusCode.INTERNAL, f"{method} failed: {exc}")
        raise AssertionError("unreachable")  # pragma: no cover - abort raises
