"""``warmserve agent``'s handler: the flags checked into the agent's settings
(:class:`~warmserve_agent.config.AgentConfig`), then the agent served until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
from typing import Any

from warmserve.flags import CliError, engine_args, tracing
from warmserve.tracing import TracingConfigError


def _config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from warmserve.units import SizeError, parse_size

    from ..config import AgentConfig, ConfigError, parse_simulated_gpus
    from ..sources.disk_reserve import parse_reserve

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
    from ..auth import parse_identity

    try:
        for ident in (*args.allow_client_id, *args.allow_reader_id):
            parse_identity(ident)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.sim_copy_gbps < 0 or args.sim_map_us < 0:
        raise CliError("--sim-copy-gbps and --sim-map-us must be >= 0")
    from ..engines import ENGINES

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
    except TracingConfigError as exc:
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
        engine_policy=engine_args.policy(args),
        **kw,
    )


def run_agent(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from ..backends.cuda_driver import CudaError
    from ..config import ConfigError
    from ..server import AgentServer

    cfg = _config(args)
    logging.basicConfig(
        level=args.log_level,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    engine_args.log_policy(cfg.engine_policy, logging.getLogger("warmserve.agent"))

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
