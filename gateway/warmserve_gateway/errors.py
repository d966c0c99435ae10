"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

OpenAI's SDKs read ``error.message`` and the HTTP status (they retry 429 and 5xx, honouring
``Retry-After``), so every answer the gateway makes itself uses this shape.
"""

from __future__ import annotations

import json

from aiohttp import web


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    ).encode()


def openai_error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    retry_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    hdrs = dict(headers or {})
    if retry_after is not None:
        hdrs["Retry-After"] = str(int(retry_after))
    return web.Response(
        status=status,
        body=error_body(message, kind, code, param),
        content_type="application/json",
        headers=hdrs,
    )


def raw_error(
    status: int,
    reason: str,
    message: str,
    code: str,
    *,
    kind: str = "invalid_request_error",
    retry_after: int | None = None,
) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape, closing the connection: what the edge
    writes on a connection it ends before (or without) aiohttp's request handling."""
    body = error_body(message, kind, code)
    head = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if retry_after is not None:
        head.append(f"Retry-After: {int(retry_after)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def route_not_served(status: int, data: bytes, route: str, model: str) -> web.Response | None:
    """An engine's 404 for the route itself (vLLM registers ``/v1/embeddings`` only for a
    pooling model and the generation routes only for generative ones, and then answers FastAPI's
    ``{"detail": "Not Found"}``), as a clear error in OpenAI's shape; None for any other answer,
    which is relayed as the engine sent it (an engine's own OpenAI error included)."""
    if status != 404:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return None
    return openai_error(
        404,
        f"the model {model!r} does not serve POST {route}: its engine has no such route "
        "(vLLM serves /v1/embeddings for embedding models only, and the completion and "
        "response routes for generative models only)",
        param="model",
        code="unsupported_route",
    )
