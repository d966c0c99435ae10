"""``warmserve gateway``'s handler: the flags checked into the replica's settings
(:class:`~warmserve_gateway.config.GatewayConfig`), then the gateway served until SIGTERM/SIGINT,
drained first."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from warmserve.flags import CliError, tracing
from warmserve.tracing import TracingConfigError

from ..config import GatewayConfig


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from ..auth import ApiKeyError
    from ..config import FORWARDED_ROUTES, ConfigError
    from ..names import parse_global

    anonymous = tuple(args.anonymous_namespaces) or (os.environ.get("POD_NAMESPACE") or "default",)
    try:
        global_models = tuple(parse_global(args.global_models).items())
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if args.demand_token_file is not None and not (
        args.demand_token_file.is_file() and args.demand_token_file.read_text().strip()
    ):
        raise CliError(f"--demand-token-file: {args.demand_token_file} is not a file with a token")
    try:
        config = GatewayConfig(
            host=args.host,
            port=args.port,
            admin_host=args.admin_host,
            admin_port=args.admin_port,
            namespaces=tuple(args.namespaces),
            static_models=args.models_file,
            api_keys=args.api_keys,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_headers=args.max_headers,
            max_held=args.max_held,
            connect_timeout_s=args.connect_timeout,
            read_timeout_s=args.read_timeout,
            eject_s=args.eject_seconds,
            drain_s=args.drain_seconds,
            drain_delay_s=args.drain_delay,
            max_header_block_bytes=args.max_header_block_bytes,
            header_timeout_s=args.header_timeout,
            idle_timeout_s=args.idle_timeout,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
            max_json_depth=args.max_json_depth,
            trusted_proxy_hops=args.trusted_proxy_hops,
            forwarded_routes=tuple(dict.fromkeys((*FORWARDED_ROUTES, *args.routes))),
            ttfb_timeout_s=args.ttfb_timeout,
            max_eject_s=args.max_eject_seconds,
            replica=args.replica,
            access_log=args.access_log,
            anonymous_namespaces=anonymous,
            global_models=global_models,
            max_held_per_namespace=args.max_held_per_namespace,
            max_held_per_key=args.max_held_per_key,
            demand_token_file=args.demand_token_file,
            insecure_demand=args.insecure_demand,
            max_demand_streams=args.max_demand_streams,
        )
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    try:
        traces = tracing.from_args(args, "warmserve-gateway")
    except TracingConfigError as exc:
        raise CliError(str(exc)) from None
    if config.api_keys is not None and not config.api_keys.exists():
        raise CliError(f"--api-keys: {config.api_keys} does not exist")
    runner = _loop_runner(args.event_loop)
    try:
        source = _source(config)
        runner(_serve(config, source, args.address_file, traces))
    except ApiKeyError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _loop_runner(choice: str) -> Any:
    """``asyncio.run`` on the chosen event loop."""
    import asyncio

    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise CliError("--event-loop uvloop: uvloop is not installed") from None
        return asyncio.run
    return uvloop.run


def _source(config: Any) -> Any:
    if config.static_models is not None:
        from ..discovery import FileSource

        try:
            return FileSource(config.static_models)
        except (OSError, ValueError) as exc:
            raise CliError(f"--models-file: {exc}") from exc
    from kubernetes import config as kconfig

    from ..discovery import KubeSource

    try:
        return KubeSource(config.namespaces)
    except (kconfig.ConfigException, FileNotFoundError, TypeError) as exc:
        raise CliError(
            f"no Kubernetes cluster configured ({exc}); set KUBECONFIG, run in a cluster, "
            "or give --models-file"
        ) from exc


async def _serve(config: Any, source: Any, address_file: Path | None, traces: Any = None) -> None:
    import asyncio
    import json
    import signal

    from ..server import Gateway

    gw = Gateway(config, source, tracing=traces)
    await gw.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if address_file is not None:
        tmp = address_file.with_name(address_file.name + ".tmp")
        tmp.write_text(json.dumps(gw.urls))
        tmp.replace(address_file)
    try:
        await stop.wait()
        await gw.drain()
    finally:
        await gw.stop()
