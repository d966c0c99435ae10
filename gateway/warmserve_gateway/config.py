"""Settings of one gateway replica (``warmserve gateway`` flags)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

# The routes forwarded to engines by default: OpenAI's JSON routes vLLM serves (an engine
# without one, e.g. /v1/embeddings of a generative model, gets a clear 404: errors.py).
FORWARDED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_ROUTE = re.compile(r"/v1(/[A-Za-z0-9_-]+)+")


class ConfigError(ValueError):
    """A setting out of range; the message names the flag."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000  # the OpenAI API (0: any free port)
    admin_host: str = "0.0.0.0"
    admin_port: int = 9092  # /metrics, /demand, /healthz (0: any free port)
    namespaces: tuple[str, ...] = ()  # serve ModelDeployments of these namespaces (empty: all)
    static_models: Path | None = None  # routes from a file instead of the Kubernetes API
    api_keys: Path | None = None
    max_body_bytes: int = 4 * 1024**2
    max_header_bytes: int = 16 * 1024  # per header line / field
    max_headers: int = 64
    max_held: int = 10_000
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 600.0  # silence from an engine longer than this fails the request
    eject_s: float = 2.0
    replica: str = ""
    access_log: bool = False

    drain_s: float = 25.0  # after the drain delay: serve what is held/in flight this long at most

    # The edge (docs/security.md "The gateway's edge").
    max_header_block_bytes: int = 32 * 1024  # request line + every header of one request
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    idle_timeout_s: float = 75.0  # a keep-alive connection without a request is closed after this
    body_timeout_s: float = 60.0  # the whole body must arrive within this
    max_connections: int = 4096  # open client connections per replica; more get 503 at once
    max_json_depth: int = 64  # nesting of arrays/objects in a JSON body
    trusted_proxy_hops: int = 0  # X-Forwarded-For entries kept from proxies in front
    forwarded_routes: tuple[str, ...] = FORWARDED_ROUTES
    ttfb_timeout_s: float = 60.0  # streaming answer: request sent -> first byte from the engine
    max_eject_s: float = 60.0  # consecutive failures double an ejection up to this (or eject_s)
    drain_delay_s: float = 5.0  # on SIGTERM: not ready, serving as usual, for endpoint removal

    # Tenancy (docs/security.md): the namespaces a caller without an API key may use (keys off)
    # and an unscoped (old-format) key opens; names the admin claims cluster-wide.
    anonymous_namespaces: tuple[str, ...] = ("default",)
    global_models: tuple[tuple[str, str], ...] = ()  # (name, namespace/deployment)
    max_held_per_namespace: int | None = 2_000
    max_held_per_key: int | None = 1_000
    # /demand: the operator's bearer token (None: refused, unless insecure_demand)
    demand_token_file: Path | None = None
    insecure_demand: bool = False
    max_demand_streams: int = 8

    def __post_init__(self) -> None:
        for flag, port in (("--port", self.port), ("--admin-port", self.admin_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag} must be in [0, 65535], got {port}")
        if self.port and self.admin_port == self.port:
            raise ConfigError("--admin-port must differ from --port")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ConfigError(f"--max-header-bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_header_block_bytes < self.max_header_bytes:
            raise ConfigError(
                f"--max-header-block-bytes ({self.max_header_block_bytes}) must be >= "
                f"--max-header-bytes ({self.max_header_bytes})"
            )
        if self.max_headers < 8:
            raise ConfigError(f"--max-headers must be >= 8, got {self.max_headers}")
        if self.max_held < 0:
            raise ConfigError(f"--max-held must be >= 0, got {self.max_held}")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not 2 <= self.max_json_depth <= 512:
            raise ConfigError(f"--max-json-depth must be in [2, 512], got {self.max_json_depth}")
        if not 0 <= self.trusted_proxy_hops <= 16:
            raise ConfigError(
                f"--trusted-proxy-hops must be in [0, 16], got {self.trusted_proxy_hops}"
            )
        for route in self.forwarded_routes:
            if not _ROUTE.fullmatch(route) or route.split("/")[2] == "models":
                raise ConfigError(
                    f"--route {route!r}: a normalised path under /v1/ (segments of letters, "
                    "digits, '-' and '_'; not /v1/models), e.g. /v1/embeddings"
                )
        for flag, cap in (
            ("--max-held-per-namespace", self.max_held_per_namespace),
            ("--max-held-per-key", self.max_held_per_key),
        ):
            if cap is not None and cap < 0:
                raise ConfigError(f"{flag} must be >= 0, got {cap}")
        if self.max_demand_streams < 1:
            raise ConfigError(f"--max-demand-streams must be >= 1, got {self.max_demand_streams}")
        from .names import NAMESPACE_RE

        for ns in self.anonymous_namespaces:
            if not NAMESPACE_RE.match(ns):
                raise ConfigError(f"--anonymous-namespace: {ns!r} is not a namespace name")
        for name, target in self.global_models:
            if not name or target.count("/") != 1 or not NAMESPACE_RE.match(target.split("/")[0]):
                raise ConfigError(
                    f"--global-model must be NAME=NAMESPACE/DEPLOYMENT, got {name}={target}"
                )
        for flag, v in (
            ("--connect-timeout", self.connect_timeout_s),
            ("--read-timeout", self.read_timeout_s),
            ("--eject-seconds", self.eject_s),
            ("--max-eject-seconds", self.max_eject_s),
            ("--drain-seconds", self.drain_s),
            ("--header-timeout", self.header_timeout_s),
            ("--idle-timeout", self.idle_timeout_s),
            ("--body-timeout", self.body_timeout_s),
            ("--ttfb-timeout", self.ttfb_timeout_s),
        ):
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{flag} must be > 0 seconds, got {v}")
        if not (math.isfinite(self.drain_delay_s) and self.drain_delay_s >= 0):
            raise ConfigError(f"--drain-delay must be >= 0 seconds, got {self.drain_delay_s}")
