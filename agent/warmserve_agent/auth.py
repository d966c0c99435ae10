"""Who may drive the agent's API: the bearer-token check and the refusal of an open listener.

The agent's API drives every GPU of the node (load, start and stop models).  With a token file
every call except the standard health service must carry ``authorization: Bearer <token>`` or is
refused with UNAUTHENTICATED (health stays open for kubelet probes); the token is compared in
constant time.  :func:`check_exposure` refuses to serve the API on a non-loopback address with
neither mutual TLS nor a token, unless the operator of the node explicitly accepts the risk.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from warmserve_agent.config import AgentConfig, ConfigError


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health without the bearer token (see module docstring)."""

    _STREAMING = frozenset(
        {"/warmserve.agent.v1.NodeAgent/Prewarm", "/warmserve.agent.v1.NodeAgent/Watch"}
    )

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        md = {k: v for k, v in (details.invocation_metadata or ())}
        got = md.get("authorization", "")
        got_b = got.encode() if isinstance(got, str) else bytes(got)
        if hmac.compare_digest(got_b, self._expected):
            return await continuation(details)
        msg = (
            "missing or wrong bearer token: send metadata 'authorization: Bearer <token>' "
            "with the token from the agent's --token-file"
        )

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
            yield  # pragma: no cover - makes this an async generator

        if details.method in self._STREAMING:
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny_unary)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(cfg: AgentConfig) -> str | None:
    """Refuse an unauthenticated API on a reachable address; returns a warning to log, if any.

    The agent's API drives every GPU of the node (load, start and stop models), so serving it on
    0.0.0.0 without TLS client certificates or a token lets anyone who can reach the port do so.
    """
    host = cfg.listen.rsplit(":", 1)[0]
    if _is_loopback(host):
        return None
    mtls = cfg.tls_cert is not None and cfg.client_ca is not None
    if mtls:
        return None
    if cfg.token_file is not None:
        if cfg.tls_cert is None:
            return (
                f"event=plaintext_token listen={cfg.listen}: the bearer token travels "
                "unencrypted; add --tls-cert/--tls-key"
            )
        return None
    if not cfg.allow_insecure_listen:
        raise ConfigError(
            f"refusing to serve the agent API on {cfg.listen} without authentication: anyone "
            "who can reach that port could load, start and stop models on this node's GPUs. "
            "Add --tls-cert/--tls-key/--client-ca (mutual TLS) or --token-file, listen on "
            "127.0.0.1, or pass --allow-insecure-listen to accept the risk (test clusters only)"
        )
    return (
        f"event=insecure_listen listen={cfg.listen} WARNING: the agent API is served WITHOUT "
        "authentication or encryption (--allow-insecure-listen); anyone who can reach this port "
        "can drive this node's GPUs. Use only on a throwaway test cluster"
    )
