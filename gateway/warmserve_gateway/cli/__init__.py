"""``warmserve gateway``: the OpenAI-compatible endpoint in front of every ModelDeployment.

The flags are here; :mod:`.run` turns them into the replica's settings and serves.  Every flag
that sets a :class:`~warmserve_gateway.config.GatewayConfig` field takes its default from that
field (:func:`warmserve.flags.default`): the settings state each default once.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from warmserve.flags import default, tracing
from warmserve.units import size_flag

from ..config import GatewayConfig
from .run import run

__all__ = ["register", "run"]


def _default(name: str) -> Any:
    return default(GatewayConfig, name)


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
    p.add_argument("--host", default=_default("host"), help="address of the API listener")
    p.add_argument("--port", type=int, default=_default("port"), help="API port (0: any free port)")
    p.add_argument(
        "--admin-host",
        default=_default("admin_host"),
        help="address of the admin listener",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        default=_default("admin_port"),
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
        default=_default("max_held_per_namespace"),
        help="requests held at this replica for the models of one namespace; more get 429",
    )
    p.add_argument(
        "--max-held-per-key",
        type=int,
        default=_default("max_held_per_key"),
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
        default=_default("max_demand_streams"),
        help="open /demand?watch=1 streams at once (one per operator replica is needed)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_size,
        default=size_flag(_default("max_body_bytes")),
        help="larger bodies get 413",
    )
    p.add_argument(
        "--max-header-bytes",
        type=_size,
        default=size_flag(_default("max_header_bytes")),
        help="longest request line / header",
    )
    p.add_argument(
        "--max-headers",
        type=int,
        default=_default("max_headers"),
        help="most request headers",
    )
    p.add_argument(
        "--max-header-block-bytes",
        type=_size,
        default=size_flag(_default("max_header_block_bytes")),
        help="request line + all headers of one request; more get 431 and the connection ends",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=_default("header_timeout_s"),
        help="seconds for the request line + headers (from the accept, or from their first "
        "byte on a kept-alive connection); later gets 408",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=_default("idle_timeout_s"),
        help="seconds a kept-alive connection may wait for its next request (keep it above the "
        "idle timeout of an HTTP load balancer in front)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=_default("body_timeout_s"),
        help="seconds for a request body; later: 408",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=_default("max_connections"),
        help="open client connections at this replica; more get 503 + Retry-After at once",
    )
    p.add_argument(
        "--max-json-depth",
        type=int,
        default=_default("max_json_depth"),
        help="nesting of arrays/objects in a JSON body; deeper gets 400",
    )
    p.add_argument(
        "--trusted-proxy-hops",
        type=int,
        default=_default("trusted_proxy_hops"),
        help="X-Forwarded-For entries appended by proxies in front of the gateway that it keeps "
        "(0: the client's X-Forwarded-For is dropped); the connection's peer is appended",
    )
    p.add_argument(
        "--route",
        action="append",
        default=[],
        dest="routes",
        help="forward POST requests on this OpenAI route too, e.g. /v1/score (repeatable; "
        "always: /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings)",
    )
    p.add_argument(
        "--max-held",
        type=int,
        default=_default("max_held"),
        help="requests held over all models at this replica; more get 429",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=_default("connect_timeout_s"),
        help="seconds to reach an engine",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=_default("read_timeout_s"),
        help="seconds an engine may stay silent in the middle of an answer, or before the "
        "first byte of a non-streaming one",
    )
    p.add_argument(
        "--ttfb-timeout",
        type=float,
        default=_default("ttfb_timeout_s"),
        help="seconds from sending a streaming request to the engine's first byte (its "
        "prefill); later: the instance is ejected and the request retried elsewhere",
    )
    p.add_argument(
        "--eject-seconds",
        type=float,
        default=_default("eject_s"),
        help="an instance refusing connections or too slow to a first byte gets no request "
        "for this long; doubled per consecutive failure",
    )
    p.add_argument(
        "--max-eject-seconds",
        type=float,
        default=_default("max_eject_s"),
        help="longest ejection after consecutive failures",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=_default("drain_delay_s"),
        help="on SIGTERM, first serve as usual (not ready) this long, while Kubernetes "
        "removes the replica from the Service's endpoints",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=_default("drain_s"),
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
