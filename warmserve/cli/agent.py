"""``warmserve agent``: run the node agent; ``warmserve agent inspect ADDR``: show what it holds;
``warmserve agent reset-fence``: an admin's recovery of a fenced agent (:mod:`.agent_fence`).

The agent owns one node's GPUs (a worker process per GPU, prewarm slots, engines) and serves the
gRPC API ``warmserve.agent.v1`` that the operator drives.  ``inspect`` is in
:mod:`warmserve.cli.agent_inspect`.  See docs/agent.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from warmserve import tracing
from warmserve.cli import CliError, engine_arg_flags
from warmserve.cli.agent_fence import register as register_reset_fence
from warmserve.cli.agent_inspect import inspect_agent

DEFAULT_LISTEN = "127.0.0.1:50051"


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
    p.add_argument(
        "--listen", default=DEFAULT_LISTEN, help=f"gRPC address (default {DEFAULT_LISTEN})"
    )
    p.add_argument(
        "--model-dir",
        default=os.environ.get("WARMSERVE_MODEL_DIR", "models"),
        help="weight store: <dir>/<model>/config.json + *.safetensors, ORG/NAME models in "
        "<dir>/ORG~NAME (default $WARMSERVE_MODEL_DIR or ./models)",
    )
    p.add_argument("--node-name", help="node name reported to the operator (default: hostname)")
    p.add_argument("--page-size", default="2MiB", help="page size of the GPU page pool (2MiB)")
    p.add_argument(
        "--gpu-reserve",
        default="4GiB",
        help="real GPUs: memory left outside the page pool on each GPU for an engine's own "
        "allocations (activations, CUDA graphs, workspaces); the pool is sized from the memory "
        "free at start minus this (default 4GiB)",
    )
    p.add_argument(
        "--spare-workers", type=int, default=1, help="pre-started spare worker processes (1)"
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
        default=0.0,
        help="simulated GPUs: host-to-GPU copy bandwidth in GB/s (0: memcpy speed)",
    )
    p.add_argument(
        "--sim-map-us",
        type=float,
        default=0.0,
        help="simulated GPUs: cost of mapping one page, in microseconds (0: free)",
    )
    p.add_argument(
        "--memory-dir",
        help="directory for simulated GPU memory (default: a new warmserve-<node>-<id> under "
        "--memory-root)",
    )
    p.add_argument(
        "--memory-root",
        default="/dev/shm",
        help="where per-agent simulated memory directories go (default /dev/shm); directories "
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
        default=300.0,
        metavar="SECONDS",
        help="refuse a fencing token whose Lease creation time lies more than this past the "
        "node's clock (300)",
    )
    p.add_argument(
        "--fencing-max-term-jump",
        type=int,
        default=1024,
        metavar="N",
        help="refuse a fencing token more than N leadership terms past the fence within one "
        "Lease (1024)",
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
        default="127.0.0.1",
        help="metrics bind address (127.0.0.1; 0.0.0.0 in a pod)",
    )
    p.add_argument(
        "--engine-host",
        default="127.0.0.1",
        help="address engines bind their OpenAI endpoints to (127.0.0.1; 0.0.0.0 in a pod)",
    )
    p.add_argument(
        "--advertise-host",
        default="",
        help="host put in the endpoints Activate returns (default --engine-host; required "
        "with --engine-host 0.0.0.0, e.g. the pod IP)",
    )
    tracing.add_arguments(p)  # the engines' traces (vLLM: --otlp-traces-endpoint)
    p.add_argument(
        "--engines",
        default="simulated",
        help="comma-separated engines this node hosts; worker processes preload their "
        "libraries (simulated, vllm; default simulated)",
    )
    p.add_argument(
        "--engine",
        default="",
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
        default="0",
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
        default=3,
        help="tries per file before a fetch fails (a file failing its checksum is fetched again)",
    )
    src.add_argument(
        "--hf-endpoint",
        default=os.environ.get("HF_ENDPOINT", ""),
        help="Hugging Face Hub endpoint (default $HF_ENDPOINT or the public hub)",
    )
    src.add_argument("--hf-token-file", help="file with the Hugging Face token (gated/private)")
    src.add_argument(
        "--s3-endpoint-url",
        default=os.environ.get("AWS_ENDPOINT_URL_S3", ""),
        help="S3-compatible endpoint (default $AWS_ENDPOINT_URL_S3 or AWS); credentials come "
        "from boto3's usual chain (AWS_ACCESS_KEY_ID, ...)",
    )
    src.add_argument("--s3-region", default="", help="S3 region (default: boto3's)")
    src.add_argument(
        "--pvc-root",
        default="/mnt/warmserve/pvc",
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
    engine_arg_flags.add_flags(p)
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


def _config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from warmserve_agent.config import AgentConfig, ConfigError, parse_simulated_gpus
    from warmserve_agent.sources.disk_reserve import parse_reserve

    from warmserve.units import SizeError, parse_size

    try:
        sim = None
        if args.simulate_gpus:
            sim = parse_simulated_gpus(args.simulate_gpus)
        elif args.gpus != "auto":
            raise CliError("choose --gpus auto (real GPUs) or --simulate-gpus NxSIZE")
        page = parse_size(args.page_size, "--page-size")
        budget = parse_size(args.store_budget, "--store-budget")
        store_reserve = parse_reserve(args.store_reserve)
        reserve = parse_size(args.gpu_reserve, "--gpu-reserve")
    except (ConfigError, SizeError) as exc:
        raise CliError(str(exc)) from None
    if page < 4096 or page & (page - 1):
        raise CliError(f"--page-size must be a power of two >= 4KiB, got {args.page_size}")
    if sim and min(sim) < page:
        raise CliError(
            f"--simulate-gpus {args.simulate_gpus}: each GPU needs at least one page "
            f"(--page-size {args.page_size}); e.g. 8x80GiB"
        )
    model_dir = Path(args.model_dir)
    if not model_dir.is_dir():
        raise CliError(f"--model-dir {model_dir} is not a directory (the weight store)")
    for flag in ("tls_cert", "tls_key", "client_ca", "token_file"):
        val = getattr(args, flag)
        if val and not Path(val).is_file():
            raise CliError(f"--{flag.replace('_', '-')} {val}: no such file")
    if args.spare_workers < 0:
        raise CliError("--spare-workers must be >= 0")
    if args.fetch_attempts < 1:
        raise CliError("--fetch-attempts must be >= 1")
    if args.hf_token_file and not Path(args.hf_token_file).is_file():
        raise CliError(f"--hf-token-file {args.hf_token_file}: no such file")
    for d in args.allow_path:
        if not Path(d).is_absolute():
            raise CliError(f"--allow-path {d}: give an absolute directory")
    if args.fencing_max_skew < 0 or args.fencing_max_term_jump < 1:
        raise CliError("--fencing-max-skew must be >= 0 and --fencing-max-term-jump >= 1")
    if (args.allow_client_id or args.allow_reader_id) and not args.client_ca:
        raise CliError(
            "--allow-client-id/--allow-reader-id check client certificates: they need mutual "
            "TLS (--tls-cert, --tls-key, --client-ca)"
        )
    from warmserve_agent.auth import parse_identity

    try:
        for ident in (*args.allow_client_id, *args.allow_reader_id):
            parse_identity(ident)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.sim_copy_gbps < 0 or args.sim_map_us < 0:
        raise CliError("--sim-copy-gbps and --sim-map-us must be >= 0")
    from warmserve_agent.engines import ENGINES

    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    bad = [e for e in engines if e not in ENGINES]
    if not engines or bad:
        raise CliError(f"--engines {args.engines!r}: choose from {', '.join(ENGINES)}")
    if args.engine and args.engine not in engines:
        raise CliError(f"--engine {args.engine!r} must be one of --engines ({', '.join(engines)})")
    kw: dict[str, Any] = {}
    if args.node_name:
        kw["node_name"] = args.node_name
    try:
        traces = tracing.from_args(args, "warmserve-engine")
    except tracing.TracingConfigError as exc:
        raise CliError(str(exc)) from None
    if traces is not None:
        kw["engine_traces_endpoint"] = traces.endpoint
        kw["engine_trace_sample_ratio"] = traces.sample_ratio
    return AgentConfig(
        model_dir=model_dir,
        simulate_gpus=sim,
        listen=args.listen,
        page_bytes=page,
        gpu_reserve_bytes=reserve,
        memory_dir=Path(args.memory_dir) if args.memory_dir else None,
        memory_root=Path(args.memory_root),
        spare_workers=args.spare_workers,
        recycle_workers=args.recycle_workers,
        memory_in_workers=args.memory_in_workers,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        client_ca=Path(args.client_ca) if args.client_ca else None,
        client_ids=tuple(args.allow_client_id),
        reader_ids=tuple(args.allow_reader_id),
        token_file=Path(args.token_file) if args.token_file else None,
        fencing_file=Path(args.fencing_file) if args.fencing_file else None,
        require_fencing_token=args.require_fencing_token,
        fencing_max_skew_s=args.fencing_max_skew,
        fencing_max_term_jump=args.fencing_max_term_jump,
        allow_insecure_listen=args.allow_insecure_listen,
        metrics_port=args.metrics_port,
        sim_copy_bytes_per_s=args.sim_copy_gbps * 1e9,
        sim_map_s_per_page=args.sim_map_us * 1e-6,
        metrics_host=args.metrics_host,
        engine_host=args.engine_host,
        advertise_host=args.advertise_host,
        store_budget_bytes=budget,
        store_reserve=store_reserve,
        fetch_attempts=args.fetch_attempts,
        hf_endpoint=args.hf_endpoint,
        hf_token_file=Path(args.hf_token_file) if args.hf_token_file else None,
        s3_endpoint_url=args.s3_endpoint_url,
        s3_region=args.s3_region,
        pvc_root=Path(args.pvc_root),
        allowed_paths=tuple(Path(d) for d in args.allow_path),
        engines=engines,
        default_engine=args.engine or engines[0],
        engine_policy=engine_arg_flags.policy(args),
        **kw,
    )


def run_agent(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from warmserve_agent.backends.cuda_driver import CudaError
    from warmserve_agent.config import ConfigError
    from warmserve_agent.server import AgentServer

    cfg = _config(args)
    logging.basicConfig(
        level=args.log_level,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    engine_arg_flags.log_policy(cfg.engine_policy, logging.getLogger("warmserve.agent"))

    async def main() -> None:
        server = AgentServer(cfg)
        try:
            await server.start()  # cleans up after itself on failure
        except (ConfigError, CudaError) as exc:
            raise CliError(str(exc)) from None
        print(f"warmserve agent: serving on {server.address} ({len(server.core.gpus)} GPUs)")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    return 0
