"""Building vLLM's engine and OpenAI app over a slot, and opening its endpoint: the two halves of
the ``vllm`` engine's start, which a prepared engine runs apart (``build`` at prewarm time,
``open_endpoint`` at activation).

:func:`build` parses the engine arguments with **vLLM's own** ``vllm serve`` parser, adds what
warmserve decides (``--load-format warmserve_slot``, ``--kv-cache-memory-bytes`` = the slot's KV
pages, ``--served-model-name``, TP 1, the in-process executor), builds ``AsyncLLM`` with its
engine core in this process (``inproc.py``) and the KV cache in the slot (``loader.slot_kv_cache``),
then vLLM's OpenAI app (``build_app`` + ``init_app_state``).  Nothing listens yet.

:func:`open_endpoint` binds the socket and serves the app with uvicorn.

Must run on the engine's asyncio loop (vLLM's client binds to the running loop).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmserve.engine_args import parse_engine_args
from warmserve.tracing import traces_url, vllm_tracing_env
from warmserve_agent.engine import EngineError, TtftWindow
from warmserve_agent.engines.spec import EngineSpec
from warmserve_agent.engines.vllm.hooks import slot_dtype, ttft_logger_factory


@dataclass
class Built:
    """vLLM's engine and app over one slot, not serving yet."""

    llm: Any  # AsyncLLM
    client: Any  # inproc.AsyncInprocClient
    args: Any  # the parsed ``vllm serve`` namespace
    app: Any  # vLLM's OpenAI FastAPI app, state initialised
    kv_bytes: int  # --kv-cache-memory-bytes
    server_config: Any  # uvicorn's config of the app, loaded (its middleware stack built)


def kv_bytes_of(spec: EngineSpec) -> int:
    """The slot's KV pages (after the weights' last page) of rank 0."""
    region = spec.regions[0]
    page = region.page_bytes
    return region.mapped_bytes - math.ceil(region.weight_bytes / page) * page


def serve_argv(spec: EngineSpec, key: str, kv_bytes: int) -> list[str]:
    """``vllm serve`` arguments: the tenant's (the agent applied its allowlist before:
    ``Activator.check_engine``) plus what warmserve sets."""
    user = parse_engine_args(spec.engine_args, policy=None)
    extra: dict[str, object] = {"warmserve_instance": key}
    if spec.tp_size > 1:  # rank 0's executor reaches the other ranks' pooled workers
        from warmserve_agent.engines.vllm.tp_executor import EXTRA_KEY

        extra[EXTRA_KEY] = {
            "peers": list(spec.tp_peers),
            "init": spec.tp_init,
            "authkey": spec.tp_authkey,
        }
    argv = [
        "--model",
        spec.model_dir,
        # parameters are views of the slot: compute in the checkpoint's dtype unless told
        *([] if "dtype" in user else ["--dtype", slot_dtype(spec)]),
        *spec.engine_args,
        "--served-model-name",
        spec.model,
        "--load-format",
        "warmserve_slot",
        "--model-loader-extra-config",
        json.dumps(extra),
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--tensor-parallel-size",
        str(spec.tp_size),
        # TP 1: the model runs in this process (UniProcExecutor), over the slot; TP > 1: "mp"
        # only to pass vLLM's checks, replaced by PooledRankExecutor (engine_config)
        "--distributed-executor-backend",
        "uni" if spec.tp_size == 1 else "mp",
        "--host",
        spec.host,
        "--disable-uvicorn-access-log",
    ]
    if spec.traces_endpoint:  # the agent's --otlp-traces-endpoint (never a tenant's arg)
        argv += ["--otlp-traces-endpoint", traces_url(spec.traces_endpoint)]
    return argv


def engine_config(spec: EngineSpec, key: str, device: Any) -> tuple[Any, Any, int]:
    """(parsed args, vLLM config, KV bytes) for ``spec``; no engine is built."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    kv_bytes = kv_bytes_of(spec)
    # The KV budget is the slot's pages; vLLM's CPU platform would let this env var override
    # --kv-cache-memory-bytes.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.traces_endpoint:
        os.environ.update(vllm_tracing_env(spec.trace_sample_ratio))
    argv = serve_argv(spec, key, kv_bytes)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )
    if device.type == "cuda":  # the worker's GPU (the slot's VMM mappings)
        config.device_config.device = device
    if spec.tp_size > 1:
        from warmserve_agent.engines.vllm.tp_executor import executor_class

        if len(spec.tp_peers) != spec.tp_size - 1 or not spec.tp_init or not spec.tp_authkey:
            raise EngineError("a tensor-parallel spec needs its ranks' rendezvous (tp_peers)")
        config.parallel_config.distributed_executor_backend = executor_class()
    return args, config, kv_bytes


def runs_forward_while_building(config: Any) -> str:
    """Why building this engine would run the model ("" if it would not).  A prepared engine
    is built before its KV pages (and maybe some weights) are mapped, so it may not touch
    them: vLLM's CPU warm-up (compiled mode) and every GPU build (profile run, CUDA graphs)
    run forward passes."""
    from vllm.config import CompilationMode

    if config.device_config.device.type != "cpu":
        return (
            "vLLM's build on a GPU runs a profile pass and captures CUDA graphs over the KV "
            "cache, whose pages are mapped only at activation (not prepared on GPUs yet)"
        )
    if config.compilation_config.mode != CompilationMode.NONE:
        return (
            "vLLM's CPU warm-up runs the compiled model over every weight; prepare with "
            "--enforce-eager (the engine is built at activation otherwise)"
        )
    return ""


async def build(
    spec: EngineSpec,
    key: str,
    args: Any,
    config: Any,
    kv_bytes: int,
    window: TtftWindow,
    on_first_token: Callable[[], None],
) -> Built:
    """Build vLLM's engine and app for ``spec`` (see module docstring); ``key`` names the
    :class:`~warmserve_agent.engines.vllm.loader.ActiveSlot` the loader builds over; vLLM's
    first-token latencies go to ``window`` and each one calls ``on_first_token``."""
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from warmserve_agent.engines.vllm.inproc import inproc_engine_core
    from warmserve_agent.engines.vllm.loader import active_slot, slot_kv_cache

    llm = None
    try:
        with inproc_engine_core() as made, slot_kv_cache(active_slot(key)):
            llm = AsyncLLM.from_vllm_config(
                config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=[ttft_logger_factory(window, on_first_token)],
                enable_log_requests=False,
                disable_log_stats=False,
            )
        client = made[0]
        supported = await llm.get_supported_tasks()
        app = build_app(args, supported, config.model_config)
        await init_app_state(llm, app.state, args, supported)
        server_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        server_config.load()
    except BaseException:
        if llm is not None:
            llm.shutdown()
        raise
    return Built(llm, client, args, app, kv_bytes, server_config)


async def open_endpoint(spec: EngineSpec, config: Any) -> tuple[Any, asyncio.Task[Any], str]:
    """Serve the app of uvicorn's ``config`` on ``spec.host``:``spec.port`` (0: any); (server,
    its task, the endpoint URL) once it accepts connections."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in spec.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((spec.host, spec.port))
    sock.listen(128)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise EngineError("the HTTP server stopped while starting")
        await asyncio.sleep(0.002)
    return server, task, spec.url(sock.getsockname()[1])
