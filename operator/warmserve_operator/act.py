"""Act: carry one poll's actions out as agent calls — one dispatch (:func:`call`).

The loop turns the controller's decisions into :class:`~.actions.Action` values (request id,
owner, engine, engine arguments, model source) and hands them to the :class:`Actor` with the
poll's :class:`~.context.PollContext` (the nodes' agent ports, the leader fence).  Calls run as
background tasks (a cold start can take a minute); until the agent reports their effect the
actor keeps them as *pending* so the next observation shows them (:mod:`.observe`).  The actor
reads nothing of the loop: what it reports goes to narrow sinks (Events, metrics, the started
instances' hit counts, a wake-up when a call landed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from warmserve.control.decisions import Drain, EndGrace, Evict, Prewarm, Start

from . import tracing
from .actions import Action, describe
from .agents import AgentPort
from .context import PollContext
from .metrics import Metrics
from .observe import PendingPrewarm, PendingStart
from .ports import ObjRef
from .snapshot import ActivateResult, AgentCallError, FetchView
from .sources import fetch_event

log = logging.getLogger("warmserve.operator")

# A refusal repeats while its cause lasts: one Warning Event per REPEAT_EVENT_S, not per poll.
REPEAT_EVENT_S = 300.0

# (the object it is about, type, reason, message, seconds within which the same one is dropped)
EventSink = Callable[[ObjRef | None, str, str, str, float], Awaitable[None]]


async def call(
    client: AgentPort,
    a: Action,
    on_fetch: Callable[[FetchView], Any] | None = None,
) -> ActivateResult | None:
    """The one dispatch from an action to an agent call."""
    d = a.decision
    if isinstance(d, Start):
        return await client.activate(
            d.model,
            d.gpus,
            d.slot_id,
            a.request_id,
            a.owner,
            engine=a.engine,
            engine_args=a.engine_args,
            source=a.source,
        )
    if isinstance(d, Drain):
        await client.begin_grace(d.instance_id, a.request_id)
    elif isinstance(d, EndGrace):
        await client.end_instance(d.instance_id, d.evict_weights, a.request_id)
    elif isinstance(d, Prewarm):
        await client.prewarm(
            d.model,
            d.gpus,
            d.layers,
            a.request_id,
            a.owner,
            source=a.source,
            on_fetch=on_fetch if a.source else None,
            engine=a.engine,
            engine_args=a.engine_args,
        )
    else:
        await client.evict(d.slot_id, a.request_id)
    return None


EVENT = {Prewarm: "Prewarm", Evict: "Evicted", Drain: "Draining", EndGrace: "InstanceEnded"}


class Actor:
    """Launches actions as background agent calls and remembers what is in flight.

    ``events``: where Events go (:meth:`.report.Reporter.event`); ``on_start(owner, hit)``: a
    started instance, for its deployment's prewarm hit counters; ``landed()``: a call is over
    (the loop describes the agents again at once)."""

    def __init__(
        self,
        metrics: Metrics,
        events: EventSink,
        on_start: Callable[[str, bool], None],
        landed: Callable[[], None],
    ) -> None:
        self.metrics = metrics
        self.events = events
        self.on_start = on_start
        self.landed = landed
        self.pending_prewarms: dict[tuple[str, str, tuple[int, ...]], PendingPrewarm] = {}
        self.pending_starts: dict[tuple[str, tuple[int, ...]], PendingStart] = {}
        self.ended: set[str] = set()  # instance ids this operator ended
        self.tasks: set[asyncio.Task[Any]] = set()

    def launch(self, actions: Iterable[Action], ctx: PollContext) -> set[str]:
        """Start the calls of ``actions`` (one poll's, made with ``ctx``).  Returns the owners
        that got a prewarm or a start (their status is best written once the call lands)."""
        busy: set[str] = set()
        for a in actions:
            d = a.decision
            if isinstance(d, Prewarm):
                key = (d.node, d.model, d.gpus)
                if key in self.pending_prewarms:
                    continue
                self.pending_prewarms[key] = PendingPrewarm(
                    d.node, d.model, d.gpus, d.bytes_per_gpu, a.owner
                )
            elif isinstance(d, Start):
                if (d.node, d.gpus) in self.pending_starts:
                    continue
                self.pending_starts[(d.node, d.gpus)] = PendingStart(
                    d.node, d.model, d.gpus, a.owner
                )
            elif isinstance(d, EndGrace):
                self.ended.add(d.instance_id)
            if isinstance(d, Prewarm | Start):
                busy.add(a.owner)
            self.spawn(self.execute(a, ctx))
        return busy

    def pending_of(self, owner: str) -> bool:
        return any(
            p.owner == owner
            for p in (*self.pending_prewarms.values(), *self.pending_starts.values())
        )

    async def post(self, about: ObjRef | None, type_: str, reason: str, message: str) -> None:
        """An Event; a Warning (a refusal) at most once per ``REPEAT_EVENT_S`` while it lasts."""
        dedupe = REPEAT_EVENT_S if type_ == "Warning" else 0.0
        await self.events(about, type_, reason, message, dedupe)

    async def execute(self, a: Action, ctx: PollContext) -> None:
        """One action, now: the call, its metrics, Event and log line."""
        d, verb = a.decision, a.verb
        node = ctx.nodes.get(a.node)
        if node is None:
            return
        if not ctx.fence.may_act():  # leadership lost since the poll decided this
            log.info("event=action_fenced verb=%s node=%s model=%s", verb, d.node, d.model)
            self._forget(a)
            return
        log.info(
            "event=action verb=%s node=%s model=%s request_id=%s detail=%r",
            verb,
            d.node,
            d.model,
            a.request_id,
            describe(d),
        )
        span = tracing.begin(d, verb, a.request_id)  # None unless tracing is on
        try:
            if a.fetching:  # a cold start on a node whose store lacks the model
                msg = f"node {d.node} is fetching {d.model} from {a.source} to start it"
                await self.post(a.about, "Normal", "Fetching", msg)
            res = await call(node.client, a, self._fetch_reporter(a))
            if a.fetching:
                msg = f"node {d.node} fetched {d.model} from {a.source}"
                await self.post(a.about, "Normal", "Fetched", msg)
            if res is not None:
                tracing.started(span, res.instance.instance_id, res.hit, res.activation_s)
                self._started(a, res)
                await self.post(
                    a.about,
                    "Normal",
                    "PrewarmHit" if res.hit else "ColdStart",
                    (
                        f"started {d.model} instance {res.instance.instance_id} on {d.node} GPUs "
                        f"{list(d.gpus)} in {res.activation_s:.2f}s "
                        f"({'prewarm hit' if res.hit else 'cold start'}); "
                        f"endpoint {res.instance.endpoint}"
                        + (f"; {res.stages_text()}" if res.stages else "")
                    ),
                )
            elif not isinstance(d, Prewarm):  # a placed replica shows in status + "Prewarmed"
                await self.post(a.about, "Normal", EVENT[type(d)], describe(d))
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
            await self.post(a.about, "Warning", "AgentRefused", f"{describe(d)}: {exc}")
        except (TimeoutError, OSError) as exc:
            tracing.failed(span, "error", str(exc))
            self.metrics.actions.labels(verb, "error").inc()
            log.warning("event=action_error verb=%s node=%s error=%r", verb, d.node, str(exc))
        finally:
            tracing.end(span)
            # Not a Describe per call (1,000 prewarms made 1,000 Describes of one agent): the
            # loop's next poll, now, describes every agent once.
            self.landed()
            self._forget(a)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` beside the loop; :meth:`drain` waits for it with the calls."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _forget(self, a: Action) -> None:
        """The call is over (or never made): no longer pending."""
        d = a.decision
        if isinstance(d, Prewarm):
            self.pending_prewarms.pop((d.node, d.model, d.gpus), None)
        elif isinstance(d, Start):
            self.pending_starts.pop((d.node, d.gpus), None)

    def _fetch_reporter(self, a: Action) -> Callable[[FetchView], None]:
        """Events for a fetch seen on one Prewarm stream: when it starts and when it ends."""
        seen = [False]

        def report(f: FetchView) -> None:
            ev = fetch_event(f, a.node, first=not seen[0])
            seen[0] = True
            if ev is not None:
                self.spawn(self.post(a.about, *ev))

        return report

    def _started(self, a: Action, res: ActivateResult) -> None:
        start = "hit" if res.hit else "cold"
        self.metrics.starts.labels(a.decision.model, start).inc()
        self.metrics.activation_seconds.labels(start).observe(res.activation_s)
        self.on_start(a.owner, res.hit)

    async def drain(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
