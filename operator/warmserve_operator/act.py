"""Act: carry the controller's decisions out as agent calls — one dispatch (:func:`call`).

Decisions arrive typed (:mod:`warmserve.control.decisions`); each becomes exactly one agent
call with a deterministic request id (:func:`.identity.request_id`) and, for prewarms and
starts, the owning deployment's UID.  Calls run as background tasks (a cold start can take a
minute); until the agent reports their effect the :class:`Actor` keeps them as *pending* so the
next observation shows them (:mod:`.observe`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from warmserve.control.decisions import Decision, Drain, EndGrace, Evict, Prewarm, Start

from . import tracing
from .agents import ActivateResult, AgentPort
from .identity import gpus_str, request_id
from .metrics import Metrics
from .observe import PendingPrewarm, PendingStart
from .snapshot import AgentCallError, NodeSnapshot
from .sources import fetch_event
from .spec import ModelDeploymentSpec

log = logging.getLogger("warmserve.operator")

VERB = {Start: "activate", Drain: "grace", EndGrace: "end", Prewarm: "prewarm", Evict: "evict"}


def subject(d: Decision) -> str:
    if isinstance(d, Drain | EndGrace):
        return d.instance_id
    if isinstance(d, Evict):
        return d.slot_id
    return gpus_str(d.gpus)


def rid(d: Decision, snap: NodeSnapshot | None) -> str:
    agent_id, gen = (snap.agent_id, snap.generation) if snap else ("", 0)
    return request_id(VERB[type(d)], d.model, d.node, subject(d), agent_id, gen)


async def call(
    client: AgentPort,
    d: Decision,
    request: str,
    owner: str = "",
    md: ModelDeploymentSpec | None = None,
    on_fetch: Callable[[Any], None] | None = None,
) -> ActivateResult | None:
    """The one dispatch from a decision to an agent call (``md``: the owning deployment, for
    its model source and engine)."""
    fetch_kw: dict[str, Any] = {"source": md.source} if md is not None and md.source else {}
    if isinstance(d, Start):
        return await client.activate(
            d.model,
            d.gpus,
            d.slot_id,
            request,
            owner,
            engine=md.engine if md else "",
            engine_args=md.engine_args if md else (),
            **fetch_kw,
        )
    if isinstance(d, Drain):
        await client.begin_grace(d.instance_id, request)
    elif isinstance(d, EndGrace):
        await client.end_instance(d.instance_id, d.evict_weights, request)
    elif isinstance(d, Prewarm):
        if fetch_kw and on_fetch is not None:
            fetch_kw["on_fetch"] = on_fetch
        await client.prewarm(d.model, d.gpus, d.layers, request, owner, **fetch_kw)
    else:
        await client.evict(d.slot_id, request)
    return None


def describe(d: Decision) -> str:
    """One line a person reads in logs and Events."""
    where = f"{d.node} GPUs {list(d.gpus)}"
    if isinstance(d, Prewarm):
        layers = "all layers" if d.layers == 0 else f"first {d.layers} layers"
        return (
            f"prewarm {d.kind.value} replica #{d.rank} (score {d.score:.3g}) of {d.model} on "
            f"{where} ({layers})"
        )
    if isinstance(d, Evict):
        return f"evict {d.model} slot {d.slot_id} on {where}: {d.reason}"
    if isinstance(d, Start):
        how = f"prewarm hit on slot {d.slot_id}" if d.hit else "cold start"
        ev = f", evicting {len(d.evicts)} other slot(s)" if d.evicts else ""
        return f"start {d.model} on {where} ({how}{ev})"
    if isinstance(d, Drain):
        return f"drain {d.model} instance {d.instance_id} on {d.node} (grace period)"
    return f"end {d.model} instance {d.instance_id} on {d.node}: {d.reason}"


EVENT = {Prewarm: "Prewarm", Evict: "Evicted", Drain: "Draining", EndGrace: "InstanceEnded"}


class Actor:
    """Launches decisions as background agent calls and remembers what is in flight."""

    def __init__(
        self,
        client_of: Callable[[str], AgentPort | None],
        snap_of: Callable[[str], NodeSnapshot | None],
        refresh: Callable[[str, AgentPort], Awaitable[None]],
        event: Callable[[str, str, str, str], Awaitable[None]],
        metrics: Metrics,
        on_start: Callable[[str, ActivateResult], None] = lambda m, r: None,
        md_of: Callable[[str], ModelDeploymentSpec | None] = lambda uid: None,
        may_act: Callable[[], bool] = lambda: True,
    ) -> None:
        self.client_of = client_of
        self.snap_of = snap_of
        self.refresh = refresh
        self.event = event  # (owner uid, type, reason, message)
        self.metrics = metrics
        self.on_start = on_start
        self.md_of = md_of
        self.may_act = may_act  # the leader fence (.leader), checked right before each call
        self.pending_prewarms: dict[tuple[str, str, tuple[int, ...]], PendingPrewarm] = {}
        self.pending_starts: dict[tuple[str, tuple[int, ...]], PendingStart] = {}
        self.ended: set[str] = set()  # instance ids this operator ended
        self.tasks: set[asyncio.Task[Any]] = set()

    def launch(
        self, decisions: Iterable[Decision], owners: Mapping[str, str], skip: set[str]
    ) -> set[str]:
        """Start the calls of ``decisions``; ``owners``: model -> owner UID; models whose owner
        is in ``skip`` (being deleted) get no prewarm or start.  Returns the owners that got a
        prewarm or a start (their status is best written once the call lands)."""
        busy: set[str] = set()
        for d in decisions:
            owner = owners.get(d.model, "")
            if isinstance(d, Prewarm | Start) and (not owner or owner in skip):
                continue
            if isinstance(d, Prewarm):
                key = (d.node, d.model, d.gpus)
                if key in self.pending_prewarms:
                    continue
                self.pending_prewarms[key] = PendingPrewarm(
                    d.node, d.model, d.gpus, d.bytes_per_gpu, owner
                )
            elif isinstance(d, Start):
                if (d.node, d.gpus) in self.pending_starts:
                    continue
                self.pending_starts[(d.node, d.gpus)] = PendingStart(d.node, d.model, d.gpus, owner)
            elif isinstance(d, EndGrace):
                self.ended.add(d.instance_id)
            if isinstance(d, Prewarm | Start):
                busy.add(owner)
            task = asyncio.get_running_loop().create_task(self.execute(d, owner))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return busy

    def pending_of(self, owner: str) -> bool:
        return any(
            p.owner == owner
            for p in (*self.pending_prewarms.values(), *self.pending_starts.values())
        )

    async def execute(self, d: Decision, owner: str) -> None:
        """One decision, now: the call, its metrics, Event and log line."""
        client = self.client_of(d.node)
        verb = VERB[type(d)]
        if client is None:
            return
        if not self.may_act():  # leadership lost since the poll decided this
            log.info("event=action_fenced verb=%s node=%s model=%s", verb, d.node, d.model)
            self._forget(d)
            return
        request = rid(d, self.snap_of(d.node))
        log.info(
            "event=action verb=%s node=%s model=%s request_id=%s detail=%r",
            verb,
            d.node,
            d.model,
            request,
            describe(d),
        )
        md = self.md_of(owner)
        src = md.source if md is not None else ""
        snap = self.snap_of(d.node)
        fetching = (
            isinstance(d, Start) and bool(src) and (snap is None or d.model not in snap.models)
        )
        span = tracing.begin(d, verb, request)  # None unless tracing is on
        try:
            if fetching:  # a cold start on a node whose store lacks the model
                msg = f"node {d.node} is fetching {d.model} from {src} to start it"
                await self.event(owner, "Normal", "Fetching", msg)
            res = await call(client, d, request, owner, md, self._fetch_reporter(owner, d.node))
            if fetching:
                msg = f"node {d.node} fetched {d.model} from {src}"
                await self.event(owner, "Normal", "Fetched", msg)
            if res is not None:
                tracing.started(span, res.instance.instance_id, res.hit, res.activation_s)
                self._started(d, res, owner)
                await self.event(
                    owner,
                    "Normal",
                    "PrewarmHit" if res.hit else "ColdStart",
                    (
                        f"started {d.model} instance {res.instance.instance_id} on {d.node} GPUs "
                        f"{list(d.gpus)} in {res.activation_s:.2f}s "
                        f"({'prewarm hit' if res.hit else 'cold start'}); "
                        f"endpoint {res.instance.endpoint}"
                    ),
                )
            elif not isinstance(d, Prewarm):  # a placed replica shows in status + "Prewarmed"
                await self.event(owner, "Normal", EVENT[type(d)], describe(d))
            self.metrics.actions.labels(verb, "ok").inc()
        except AgentCallError as exc:
            tracing.failed(span, exc.code, exc.message)
            self.metrics.actions.labels(verb, exc.code).inc()
            log.warning(
                "event=action_failed verb=%s node=%s model=%s code=%s message=%r",
                verb,
                d.node,
                d.model,
                exc.code,
                exc.message,
            )
            await self.event(owner, "Warning", "AgentRefused", f"{describe(d)}: {exc}")
        except (TimeoutError, OSError) as exc:
            tracing.failed(span, "error", str(exc))
            self.metrics.actions.labels(verb, "error").inc()
            log.warning("event=action_error verb=%s node=%s error=%r", verb, d.node, str(exc))
        finally:
            tracing.end(span)
            await self.refresh(d.node, client)
            self._forget(d)

    def _forget(self, d: Decision) -> None:
        """The call is over (or never made): no longer pending."""
        if isinstance(d, Prewarm):
            self.pending_prewarms.pop((d.node, d.model, d.gpus), None)
        elif isinstance(d, Start):
            self.pending_starts.pop((d.node, d.gpus), None)

    def _fetch_reporter(self, owner: str, node: str) -> Callable[[Any], None]:
        """Events for a fetch seen on one Prewarm stream: when it starts and when it ends."""
        seen = [False]

        def report(f: Any) -> None:
            ev = fetch_event(f, node, first=not seen[0])
            seen[0] = True
            if ev is not None:
                task = asyncio.get_running_loop().create_task(self.event(owner, *ev))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        return report

    def _started(self, d: Start, res: ActivateResult, owner: str) -> None:
        start = "hit" if res.hit else "cold"
        self.metrics.starts.labels(d.model, start).inc()
        self.metrics.activation_seconds.labels(start).observe(res.activation_s)
        self.on_start(owner, res)

    async def drain(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
