"""Holding: per-model FIFO queues in front of the instances, with caps (docs/gateway.md
"Holding").

A request for a model goes straight to an instance with room (:mod:`.routing`) when nobody is
queued for that model; otherwise it waits at the end of the model's queue.  Whenever room
appears (a request finished, an instance started serving, an ejection ran out) the head of the
queue is dispatched first, so requests leave in arrival order.  Caps:

* per model and replica: ``spec.gateway.maxQueue`` held requests, never more than the caps
  below (a deployment cannot claim more than its namespace or the replica has) — one more gets
  :class:`QueueFull` (429);
* per namespace (the deployment's; a tenant) and replica: ``max_held_per_namespace``
  (``--max-held-per-namespace``) over all its models — :class:`QueueFull` (429);
* per API key and replica: ``max_held_per_key`` (``--max-held-per-key``) over every model the
  key's requests wait for — :class:`QueueFull` (429); requests without a key are not counted
  per key (the namespace cap still holds them);
* per replica: ``max_held`` over all models (``--max-held``) — :class:`QueueFull` (429);
* per request: ``spec.gateway.maxHoldSeconds`` from its arrival — :class:`HoldTimeout` (503);
* at the end of a replica's drain, :meth:`Dispatcher.shed` answers every held request (and every
  later one) with the rejection it is given, and gives back their model, namespace and key counts.

A held request whose client disconnects is cancelled (aiohttp cancels the handler) and leaves
the queue at once; its count goes down immediately, so the demand the operator reads never
includes it.  Every change of a model's held count is reported to ``on_held`` (the demand
tracker).

Invariant (tested): after every operation, a model's queue is empty or none of its instances
has room.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .catalog import Deployment
from .routing import Endpoint, has_room, pick


class Rejected(Exception):
    """A request the gateway answers itself; ``status``/``code`` go into the OpenAI error."""

    status = 503
    code = "unavailable"
    kind = "server_error"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class QueueFull(Rejected):
    status = 429
    code = "queue_full"
    kind = "rate_limit_error"


class HoldTimeout(Rejected):
    status = 503
    code = "hold_timeout"


class NotServable(Rejected):
    status = 503
    code = "model_unavailable"


class ModelGone(Rejected):
    status = 404
    code = "model_not_found"
    kind = "invalid_request_error"


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future[Endpoint]
    avoid: frozenset[str]
    key: str = ""  # the API key's id ("": no key)
    queued: bool = True


@dataclass(slots=True)
class ModelState:
    """One model's routes, queue and counts at this replica."""

    model: str
    dep: Deployment
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    queue: deque[_Waiter] = field(default_factory=deque)
    held: int = 0
    inflight: int = 0
    pump_at: asyncio.TimerHandle | None = None


class Dispatcher:
    """All models' queues at one gateway replica."""

    def __init__(
        self,
        max_held: int = 10_000,
        on_held: Callable[[str, int], None] | None = None,
        on_left: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_after_full_s: int = 1,
        retry_after_timeout_s: int = 5,
        max_held_per_namespace: int | None = None,
        max_held_per_key: int | None = None,
    ) -> None:
        for name, v in (
            ("max_held", max_held),
            ("max_held_per_namespace", max_held_per_namespace),
            ("max_held_per_key", max_held_per_key),
        ):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        self.max_held = max_held
        self.max_held_per_namespace = max_held_per_namespace
        self.max_held_per_key = max_held_per_key
        self.held_total = 0
        self.held_by_namespace: dict[str, int] = {}
        self.held_by_key: dict[str, int] = {}
        self.models: dict[str, ModelState] = {}
        self._on_held = on_held or (lambda m, n: None)
        self._on_left = on_left or (lambda m: None)
        self.clock = clock
        self.retry_after_full_s = retry_after_full_s
        self.retry_after_timeout_s = retry_after_timeout_s
        self._shed: Callable[[], Rejected] | None = None  # draining: nothing is held any more

    # ---- routes ----

    def update(self, model: str, dep: Deployment | None) -> None:
        """The deployment serving ``model`` changed (instances, caps) or went away.  Another
        deployment taking the model over (the old one deleted, a newer duplicate now served)
        is the old one going away: its held requests were sent to *it* (maybe by another
        tenant's callers) and fail with 404; they never go to the new one."""
        st = self.models.get(model)
        if st is not None and dep is not None and st.dep.key != dep.key:
            self.update(model, None)
            st = None
        if dep is None:
            if st is None:
                return
            del self.models[model]
            if st.pump_at is not None:
                st.pump_at.cancel()
            gone = ModelGone(
                f"model {model!r} is no longer served (its ModelDeployment was deleted)"
            )
            for w in st.queue:
                if w.queued and not w.fut.done():
                    w.queued = False
                    self._held(st, -1, w.key)
                    w.fut.set_exception(gone)
            st.queue.clear()
            return
        if st is None:
            st = self.models[model] = ModelState(model, dep)
        st.dep = dep
        eps: dict[str, Endpoint] = {}
        for inst in dep.serving:
            old = st.endpoints.get(inst.instance_id)
            eps[inst.instance_id] = (
                old
                if old is not None and old.url == inst.url
                else Endpoint(inst.instance_id, inst.url)
            )
        st.endpoints = eps
        self._pump(st)

    def state(self, model: str) -> ModelState | None:
        return self.models.get(model)

    # ---- requests ----

    def queue_cap(self, st: ModelState) -> int:
        """``spec.gateway.maxQueue``, clamped to the replica's and the namespace's caps."""
        cap = min(st.dep.spec.max_queue, self.max_held)
        if self.max_held_per_namespace is not None:
            cap = min(cap, self.max_held_per_namespace)
        return cap

    def _full(self, st: ModelState, key: str) -> QueueFull | None:
        """The cap one more held request would exceed, if any (module docstring)."""
        ns = st.dep.spec.namespace
        cap = self.queue_cap(st)
        if st.held >= cap:
            why = (
                f"the deployment's spec.gateway.maxQueue is {st.dep.spec.max_queue}"
                if cap == st.dep.spec.max_queue
                else f"the gateway caps this model's queue at {cap}"
            )
            return QueueFull(f"model {st.model!r}: {st.held} requests already held, {why}",
                             self.retry_after_full_s)  # fmt: skip
        per_ns = self.max_held_per_namespace
        if per_ns is not None and self.held_by_namespace.get(ns, 0) >= per_ns:
            return QueueFull(
                f"namespace {ns!r} already holds {per_ns} requests at this gateway replica, its "
                "limit (--max-held-per-namespace)",
                self.retry_after_full_s,
            )
        per_key = self.max_held_per_key
        if key and per_key is not None and self.held_by_key.get(key, 0) >= per_key:
            return QueueFull(
                f"your API key already has {per_key} requests held at this gateway replica, its "
                "limit (--max-held-per-key)",
                self.retry_after_full_s,
            )
        if self.held_total >= self.max_held:
            return QueueFull(
                f"the gateway holds {self.held_total} requests, its limit (--max-held)",
                self.retry_after_full_s,
            )
        return None

    async def acquire(
        self,
        st: ModelState,
        deadline: float,
        avoid: frozenset[str] = frozenset(),
        key: str = "",
    ) -> Endpoint:
        """An endpoint with room for one request (counted as outstanding there), waiting in the
        model's queue until ``deadline`` (monotonic) if none has room now.  ``key``: the id of
        the caller's API key (per-key cap).  Raises :class:`Rejected` subclasses; a cancelled
        caller leaves the queue."""
        if self._shed is not None:
            raise self._shed()
        if not st.held:
            ep = pick(st.endpoints.values(), st.dep.spec.max_batch, self.clock(), avoid)
            if ep is not None:
                self._take(st, ep)
                return ep
        why = st.dep.unservable()
        if why:
            raise NotServable(why, self.retry_after_timeout_s)
        full = self._full(st, key)
        if full is not None:
            raise full
        w = _Waiter(asyncio.get_running_loop().create_future(), avoid, key)
        st.queue.append(w)
        self._held(st, +1, key)
        got = False
        try:
            async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                ep = await w.fut
            got = True
            return ep
        except TimeoutError:
            raise HoldTimeout(
                f"model {st.model!r}: no instance had room within "
                f"spec.gateway.maxHoldSeconds ({st.dep.spec.max_hold_s:g} s)",
                self._retry_after(st),
            ) from None
        except asyncio.CancelledError:
            if w.queued:
                self._on_left(st.model)
            raise
        finally:
            if w.queued:
                w.queued = False
                self._held(st, -1, key)
            elif not got and w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                # Dispatched in the same instant as the timeout/cancellation: give it back.
                self.release(st, w.fut.result())

    def shed(self, rejection: Callable[[], Rejected]) -> int:
        """Answer every held request with ``rejection()``, and every later request too (the end
        of a drain); returns how many were held."""
        self._shed = rejection
        shed = 0
        for st in self.models.values():
            for w in st.queue:
                if w.queued and not w.fut.done():
                    w.queued = False
                    self._held(st, -1, w.key)
                    w.fut.set_exception(rejection())
                    shed += 1
            st.queue.clear()
        return shed

    def release(self, st: ModelState, ep: Endpoint) -> None:
        """A request forwarded to ``ep`` finished (or was never sent)."""
        ep.outstanding -= 1
        st.inflight -= 1
        if st.held:
            self._pump(st)

    def eject(self, st: ModelState, ep: Endpoint, seconds: float) -> None:
        """``ep`` failed a connection: no new request for ``seconds`` (then the queue moves)."""
        ep.ejected_until = self.clock() + seconds
        loop = asyncio.get_running_loop()
        if st.pump_at is not None:
            st.pump_at.cancel()
        st.pump_at = loop.call_later(seconds, self._pump, st)

    # ---- internals ----

    def _retry_after(self, st: ModelState) -> int:
        return max(1, min(self.retry_after_timeout_s, math.ceil(st.dep.spec.max_hold_s)))

    def _take(self, st: ModelState, ep: Endpoint) -> None:
        ep.outstanding += 1
        st.inflight += 1

    def _held(self, st: ModelState, delta: int, key: str) -> None:
        st.held += delta
        self.held_total += delta
        ns = st.dep.spec.namespace
        n = self.held_by_namespace.get(ns, 0) + delta
        if n:
            self.held_by_namespace[ns] = n
        else:
            self.held_by_namespace.pop(ns, None)
        if key:
            k = self.held_by_key.get(key, 0) + delta
            if k:
                self.held_by_key[key] = k
            else:
                self.held_by_key.pop(key, None)
        self._on_held(st.model, st.held)

    def _pump(self, st: ModelState) -> None:
        """Dispatch the head of the queue while an instance has room."""
        now = self.clock()
        mb = st.dep.spec.max_batch
        while st.queue:
            w = st.queue[0]
            if not w.queued or w.fut.done():
                st.queue.popleft()
                continue
            ep = pick(st.endpoints.values(), mb, now, w.avoid)
            if ep is None:
                return
            st.queue.popleft()
            w.queued = False
            self._take(st, ep)
            w.fut.set_result(ep)
            self._held(st, -1, w.key)

    def check_invariant(self, st: ModelState) -> bool:
        """Queue empty, or no endpoint has room (tests)."""
        live = sum(1 for w in st.queue if w.queued)
        if live != st.held:
            return False
        now = self.clock()
        return live == 0 or not any(
            has_room(e, st.dep.spec.max_batch, now) for e in st.endpoints.values()
        )
