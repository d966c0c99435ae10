"""Agents for tests and benchmarks, not used in production: :class:`AgentThread` runs one on
loopback in a background thread; ``python -m warmserve_agent.testing`` runs one with simulated
GPUs as a process of its own (a stand-in for a GPU node); :func:`write_model` writes a small
random model the agent loads (real safetensors files).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from warmserve_agent.config import AgentConfig, parse_simulated_gpus
from warmserve_agent.server import AgentServer
from warmserve_agent.sources.disk_reserve import parse_reserve


class AgentThread:
    """``with AgentThread(cfg) as a: SyncAgentClient(a.address)``; stops the agent on exit."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.server = AgentServer(cfg)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> AgentThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(120)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def address(self) -> str:
        return self.server.address

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(0.2), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def write_model(
    root: Path,
    name: str,
    *,
    layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    files: int = 2,
    profile: dict[str, Any] | None = None,
) -> Path:
    """Write a random model: embeddings, ``layers`` blocks, final norm, lm_head, over ``files``
    safetensors files with HF-style names; ``profile``: the simulated engine's ``warmserve``
    settings in its config.json (batch, token speeds, KV bytes per token)."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((256, hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal((hidden,), dtype=np.float32),
        "lm_head.weight": rng.standard_normal((256, hidden), dtype=np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.qkv_proj.weight"] = rng.standard_normal(
            (3 * hidden, hidden), dtype=np.float32
        )
        tensors[p + "mlp.down_proj.weight"] = rng.standard_normal(
            (hidden, 2 * hidden), dtype=np.float32
        )
        tensors[p + "input_layernorm.weight"] = rng.standard_normal((hidden,), dtype=np.float32)
    names = sorted(tensors)
    for k in range(files):
        part = {n: tensors[n] for n in names[k::files]}
        save_file(part, str(d / f"model-{k + 1:05d}-of-{files:05d}.safetensors"))
    cfg: dict[str, Any] = {"num_hidden_layers": layers, "hidden_size": hidden}
    cfg["warmserve"] = {
        "max_batch": 4,
        "prefill_tok_s": 1e6,
        "decode_tok_s": 2000.0,
        "kv_bytes_per_token": 1024,
        **(profile or {}),
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def agent_parser() -> argparse.ArgumentParser:
    """Flags of ``python -m warmserve_agent.testing``."""
    ap = argparse.ArgumentParser(
        prog="python -m warmserve_agent.testing",
        description="One node agent with simulated GPUs on a free loopback port; writes "
        "host:port to --address-file once it serves, runs until SIGTERM/SIGINT.  Engines run "
        "inside the agent process (no per-GPU worker processes, unless --workers), to keep a "
        "stack of several agents light on a small machine.",
    )
    ap.add_argument("--models", required=True, type=Path)
    ap.add_argument("--gpus", required=True, help="e.g. 4x256MiB")
    ap.add_argument("--node", required=True)
    ap.add_argument("--address-file", required=True, type=Path)
    ap.add_argument("--memory-dir", required=True, type=Path)
    ap.add_argument(
        "--sim-copy-gbps", type=float, default=0.0, help="host-to-GPU GB/s (0: memcpy speed)"
    )
    ap.add_argument("--hf-endpoint", default="")
    ap.add_argument("--store-budget", type=int, default=0)
    ap.add_argument(
        "--store-reserve",
        default="0",
        help="free disk a fetch never takes (the agent's flag); 0 here: a test stand-in's fetches "
        "are not about the machine's free disk",
    )
    ap.add_argument("--fetch-attempts", type=int, default=3)
    ap.add_argument("--metrics-port", type=int, default=None)
    ap.add_argument("--allow-engine-arg", action="append", default=[])
    # The engines the node hosts, as the chart's agent.engines (tests/e2e/
    # test_real_engine_e2e.py: simulated,vllm, in the venv of hack/vllm/setup.sh).
    ap.add_argument("--engines", default="simulated")
    ap.add_argument("--page-bytes", type=int, default=2 * 1024**2)
    # One pooled worker process per GPU, as in production, instead of engines in the agent
    # process: a tensor-parallel vllm engine needs a worker per rank (tests/e2e/
    # test_real_engine_tp_e2e.py).
    ap.add_argument("--workers", action="store_true")
    return ap


async def serve_simulated(args: argparse.Namespace) -> None:
    """Run the agent :func:`agent_parser`'s ``args`` describe until SIGTERM/SIGINT."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s agent=" + args.node + " %(message)s"
    )
    policy: dict[str, Any] = {}
    if args.allow_engine_arg:  # the admin's widening, as the chart passes it
        from warmserve.engine_args import EngineArgPolicy

        policy["engine_policy"] = EngineArgPolicy.from_admin(args.allow_engine_arg)
    cfg = AgentConfig(
        model_dir=args.models,
        simulate_gpus=parse_simulated_gpus(args.gpus),
        listen="127.0.0.1:0",
        node_name=args.node,
        memory_dir=args.memory_dir,
        use_workers=args.workers,
        spare_workers=0,
        host_cache_bytes=64 * 1024**2,
        sim_copy_bytes_per_s=args.sim_copy_gbps * 1e9,
        hf_endpoint=args.hf_endpoint,
        store_budget_bytes=args.store_budget,
        store_reserve=parse_reserve(args.store_reserve),
        fetch_attempts=args.fetch_attempts,
        fetch_backoff_s=0.2,
        metrics_port=args.metrics_port,
        engines=tuple(args.engines.split(",")),
        page_bytes=args.page_bytes,
        **policy,
    )
    server = await AgentServer(cfg).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.metrics_port is not None:  # the port the kernel picked, for a scrape config
        args.address_file.with_suffix(".metrics").write_text(str(server.metrics_port))
    tmp = args.address_file.with_suffix(".tmp")
    tmp.write_text(server.address)
    tmp.rename(args.address_file)
    await stop.wait()
    await server.stop(0.2)


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(serve_simulated(agent_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
