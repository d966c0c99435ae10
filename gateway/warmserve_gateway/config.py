"""Settings of one gateway replica (``warmserve gateway`` flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


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

    drain_s: float = 25.0  # on SIGTERM: serve what is held/in flight this long at most

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
        if self.max_headers < 8:
            raise ConfigError(f"--max-headers must be >= 8, got {self.max_headers}")
        if self.max_held < 0:
            raise ConfigError(f"--max-held must be >= 0, got {self.max_held}")
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
            ("--drain-seconds", self.drain_s),
        ):
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{flag} must be > 0 seconds, got {v}")
