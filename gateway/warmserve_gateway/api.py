"""The OpenAI-compatible HTTP API of the gateway (aiohttp handlers).

``GET /v1/models`` and ``GET /v1/models/{model}`` are answered from the catalog (every served
deployment, with its readiness); ``POST /v1/completions``, ``POST /v1/chat/completions`` and
every other ``/v1/*`` route are forwarded to an instance of the model the request names (its
JSON body's ``model``, or the ``model`` query parameter for requests without a JSON body).

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

from .auth import ApiKeys
from .catalog import Ambiguous, Catalog, Deployment
from .config import GatewayConfig
from .errors import openai_error
from .holding import Dispatcher, Rejected
from .metrics import NO_MODEL, UNKNOWN_MODEL, Metrics
from .proxy import Outgoing, Proxy, UpstreamError, request_headers

log = logging.getLogger("warmserve.gateway.api")

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _model_card(dep: Deployment, now: int) -> dict[str, Any]:
    serving = len(dep.serving)
    return {
        "id": dep.model,
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

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        keys = self.gw.keys
        if keys is None or keys.check(request.headers.get("Authorization")) is not None:
            return None
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
        err = self._unauthorized(request) or self._not_synced()
        if err is not None:
            return err
        now = int(time.time())
        data = [_model_card(d, now) for d in self.gw.catalog.all()]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        err = self._unauthorized(request) or self._not_synced()
        if err is not None:
            return err
        name = request.match_info["model"]
        try:
            dep = self.gw.catalog.lookup(name)
        except Ambiguous as exc:
            return openai_error(400, str(exc), param="model", code="ambiguous_model")
        if dep is None:
            return self._unknown(name)
        return web.json_response(_model_card(dep, int(time.time())))

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
        err = self._unauthorized(request) or self._not_synced()
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
            dep = self.gw.catalog.lookup(name)
        except Ambiguous as exc:
            return self._bad(str(exc), "ambiguous_model", "model")
        st = self.gw.dispatcher.state(dep.model) if dep is not None else None
        if dep is None or st is None:
            return self._unknown(name)
        if doc is not None and doc.get("model") != dep.model:
            doc["model"] = dep.model  # engines serve the weights' name (spec.model.name)
            body = json.dumps(doc).encode()
        out = Outgoing(
            request.method,
            request.path_qs,
            body,
            request_headers(request.headers),
            bool(doc.get("stream")) if doc is not None else False,
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
