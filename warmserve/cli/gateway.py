"""``warmserve gateway``: the OpenAI-compatible endpoint in front of every ModelDeployment."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from warmserve import tracing


def _size(text: str) -> int:
    """``4194304``, ``4MiB``, ``16KiB`` -> bytes, by the one size parser (warmserve.units)."""
    from warmserve.units import SizeError, parse_size

    try:
        return parse_size(text, "size")
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="run the OpenAI-compatible gateway (routes by model, holds through cold starts)",
        description=(
            "Run one gateway replica: an OpenAI-compatible API (/v1/models, /v1/completions, "
            "/v1/chat/completions with SSE streaming, more POST routes with --route) that "
            "routes each request to a serving instance of the ModelDeployment its 'model' names, "
            "holds requests in a per-model queue while no instance has room (scale from zero), "
            "and reports the held requests to the operator on the admin port (/demand). "
            "ModelDeployments are watched through the kubeconfig ($KUBECONFIG or "
            "~/.kube/config) or the in-cluster service account; --models-file reads them from "
            "a file instead (no Kubernetes)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0", help="address of the API listener")
    p.add_argument("--port", type=int, default=8000, help="API port (0: any free port)")
    p.add_argument("--admin-host", default="0.0.0.0", help="address of the admin listener")
    p.add_argument(
        "--admin-port",
        type=int,
        default=9092,
        help="admin port: /metrics, /demand (read by the operator), /healthz (0: any free port)",
    )
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        dest="namespaces",
        help="serve ModelDeployments of this namespace only (repeatable; default: all)",
    )
    p.add_argument(
        "--models-file",
        type=Path,
        default=None,
        help="read ModelDeployment objects (with status.instances) from this YAML/JSON file "
        "instead of the Kubernetes API; re-read when it changes (development, benchmarks)",
    )
    p.add_argument(
        "--api-keys",
        type=Path,
        default=os.environ.get("WARMSERVE_GATEWAY_API_KEYS") or None,
        help="require 'Authorization: Bearer <key>': a directory with one key per file (a "
        "mounted Secret) or a file with one key per line; re-read when it changes "
        "(env WARMSERVE_GATEWAY_API_KEYS; default: no keys, anyone may call)",
    )
    p.add_argument(
        "--anonymous-namespace",
        action="append",
        default=[],
        dest="anonymous_namespaces",
        metavar="NS",
        help="namespace whose models callers may use when API keys are off, and that a key "
        "without a <namespace>. prefix opens (repeatable; default: $POD_NAMESPACE, else "
        "'default'; the chart passes its release namespace)",
    )
    p.add_argument(
        "--global-model",
        action="append",
        default=[],
        dest="global_models",
        metavar="NAME=NAMESPACE/DEPLOYMENT",
        help="claim NAME for every caller: it means that ModelDeployment (repeatable; Helm "
        "gateway.globalModels); a tenant's deployment never claims a name outside its namespace",
    )
    p.add_argument(
        "--max-held-per-namespace",
        type=int,
        default=2_000,
        help="requests held at this replica for the models of one namespace; more get 429",
    )
    p.add_argument(
        "--max-held-per-key",
        type=int,
        default=1_000,
        help="requests held at this replica for one API key; more get 429",
    )
    p.add_argument(
        "--demand-token-file",
        type=Path,
        default=os.environ.get("WARMSERVE_DEMAND_TOKEN_FILE") or None,
        help="bearer token /demand requires (the operator's --gateway-token-file; re-read when "
        "it changes); without it /demand refuses every request unless --insecure-demand",
    )
    p.add_argument(
        "--insecure-demand",
        action="store_true",
        help="serve /demand without a token (development only: anyone reaching the admin port "
        "reads the held demand and may open streams)",
    )
    p.add_argument(
        "--max-demand-streams",
        type=int,
        default=8,
        help="open /demand?watch=1 streams at once (one per operator replica is needed)",
    )
    p.add_argument("--max-body-bytes", type=_size, default="4MiB", help="larger bodies get 413")
    p.add_argument(
        "--max-header-bytes", type=_size, default="16KiB", help="longest request line / header"
    )
    p.add_argument("--max-headers", type=int, default=64, help="most request headers")
    p.add_argument(
        "--max-header-block-bytes",
        type=_size,
        default="32KiB",
        help="request line + all headers of one request; more get 431 and the connection ends",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for the request line + headers (from the accept, or from their first "
        "byte on a kept-alive connection); later gets 408",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=75.0,
        help="seconds a kept-alive connection may wait for its next request (keep it above the "
        "idle timeout of an HTTP load balancer in front)",
    )
    p.add_argument(
        "--body-timeout", type=float, default=60.0, help="seconds for a request body; later: 408"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="open client connections at this replica; more get 503 + Retry-After at once",
    )
    p.add_argument(
        "--max-json-depth",
        type=int,
        default=64,
        help="nesting of arrays/objects in a JSON body; deeper gets 400",
    )
    p.add_argument(
        "--trusted-proxy-hops",
        type=int,
        default=0,
        help="X-Forwarded-For entries appended by proxies in front of the gateway that it keeps "
        "(0: the client's X-Forwarded-For is dropped); the connection's peer is appended",
    )
    p.add_argument(
        "--route",
        action="append",
        default=[],
        dest="routes",
        help="forward POST requests on this OpenAI route too, e.g. /v1/embeddings (repeatable; "
        "always: /v1/chat/completions, /v1/completions)",
    )
    p.add_argument(
        "--max-held",
        type=int,
        default=10_000,
        help="requests held over all models at this replica; more get 429",
    )
    p.add_argument("--connect-timeout", type=float, default=3.0, help="seconds to reach an engine")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds an engine may stay silent in the middle of an answer, or before the "
        "first byte of a non-streaming one",
    )
    p.add_argument(
        "--ttfb-timeout",
        type=float,
        default=60.0,
        help="seconds from sending a streaming request to the engine's first byte (its "
        "prefill); later: the instance is ejected and the request retried elsewhere",
    )
    p.add_argument(
        "--eject-seconds",
        type=float,
        default=2.0,
        help="an instance refusing connections or too slow to a first byte gets no request "
        "for this long; doubled per consecutive failure",
    )
    p.add_argument(
        "--max-eject-seconds",
        type=float,
        default=60.0,
        help="longest ejection after consecutive failures",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=5.0,
        help="on SIGTERM, first serve as usual (not ready) this long, while Kubernetes "
        "removes the replica from the Service's endpoints",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=25.0,
        help="after the drain delay, keep serving held and running requests this long at "
        "most; then held ones get 503 + Retry-After",
    )
    p.add_argument(
        "--replica",
        default=os.environ.get("POD_NAME") or "",
        help="this replica's name in /demand reports (default: $POD_NAME, else host-pid-random)",
    )
    p.add_argument(
        "--address-file",
        type=Path,
        default=None,
        help='once serving, write {"api": URL, "admin": URL} as JSON to this file',
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="asyncio event loop: uvloop (faster proxying) when installed with auto",
    )
    tracing.add_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from warmserve.cli import CliError

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from warmserve_gateway.auth import ApiKeyError
    from warmserve_gateway.config import FORWARDED_ROUTES, ConfigError, GatewayConfig
    from warmserve_gateway.names import parse_global

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
    except tracing.TracingConfigError as exc:
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

    from warmserve.cli import CliError

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
    from warmserve.cli import CliError

    if config.static_models is not None:
        from warmserve_gateway.discovery import FileSource

        try:
            return FileSource(config.static_models)
        except (OSError, ValueError) as exc:
            raise CliError(f"--models-file: {exc}") from exc
    from kubernetes import config as kconfig
    from warmserve_gateway.discovery import KubeSource

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

    from warmserve_gateway.server import Gateway

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
