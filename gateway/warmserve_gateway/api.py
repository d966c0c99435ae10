"""The OpenAI-compatible HTTP API of the gateway (aiohttp handlers).

Routes are matched on the request target's normalised path (:func:`.hygiene.normalise_path`),
exactly, against an allowlist: ``GET /v1/models`` and ``GET /v1/models/{model}`` are answered
from the catalog (every served deployment the caller may use, with its readiness); ``POST`` to a
forwarded route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/embeddings``, more with ``--route``) goes to
an instance of the model the JSON body's ``model`` names, resolved among the caller's namespaces
(:mod:`.names`), at the route's canonical path; everything else is 404 (405 for a known route
with another method).

Answers the gateway makes itself (OpenAI error JSON): 400 malformed or too deeply nested JSON /
missing ``model`` / ambiguous name, 401 missing or wrong API key, 404 unknown model or route, 405
wrong method, 408 body not received in time, 411 chunked body, 413 body over
``--max-body-bytes``, 429 queue full (``Retry-After``), 503 hold time exceeded, model unable to
start or replica draining (``Retry-After``), 502 engine failed twice, 504 no first byte from the
engine twice, 503 while the replica has not listed the deployments yet.  The request line and
headers are bounded before any handler runs (:mod:`.edge`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import unquote

from aiohttp import web

from .auth import ApiKeys, Caller
from .catalog import Ambiguous, Catalog, Deployment
from .config import GatewayConfig
from .errors import openai_error
from .holding import Dispatcher, Rejected
from .hygiene import BadJson, normalise_path, parse_json_object, request_headers
from .metrics import NO_MODEL, UNKNOWN_MODEL, Metrics
from .proxy import Outgoing, Proxy, UpstreamError, UpstreamTimeout
from .usage import ASK_ROUTES, ask_for_usage

log = logging.getLogger("warmserve.gateway.api")

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_READ = frozenset({"GET", "HEAD"})
_MODELS = "/v1/models"


def _model_card(dep: Deployment, now: int, listed: str | None = None) -> dict[str, Any]:
    serving = len(dep.serving)
    return {
        "id": listed or dep.model,
        "object": "model",
        "created": now,
        "owned_by": "warmserve",
        # warmserve extensions (clients ignore unknown fields)
        "deployment": dep.key,
        "ready": serving > 0,
        "instances": serving,
        "status": dep.ready_reason or "Unknown",
        "maxHoldSeconds": dep.spec.max_hold_s,
    }


class GatewayView(Protocol):
    """What the handlers use of :class:`warmserve_gateway.server.Gateway`."""

    config: GatewayConfig
    metrics: Metrics
    catalog: Catalog
    dispatcher: Dispatcher
    proxy: Proxy
    keys: ApiKeys | None
    synced: bool
    draining: bool  # not ready (SIGTERM received)
    closing: bool  # answers end their connection (the drain delay is over)
    clock: Callable[[], float]


class Api:
    def __init__(self, gw: GatewayView) -> None:
        self.gw = gw
        self.m = gw.metrics
        self.active = 0  # forwarded requests being handled (held, at an engine, or relayed)
        self._forwarded = frozenset(gw.config.forwarded_routes)
        # Targets that are their own normal form (the common case skips normalisation).
        self._exact = self._forwarded | {_MODELS, "/healthz"}

    def routes(self, app: web.Application) -> None:
        # One aiohttp route: the allowlist is matched on the normalised path (dispatch).
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        app.on_response_prepare.append(self._closing)

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        raw = request.raw_path
        path = raw if raw in self._exact else normalise_path(raw)
        method = request.method
        if path in self._forwarded:
            if method == "POST":
                return await self.forward(request, path)
            return self._not_allowed(request, path, "POST")
        if path == _MODELS or (path is not None and path.startswith(_MODELS + "/")):
            if method not in _READ:
                return self._not_allowed(request, path, "GET")
            if path == _MODELS:
                return await self.models(request)
            return await self.model(request, unquote(path[len(_MODELS) + 1 :]))
        if path == "/healthz" and method in _READ:
            return await self.healthz(request)
        return await self.not_found(request)

    async def _closing(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.gw.closing:  # draining: a client must not send its next request here
            response.force_close()
            response.headers["Connection"] = "close"  # aiohttp wrote its headers already

    async def healthz(self, request: web.Request) -> web.Response:
        if self.gw.draining:
            return web.Response(status=503, text="draining\n")
        if not self.gw.synced:
            return web.Response(status=503, text="ModelDeployments not listed yet\n")
        return web.Response(text="ok\n")

    def _caller(self, request: web.Request) -> Caller | web.Response:
        """Who calls (their key's namespaces, or the anonymous ones with keys off), or 401."""
        keys = self.gw.keys
        if keys is None:
            return Caller("", frozenset(self.gw.config.anonymous_namespaces))
        caller = keys.check(request.headers.get("Authorization"))
        if caller is not None:
            return caller
        self.m.answered(NO_MODEL, 401)
        return openai_error(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="warmserve"'},
        )

    def _not_synced(self) -> web.Response | None:
        if self.gw.synced:
            return None
        return openai_error(
            503,
            "the gateway has not listed the ModelDeployments yet; retry shortly",
            kind="server_error",
            code="not_ready",
            retry_after=1,
        )

    async def models(self, request: web.Request) -> web.Response:
        caller = self._caller(request)
        if isinstance(caller, web.Response):
            return caller
        err = self._not_synced()
        if err is not None:
            return err
        now = int(time.time())
        data = [
            _model_card(d, now, listed) for listed, d in self.gw.catalog.visible(caller.namespaces)
        ]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request, name: str) -> web.Response:
        caller = self._caller(request)
        if isinstance(caller, web.Response):
            return caller
        err = self._not_synced()
        if err is not None:
            return err
        try:
            dep = self.gw.catalog.resolve(name, caller.namespaces)
        except Ambiguous as exc:
            return openai_error(400, str(exc), param="model", code="ambiguous_model")
        if dep is None or not self.gw.catalog.is_served(dep):
            return self._unknown(name)
        claimed = self.gw.catalog.global_models.get(name) == dep.key
        return web.json_response(_model_card(dep, int(time.time()), name if claimed else None))

    async def not_found(self, request: web.Request) -> web.Response:
        self.m.answered(NO_MODEL, 404)
        routes = ", ".join(sorted(self._forwarded))
        return openai_error(
            404,
            f"no route {request.method} {request.raw_path[:200]!r}; the gateway serves "
            f"GET /v1/models, GET /v1/models/{{model}} and POST {routes}",
            code="not_found",
        )

    def _not_allowed(self, request: web.Request, path: str, allow: str) -> web.Response:
        self.m.answered(NO_MODEL, 405)
        return openai_error(
            405,
            f"{request.method} is not allowed on {path}; use {allow}",
            code="method_not_allowed",
            headers={"Allow": "GET, HEAD" if allow == "GET" else allow},
        )

    def _unknown(self, name: str) -> web.Response:
        self.m.answered(UNKNOWN_MODEL, 404)
        return openai_error(
            404,
            f"the model {name!r} does not exist: no ModelDeployment serves it "
            "(GET /v1/models lists them)",
            param="model",
            code="model_not_found",
        )

    def _not_served(self, dep: Deployment) -> web.Response:
        """One of the caller's deployments the operator does not serve (a newer deployment of
        a model name another one serves): 503 at once, as for the operator's other permanent
        reasons; the other deployment is not named."""
        self.m.answered(UNKNOWN_MODEL, 503)
        return openai_error(
            503,
            f"ModelDeployment {dep.key} is not served: model {dep.model!r} is already served by "
            "another ModelDeployment (DuplicateModel); use another spec.model.name",
            kind="server_error",
            code="model_unavailable",
            param="model",
            retry_after=5,
        )

    def _bad(
        self, message: str, code: str = "invalid_request", param: str | None = None
    ) -> web.Response:
        self.m.answered(NO_MODEL, 400)
        return openai_error(400, message, param=param, code=code)

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        cfg = self.gw.config
        limit = cfg.max_body_bytes
        if request.content_length is None and request.body_exists:
            self.m.answered(NO_MODEL, 411)
            resp = openai_error(
                411,
                "send the request body with a Content-Length (a chunked body is not accepted)",
                code="length_required",
            )
            resp.force_close()
            return resp
        if request.content_length is None or request.content_length <= limit:
            try:
                if request.content.is_eof():  # all there already (the common case)
                    return await request.read()
                async with asyncio.timeout(cfg.body_timeout_s):
                    return await request.read()
            except web.HTTPRequestEntityTooLarge:
                pass
            except TimeoutError:
                self.m.answered(NO_MODEL, 408)
                resp = openai_error(
                    408,
                    f"the request body did not arrive within the gateway's limit of "
                    f"{cfg.body_timeout_s:g} s",
                    code="request_timeout",
                )
                resp.force_close()
                return resp
        self.m.answered(NO_MODEL, 413)
        return openai_error(
            413,
            f"request body over the gateway's limit of {limit} bytes",
            code="request_too_large",
        )

    async def forward(self, request: web.Request, path: str) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._forward(request, path)
        finally:
            self.active -= 1

    async def _forward(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = self.gw.clock()
        caller = self._caller(request)
        if isinstance(caller, web.Response):
            return caller
        err = self._not_synced()
        if err is not None:
            return err
        cfg = self.gw.config
        doc: dict[str, Any] | None = None
        body = b""
        if request.method in _BODY_METHODS:
            got = await self._read_body(request)
            if isinstance(got, web.Response):
                return got
            body = got
        if body:
            try:
                doc = parse_json_object(body, cfg.max_json_depth)
            except BadJson as exc:
                return self._bad(str(exc), exc.code)
            name = doc.get("model")
        else:
            name = request.query.get("model")
        if not isinstance(name, str) or not name:
            return self._bad(
                "you must provide a model parameter (the 'model' field of the JSON body)",
                "missing_model",
                "model",
            )
        try:
            dep = self.gw.catalog.resolve(name, caller.namespaces)
        except Ambiguous as exc:
            return self._bad(str(exc), "ambiguous_model", "model")
        if dep is not None and not self.gw.catalog.is_served(dep):
            return self._not_served(dep)
        st = self.gw.dispatcher.state(dep.model) if dep is not None else None
        if dep is None or st is None:
            return self._unknown(name)
        self.m.key_requests.labels(caller.key_id or "_anonymous", dep.spec.namespace).inc()
        if doc is not None and doc.get("model") != dep.model:
            doc["model"] = dep.model  # engines serve the weights' name (spec.model.name)
            body = json.dumps(doc).encode()
        # Only a JSON true streams; anything else gets the non-streaming first-byte limit.
        stream = doc is not None and doc.get("stream") is True
        strip = False
        if stream and doc is not None and path in ASK_ROUTES:  # the usage chunk (usage.py)
            body, strip = ask_for_usage(doc, body)
        out = Outgoing(
            request.method,
            path,
            body,
            request_headers(request.headers, request.remote, cfg.trusted_proxy_hops),
            stream,
            caller.key_id,
            strip,
        )
        deadline = t0 + dep.spec.max_hold_s
        status = 499  # the client went away before an answer (nginx's convention)
        try:
            try:
                resp = await self.gw.proxy.forward(request, st, out, t0, deadline)
            except Rejected as exc:
                self.m.rejected.labels(st.model, exc.code).inc()
                resp = openai_error(
                    exc.status, exc.message, kind=exc.kind, code=exc.code,
                    retry_after=exc.retry_after,
                )  # fmt: skip
            except UpstreamTimeout as exc:
                resp = openai_error(504, str(exc), kind="server_error", code="upstream_timeout")
            except UpstreamError as exc:
                resp = openai_error(502, str(exc), kind="server_error", code="upstream_error")
            status = resp.status
            return resp
        except asyncio.CancelledError:
            raise
        finally:
            self.m.answered(st.model, status)
