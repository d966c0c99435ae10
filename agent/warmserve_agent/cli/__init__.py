"""``warmserve agent``: run the node agent; ``warmserve agent inspect ADDR``: show what it holds;
``warmserve agent reset-fence``: an admin's recovery of a fenced agent (:mod:`.reset_fence`).

The agent owns one node's GPUs (a worker process per GPU, prewarm slots, engines) and serves the
gRPC API ``warmserve.agent.v1`` that the operator drives.  The flags are here, and every default
the agent's settings hold is read from them (:class:`~warmserve_agent.config.AgentConfig`,
through :func:`warmserve.flags.default`); :mod:`.run` turns the flags into those settings and
serves, ``inspect`` is :mod:`.inspect`.  See docs/agent.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from warmserve.flags import default, engine_args, tracing
from warmserve.units import size_flag

from ..config import AgentConfig
from .inspect import inspect_agent
from .reset_fence import register as register_reset_fence
from .run import run_agent

__all__ = ["register", "run_agent"]


def _size(name: str) -> str:
    """An :class:`AgentConfig` size's default as its flag reads it ("2MiB")."""
    return size_flag(default(AgentConfig, name))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "agent",
        help="run the node agent (or inspect a running one)",
        description=(
            "Run the WarmServe node agent: one worker process per GPU, prewarm slots over a "
            "page pool, engines, and the gRPC API the operator drives. "
            "`warmserve agent inspect ADDR` shows a running agent's GPUs, slots and instances."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  warmserve agent --simulate-gpus 8x80GiB --model-dir ./models\n"
            "  warmserve agent --gpus auto --listen 0.0.0.0:50051 --tls-cert tls.crt \\\n"
            "      --tls-key tls.key --client-ca ca.crt --allow-client-id CN=warmserve-operator\n"
            "  warmserve agent inspect 127.0.0.1:50051 --json\n"
            "  warmserve agent reset-fence --model-dir /models --reason 'Lease was recreated'"
        ),
    )
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument(
        "--gpus", choices=["auto"], help="use this node's real GPUs (CUDA VMM; needs cuda-python)"
    )
    gpus.add_argument(
        "--simulate-gpus",
        metavar="NxSIZE",
        help="simulated GPUs, e.g. 8x80GiB (memory is a sparse shared file per GPU)",
    )
    listen = default(AgentConfig, "listen")
    p.add_argument("--listen", default=listen, help=f"gRPC address (default {listen})")
    p.add_argument(
        "--model-dir",
        default=os.environ.get("WARMSERVE_MODEL_DIR", "models"),
        help="weight store: <dir>/<model>/config.json + *.safetensors, ORG/NAME models in "
        "<dir>/ORG~NAME (default $WARMSERVE_MODEL_DIR or ./models)",
    )
    p.add_argument("--node-name", help="node name reported to the operator (default: hostname)")
    page = _size("page_bytes")
    p.add_argument("--page-size", default=page, help=f"page size of the GPU page pool ({page})")
    p.add_argument(
        "--gpu-reserve",
        default=_size("gpu_reserve_bytes"),
        help="real GPUs: memory left outside the page pool on each GPU for an engine's own "
        "allocations (activations, CUDA graphs, workspaces); the pool is sized from the memory "
        "free at start minus this (default %(default)s)",
    )
    p.add_argument(
        "--spare-workers",
        type=int,
        default=default(AgentConfig, "spare_workers"),
        help="pre-started spare worker processes (%(default)s)",
    )
    p.add_argument(
        "--recycle-workers",
        action="store_true",
        help="replace a GPU's worker process (from the spares) after each instance ends",
    )
    p.add_argument(
        "--memory-in-workers",
        action="store_true",
        default=None,
        help="each GPU's worker process owns its memory (always so with --gpus auto); "
        "a crashed worker then loses that GPU's slots",
    )
    p.add_argument(
        "--sim-copy-gbps",
        type=float,
        default=default(AgentConfig, "sim_copy_bytes_per_s") / 1e9,
        help="simulated GPUs: host-to-GPU copy bandwidth in GB/s (0: memcpy speed)",
    )
    p.add_argument(
        "--sim-map-us",
        type=float,
        default=default(AgentConfig, "sim_map_s_per_page") * 1e6,
        help="simulated GPUs: cost of mapping one page, in microseconds (0: free)",
    )
    p.add_argument(
        "--memory-dir",
        help="directory for simulated GPU memory (default: a new warmserve-<node>-<id> under "
        "--memory-root)",
    )
    p.add_argument(
        "--memory-root",
        default=str(default(AgentConfig, "memory_root")),
        help="where per-agent simulated memory directories go (default %(default)s); directories "
        "of agents that died there are removed at start",
    )
    p.add_argument("--tls-cert", help="server certificate (PEM); enables TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--client-ca", help="CA (PEM) that client certificates must chain to (mTLS)")
    p.add_argument(
        "--allow-client-id",
        action="append",
        default=[],
        metavar="ID",
        help="mTLS: a client certificate identity allowed to call everything, CN=<name> or a URI "
        "SAN (spiffe://...); repeatable (default CN=warmserve-operator, the operator's)",
    )
    p.add_argument(
        "--allow-reader-id",
        action="append",
        default=[],
        metavar="ID",
        help="mTLS: an identity allowed only Describe and Watch without a fencing token "
        "(an admin's `warmserve agent inspect`); repeatable (default none)",
    )
    p.add_argument("--token-file", help="file holding the bearer token every call must carry")
    p.add_argument(
        "--fencing-file",
        help="where the highest operator leadership term (fencing token) seen is kept across "
        "restarts, so a deposed leader's late calls stay refused (default "
        "<model-dir>/.warmserve-fencing.json)",
    )
    p.add_argument(
        "--require-fencing-token",
        action="store_true",
        help="refuse mutating calls that carry no fencing token (the warmserve CLI, other "
        "tools); calls with a lower token than the highest seen are always refused",
    )
    p.add_argument(
        "--fencing-max-skew",
        type=float,
        default=default(AgentConfig, "fencing_max_skew_s"),
        metavar="SECONDS",
        help="refuse a fencing token whose Lease creation time lies more than this past the "
        f"node's clock ({default(AgentConfig, 'fencing_max_skew_s'):g})",
    )
    p.add_argument(
        "--fencing-max-term-jump",
        type=int,
        default=default(AgentConfig, "fencing_max_term_jump"),
        metavar="N",
        help="refuse a fencing token more than N leadership terms past the fence within one "
        "Lease (%(default)s)",
    )
    p.add_argument(
        "--allow-insecure-listen",
        action="store_true",
        help="serve the API on a non-loopback --listen address without TLS client certificates "
        "or a token (refused otherwise: anyone reaching the port could drive the GPUs); logs a "
        "warning. Test clusters only",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on PORT")
    p.add_argument(
        "--metrics-host",
        default=default(AgentConfig, "metrics_host"),
        help="metrics bind address (%(default)s; 0.0.0.0 in a pod)",
    )
    p.add_argument(
        "--engine-host",
        default=default(AgentConfig, "engine_host"),
        help="address engines bind their OpenAI endpoints to (%(default)s; 0.0.0.0 in a pod)",
    )
    p.add_argument(
        "--advertise-host",
        default=default(AgentConfig, "advertise_host"),
        help="host put in the endpoints Activate returns (default --engine-host; required "
        "with --engine-host 0.0.0.0, e.g. the pod IP)",
    )
    tracing.add_arguments(p)  # the engines' traces (vLLM: --otlp-traces-endpoint)
    p.add_argument(
        "--engines",
        default=",".join(default(AgentConfig, "engines")),
        help="comma-separated engines this node hosts; worker processes preload their "
        "libraries (simulated, vllm; default %(default)s)",
    )
    p.add_argument(
        "--engine",
        default=default(AgentConfig, "default_engine"),
        help="engine of instances whose ModelDeployment names none (spec.engine.name); "
        "default: the first of --engines",
    )
    src = p.add_argument_group(
        "model sources",
        "filling the weight store on demand from a ModelDeployment's spec.model.source "
        "(hf://, s3://, pvc://, file://; see docs/model-sources.md)",
    )
    src.add_argument(
        "--store-budget",
        default=_size("store_budget_bytes"),
        metavar="SIZE",
        help="most disk the weight store may use, e.g. 500GiB; cold fetched models are evicted "
        "(least recently used first) to make room (0: no budget, only the disk's free space)",
    )
    src.add_argument(
        "--store-reserve",
        default="",
        metavar="SIZE|N%",
        help="free space on the store's filesystem a fetch never takes: a size (50GiB), a share "
        "(20%%) or 0 (none); a fetch that would go below it fails with RESOURCE_EXHAUSTED "
        "(default: the larger of 15%% of the filesystem and 10GiB)",
    )
    src.add_argument(
        "--fetch-attempts",
        type=int,
        default=default(AgentConfig, "fetch_attempts"),
        help="tries per file before a fetch fails (a file failing its checksum is fetched again)",
    )
    src.add_argument(
        "--hf-endpoint",
        default=os.environ.get("HF_ENDPOINT", default(AgentConfig, "hf_endpoint")),
        help="Hugging Face Hub endpoint (default $HF_ENDPOINT or the public hub)",
    )
    src.add_argument("--hf-token-file", help="file with the Hugging Face token (gated/private)")
    src.add_argument(
        "--s3-endpoint-url",
        default=os.environ.get("AWS_ENDPOINT_URL_S3", default(AgentConfig, "s3_endpoint_url")),
        help="S3-compatible endpoint (default $AWS_ENDPOINT_URL_S3 or AWS); credentials come "
        "from boto3's usual chain (AWS_ACCESS_KEY_ID, ...)",
    )
    src.add_argument(
        "--s3-region",
        default=default(AgentConfig, "s3_region"),
        help="S3 region (default: boto3's)",
    )
    src.add_argument(
        "--pvc-root",
        default=str(default(AgentConfig, "pvc_root")),
        help="where pvc://CLAIM volumes are mounted, one folder per claim",
    )
    src.add_argument(
        "--allow-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a node directory file:// sources may name (repeatable; none by default)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    engine_args.add_flags(p)
    p.set_defaults(func=run_agent)

    sub = p.add_subparsers(dest="agent_command", metavar="SUBCOMMAND")
    i = sub.add_parser(
        "inspect",
        help="show a running agent's GPUs, slots and instances",
        description="Show a running agent's GPUs (state, memory), prewarm slots (model, layers "
        "resident/total, bytes) and instances (endpoint, load).",
    )
    i.add_argument("address", metavar="ADDR", help="agent address, e.g. 127.0.0.1:50051")
    i.add_argument("--json", action="store_true", help="print the full description as JSON")
    i.add_argument("--token-file", dest="client_token_file", help="bearer token file")
    i.add_argument("--ca-cert", help="CA (PEM) of the agent's TLS certificate; enables TLS")
    i.add_argument("--client-cert", help="client certificate (PEM) for mTLS")
    i.add_argument("--client-key", help="client key (PEM) for mTLS")
    i.add_argument(
        "--server-name",
        help="name to verify in the agent's certificate (the chart's tls.serverName, "
        "warmserve-agent) when dialling it by IP",
    )
    i.add_argument("--timeout", type=float, default=10.0, help="seconds (10)")
    i.set_defaults(func=inspect_agent)
    register_reset_fence(sub)
