"""Who may drive the agent's API: client identities, the bearer token, and the refusal of an
open listener.

The agent's API drives every GPU of the node (load, start and stop models).  With mutual TLS a
client certificate that chains to ``--client-ca`` only proves the CA signed it; the CA also
signs the agents' own server certificates, so the chain alone let one node's key drive every
other node.  :class:`IdentityInterceptor` therefore checks *who* the certificate names
(:class:`ClientIdentities`, ``--allow-client-id`` / ``--allow-reader-id``): a ``caller`` (the
operator) may call everything, a ``reader`` (an admin's ``warmserve agent inspect``) only
``Describe`` and ``Watch`` and without a fencing token (a read must not move the fence); anyone
else is refused with PERMISSION_DENIED naming the identity presented.  The TLS handshake itself
refuses a client certificate without the clientAuth extended key usage (an agent's server-only
certificate), as BoringSSL checks the purpose of the peer's certificate.

With a token file every call except the standard health service must carry
``authorization: Bearer <token>`` or is refused with UNAUTHENTICATED (health stays open for
kubelet probes); the token is compared in constant time.  :func:`check_exposure` refuses to serve
the API on a non-loopback address with neither mutual TLS nor a token, unless the operator of
the node explicitly accepts the risk.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import grpc

from warmserve_agent.config import AgentConfig, ConfigError
from warmserve_agent.safe_text import bounded

# The operator's identity in the certificates the chart and hack/k8s/mkcerts.sh make for the
# default release name (the chart passes its own with --allow-client-id).
DEFAULT_CALLER_ID = "CN=warmserve-operator"
_HEALTH = "/grpc.health.v1.Health/"
_SERVICE = "/warmserve.agent.v1.NodeAgent/"
READ_METHODS = frozenset({_SERVICE + "Describe", _SERVICE + "Watch"})


class Role(StrEnum):
    CALLER = "caller"  # every method: the operator
    READER = "reader"  # Describe and Watch, with no fencing token: an admin's inspect


def parse_identity(entry: str) -> str:
    """One allowlist entry as given on the command line: ``CN=<common name>`` or a URI SAN such
    as ``spiffe://cluster.local/ns/warmserve/sa/warmserve-operator``."""
    text = entry.strip()
    if text.startswith("CN=") and len(text) > 3:
        return text
    scheme, sep, rest = text.partition("://")
    if sep and scheme.isascii() and scheme.isalpha() and rest and " " not in text:
        return text
    raise ValueError(
        f"client identity {entry!r}: give CN=<common name> or a URI SAN such as "
        "spiffe://<trust domain>/ns/<namespace>/sa/<service account>"
    )


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """What a verified client certificate names: its subject's common name and URI SANs."""

    common_name: str = ""
    uris: tuple[str, ...] = ()

    @classmethod
    def from_auth_context(cls, auth: dict[str, list[bytes]]) -> PeerIdentity:
        def texts(key: str) -> list[str]:
            return [v.decode(errors="replace") for v in auth.get(key) or ()]

        cn = texts("x509_common_name")
        return cls(cn[0] if cn else "", tuple(texts("peer_uri")))

    def names(self) -> frozenset[str]:
        """The allowlist entries that match this certificate."""
        cn = {f"CN={self.common_name}"} if self.common_name else set()
        return frozenset(cn | set(self.uris))

    def __str__(self) -> str:
        cn = f"CN={self.common_name}" if self.common_name else "(no CN)"
        return bounded(f"{cn} (URI SANs: {', '.join(self.uris) or 'none'})", 300)


@dataclass(frozen=True, slots=True)
class ClientIdentities:
    """The allowlist: who may call everything (``callers``) and who may only read."""

    callers: frozenset[str] = frozenset({DEFAULT_CALLER_ID})
    readers: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, callers: Iterable[str], readers: Iterable[str] = ()) -> ClientIdentities:
        c = frozenset(parse_identity(e) for e in callers) or frozenset({DEFAULT_CALLER_ID})
        return cls(c, frozenset(parse_identity(e) for e in readers))

    def role(self, peer: PeerIdentity) -> Role | None:
        names = peer.names()
        if names & self.callers:
            return Role.CALLER
        if names & self.readers:
            return Role.READER
        return None

    def refusal(self, method: str, peer: PeerIdentity, token: int) -> str | None:
        """Why ``peer`` may not make this call (None: it may)."""
        role = self.role(peer)
        if role is Role.CALLER:
            return None
        name = method.rsplit("/", 1)[-1]
        if role is None:
            return (
                f"client certificate {peer} is not allowed to call this agent: it accepts "
                f"{', '.join(sorted(self.callers))} (--allow-client-id) and readers "
                f"{', '.join(sorted(self.readers)) or '(none)'} (--allow-reader-id)"
            )
        if method not in READ_METHODS:
            return f"client certificate {peer} may only read (Describe, Watch), not call {name}"
        if token:
            return (
                f"client certificate {peer} is a reader: its {name} may not carry a fencing "
                "token (a read must not move the fence)"
            )
        return None


class IdentityInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose client certificate names no allowed identity (module docstring).
    The certificate is only known to the handler's context, so this wraps each handler."""

    def __init__(self, identities: ClientIdentities) -> None:
        self.identities = identities

    def _check(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> str | None:
        auth = context.auth_context() or {}
        if auth.get("transport_security_type") != [b"ssl"] or not auth.get("x509_subject"):
            return "no verified client certificate: this agent requires mutual TLS"
        peer = PeerIdentity.from_auth_context(auth)
        return self.identities.refusal(method, peer, int(getattr(request, "fencing_token", 0)))

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_HEALTH):
            return handler
        check = self._check
        code = grpc.StatusCode.PERMISSION_DENIED
        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if (why := check(method, request, context)) is not None:
                    await context.abort(code, bounded(why))
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if handler.unary_stream is not None:
            stream = handler.unary_stream
            if inspect.isasyncgenfunction(stream):

                async def gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    if (why := check(method, request, context)) is not None:
                        await context.abort(code, bounded(why))
                    async for msg in stream(request, context):
                        yield msg

                return grpc.unary_stream_rpc_method_handler(gen, **kw)

            async def writes(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if (why := check(method, request, context)) is not None:
                    await context.abort(code, bounded(why))
                return await stream(request, context)

            return grpc.unary_stream_rpc_method_handler(writes, **kw)
        # The API has no client-streaming methods; refuse one rather than pass it unchecked.
        async def deny(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, f"{method}: client streams are not served")

        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(deny, **kw)
        return grpc.stream_stream_rpc_method_handler(deny, **kw)


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
