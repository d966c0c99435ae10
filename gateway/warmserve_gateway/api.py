"""The OpenAI-compatible HTTP API of the gateway (aiohttp handlers).

``GET /v1/models`` and ``GET /v1/models/{model}`` are answered from the catalog (every served
deployment the caller may use, with its readiness); ``POST /v1/completions``,
``POST /v1/chat/completions`` and every other ``/v1/*`` route are forwarded to an instance of the
model the request names (its JSON body's ``model``, or the ``model`` query parameter for requests
without a JSON body), resolved among the caller's namespaces (:mod:`.names`).

Answers the gateway makes itself (OpenAI error JSON): 400 malformed JSON / missing ``model`` /
ambiguous name, 401 missing or wrong API key, 404 unknown model or route, 413 body over
``--max-body-bytes``, 429 queue full (``Retry-After``), 503 hold time exceeded or model unable
to start (``Retry-After``), 502 engine failed twice, 503 while the replica has not listed the
deployments yet.  Header lines over ``--max-header-bytes`` are refused by the HTTP parser (400)
before any handler runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from .auth import ApiKeys, Caller
from .catalog import Ambiguous, Catalog, Deployment
from .config import GatewayConfig
from .errors import openai_error
from .holding import Dispatcher, Rejected
from .metrics import NO_MODEL, UNKNOWN_MODEL, Metrics
from .proxy import Outgoing, Proxy, UpstreamError, request_headers

log = logging.getLogger("warmserve.gateway.api")

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


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


class Gateway(Protocol):
    """What the handlers use of :class:`warmserve_gateway.server.Gateway`."""

    config: GatewayConfig
    metrics: Metrics
    catalog: Catalog
    dispatcher: Dispatcher
    proxy: Proxy
    keys: ApiKeys | None
    synced: bool
    draining: bool
    clock: Callable[[], float]


class Api:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.m = gw.metrics

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_route("*", "/v1/{tail:.*}", self.forward)
        app.router.add_route("*", "/{tail:.*}", self.not_found)

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

    async def model(self, request: web.Request) -> web.Response:
        caller = self._caller(request)
        if isinstance(caller, web.Response):
            return caller
        err = self._not_synced()
        if err is not None:
            return err
        name = request.match_info["model"]
        try:
            dep = self.gw.catalog.resolve(name, caller.namespaces)
        except Ambiguous as exc:
            return openai_error(400, str(exc), param="model", code="ambiguous_model")
        if dep is None or not self.gw.catalog.is_served(dep):
            return self._unknown(name)
        claimed = self.gw.catalog.global_models.get(name) == dep.key
        return web.json_response(_model_card(dep, int(time.time()), name if claimed else None))

    async def not_found(self, request: web.Request) -> web.Response:
        return openai_error(
            404,
            f"no route {request.method} {request.path}; the API is under /v1/",
            code="not_found",
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
        limit = self.gw.config.max_body_bytes
        if request.content_length is None or request.content_length <= limit:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge:
                pass
        self.m.answered(NO_MODEL, 413)
        return openai_error(
            413,
            f"request body over the gateway's limit of {limit} bytes",
            code="request_too_large",
        )

    async def forward(self, request: web.Request) -> web.StreamResponse:
        t0 = self.gw.clock()
        caller = self._caller(request)
        if isinstance(caller, web.Response):
            return caller
        err = self._not_synced()
        if err is not None:
            return err
        doc: dict[str, Any] | None = None
        body = b""
        if request.method in _BODY_METHODS:
            got = await self._read_body(request)
            if isinstance(got, web.Response):
                return got
            body = got
        if body:
            try:
                parsed = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return self._bad(f"the request body is not valid JSON: {exc}", "invalid_json")
            if not isinstance(parsed, dict):
                return self._bad("the request body must be a JSON object", "invalid_json")
            doc = parsed
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
        out = Outgoing(
            request.method,
            request.path_qs,
            body,
            request_headers(request.headers),
            bool(doc.get("stream")) if doc is not None else False,
            caller.key_id,
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
            except UpstreamError as exc:
                resp = openai_error(502, str(exc), kind="server_error", code="upstream_error")
            status = resp.status
            return resp
        except asyncio.CancelledError:
            raise
        finally:
            self.m.answered(st.model, status)
