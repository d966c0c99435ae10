"""One gateway replica: wiring, the two HTTP servers, start/drain/stop.

Two listeners:

* the **API** (``--port``, default 8000): ``/v1/*`` and ``/healthz``; the only port the chart's
  ``<release>-gateway`` Service exposes to clients;
* the **admin** port (``--admin-port``, default 9092): ``/metrics`` (Prometheus), ``/demand``
  (held requests for the operator, :mod:`.demand`) and ``/healthz``; the chart's headless
  ``<release>-gateway-demand`` Service names it for the operator's discovery.

Both listeners are :mod:`.edge` listeners (header budget and deadline, connection cap).

Readiness (``/healthz``) is 200 once the ModelDeployments were listed, 503 before and while
draining.  On SIGTERM the replica drains (:meth:`Gateway.drain`): ``/healthz`` turns 503 at once,
and for ``drain_delay_s`` the replica serves exactly as before while Kubernetes removes it from
the Service's endpoints (every kube-proxy takes a moment to see it; a replica that stopped at
once would refuse the connections still sent to it).  Then idle connections are closed and every
answer closes its connection; held and running requests are served until none is left or
``drain_s`` has passed.  At that deadline every request still held is answered 503 +
``Retry-After: 1`` (code ``draining``; OpenAI's SDKs retry it, and the retry reaches a replica
that is not draining), running ones get a few seconds more, and the process exits.  Held
requests are answered early rather than the drain lasting ``maxHoldSeconds``: that is a
tenant's setting (any length up to the CRD's limit), the drain time is the platform's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from warmserve.api.demand import ModelDemand
from warmserve.tracing import TracingConfig

from .api import Api
from .auth import ApiKeys
from .catalog import Catalog
from .config import GatewayConfig
from .demand import DemandAccess, DemandEndpoint, DemandTracker
from .discovery import Scope, Source
from .edge import EdgeGuard, EdgeLimits
from .holding import Dispatcher, Rejected
from .metrics import Metrics
from .proxy import Proxy, new_session
from .tracing import GatewayTracing

log = logging.getLogger("warmserve.gateway")

# The admin port serves the operator, Prometheus and probes: a few connections.
ADMIN_MAX_CONNECTIONS = 256
# After the drain deadline: how long running requests (streams under way) may still take.
FINAL_GRACE_S = 3.0


class Draining(Rejected):
    status = 503
    code = "draining"


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        source: Source,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracing: TracingConfig | None = None,
    ) -> None:
        self.config = config
        self.tracing = GatewayTracing(tracing) if tracing is not None else None
        self.source = source
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.replica = (
            config.replica or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.catalog = Catalog(dict(config.global_models))
        self.keys = (
            ApiKeys(config.api_keys, default_namespaces=config.anonymous_namespaces)
            if config.api_keys
            else None
        )
        self.demand = DemandTracker(self.replica, self._counts)
        self.dispatcher = Dispatcher(
            config.max_held, on_held=self._held_changed, on_left=self._held_left, clock=clock,
            max_held_per_namespace=config.max_held_per_namespace,
            max_held_per_key=config.max_held_per_key,
        )  # fmt: skip
        self.synced = False  # every watched scope (namespaces or cluster, GPUNodes) listed once
        self._listed: set[Scope] = set()
        self._needed: set[Scope] = set(source.scopes)
        self.draining = False  # SIGTERM received: not ready
        self.closing = False  # the drain delay is over: every answer closes its connection
        self._last_held: dict[str, int] = {}
        self.proxy: Proxy  # set in start() (the client session needs the running loop)
        self.api = Api(self)
        self.edges: dict[str, EdgeGuard] = {}
        self._runners: list[web.AppRunner] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._stop_streams = asyncio.Event()
        self._demand = DemandEndpoint(
            self.demand,
            DemandAccess(config.demand_token_file, config.insecure_demand),
            config.max_demand_streams,
            self._stop_streams,
        )
        self.urls: dict[str, str] = {}

    # ---- catalog -> dispatcher ----

    def _on_list(self, scope: Scope, items: list[Mapping[str, Any]]) -> None:
        self._apply(self.catalog.listed(scope, items))
        self._listed.add(scope)
        if not self.synced and self._needed <= self._listed:
            self.synced = True
            self.metrics.catalog_synced.set(1)
            log.info("event=catalog_synced deployments=%d", len(self.catalog.owners))

    def _on_event(self, scope: Scope, typ: str, body: Mapping[str, Any]) -> None:
        self._apply(self.catalog.event(scope, typ, body))

    def _apply(self, models: set[str]) -> None:
        for model in models:
            dep = self.catalog.owners.get(model)
            self.dispatcher.update(model, dep)
            self.metrics.instances.labels(model).set(len(dep.serving) if dep else 0)
            if dep is not None:
                # Series exist at 0 from the moment the model is known, so Prometheus' rate()
                # sees the first requests as an increase (a series born with its first
                # observation already counted shows no rate: a dead dashboard panel).
                self.metrics.model(model)
                log.debug("event=route model=%s serving=%d", model, len(dep.serving))

    def _counts(self) -> dict[str, ModelDemand]:
        return {
            m: ModelDemand(
                st.held,
                st.inflight,
                st.dep.spec.namespace,
                self.tracing.held_traces(m) if self.tracing else (),
            )
            for m, st in self.dispatcher.models.items()
            if st.held or st.inflight
        }

    def _held_changed(self, model: str, held: int) -> None:
        self.metrics.held.labels(model).set(held)
        if held == 1 and self._last_held.get(model, 0) == 0:
            # The start of a hold (e.g. a model at zero instances): what scale-from-zero
            # latency is measured from.
            log.info("event=holding model=%s", model)
        if self.tracing is not None:
            self.tracing.held_changed(model, held, self._last_held.get(model, 0))
        self._last_held[model] = held
        self.demand.held_changed(model, held)

    def _held_left(self, model: str) -> None:
        self.metrics.held_left.labels(model).inc()
        log.info("event=held_client_left model=%s", model)

    # ---- admin endpoints ----

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    def admin_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/demand", self._demand.handle)
        app.router.add_get("/healthz", self.api.healthz)
        app.router.add_get("/livez", self._livez)  # the event loop answers: alive
        return app

    async def _livez(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    def public_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self.tracing.middleware] if self.tracing is not None else [],
        )
        self.api.routes(app)
        return app

    # ---- lifecycle ----

    async def _serve(
        self, app: web.Application, host: str, port: int, name: str, max_connections: int
    ) -> None:
        c = self.config
        handler_args: dict[str, Any] = {
            "access_log": logging.getLogger("warmserve.gateway.access") if c.access_log else None,
            "max_line_size": c.max_header_bytes,
            "max_field_size": c.max_header_bytes,
            "max_headers": c.max_headers,
            "keepalive_timeout": c.idle_timeout_s,
        }
        runner = web.AppRunner(
            app,
            handler_cancellation=True,  # a held client that disconnects leaves the queue
            shutdown_timeout=1.0,
            **handler_args,
        )
        await runner.setup()
        self._runners.append(runner)
        assert runner.server is not None
        limits = EdgeLimits(max_connections, c.max_header_block_bytes, c.header_timeout_s)
        guard = self.edges[name] = EdgeGuard(name, limits, self.metrics)
        # The listener is created here rather than by aiohttp's TCPSite so that every connection
        # gets the edge's protocol (aiohttp's own factory always makes a plain RequestHandler).
        server = await asyncio.get_running_loop().create_server(
            guard.factory(runner.server, **handler_args), host, port, backlog=1024
        )
        self._servers.append(server)
        bound = server.sockets[0].getsockname()
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.urls[name] = f"http://{shown}:{bound[1]}"

    async def start(self) -> None:
        c = self.config
        self.proxy = Proxy(
            new_session(c.connect_timeout_s, c.read_timeout_s),
            self.dispatcher,
            self.metrics,
            eject_s=c.eject_s,
            clock=self.clock,
            ttfb_s=c.ttfb_timeout_s,
            read_timeout_s=c.read_timeout_s,
            max_eject_s=c.max_eject_s,
        )
        self.source.start(asyncio.get_running_loop(), self._on_list, self._on_event)
        await self._serve(self.public_app(), c.host, c.port, "api", c.max_connections)
        await self._serve(
            self.admin_app(), c.admin_host, c.admin_port, "admin", ADMIN_MAX_CONNECTIONS
        )
        log.info(
            "event=gateway_started replica=%s api=%s admin=%s api_keys=%s",
            self.replica, self.urls.get("api"), self.urls.get("admin"),
            len(self.keys) if self.keys else "off",
        )  # fmt: skip

    async def drain(self) -> None:
        """SIGTERM: not ready; serve as before for the drain delay; then close idle connections,
        serve until nothing is held or running or ``drain_s`` passed; then answer what is still
        held 503 + Retry-After and give running requests :data:`FINAL_GRACE_S` (module
        docstring)."""
        c = self.config
        self.draining = True
        log.info("event=draining delay_s=%g drain_s=%g", c.drain_delay_s, c.drain_s)
        await asyncio.sleep(c.drain_delay_s)
        self.closing = True
        for guard in self.edges.values():
            guard.close_idle()
        if await self._settled(c.drain_s):
            return
        held = self.dispatcher.shed(
            lambda: Draining(
                "this gateway replica is shutting down; retry (another replica serves it)",
                retry_after=1,
            )
        )
        log.info("event=drain_deadline held_answered=%d", held)
        await self._settled(FINAL_GRACE_S)

    async def _settled(self, timeout_s: float) -> bool:
        """Wait until no forwarded request is being handled (``timeout_s`` at most)."""
        deadline = self.clock() + timeout_s
        while self.api.active:
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        self._stop_streams.set()
        self.source.stop()
        for server in self._servers:
            server.close()  # no new connections
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        if getattr(self, "proxy", None) is not None:
            await self.proxy.session.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # export the spans still queued
