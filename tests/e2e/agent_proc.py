"""Run one node agent with simulated GPUs as a separate process (a stand-in for a GPU node).

``python tests/e2e/agent_proc.py --models DIR --gpus 4x256MiB --node node-a --address-file F``
starts the agent on a free loopback port, writes ``host:port`` to ``F`` once it serves, and runs
until SIGTERM/SIGINT.  Engines run inside the agent process (no per-GPU worker processes) to keep
the e2e test light on a small CI machine; the worker-process path is covered by the agent's own
tests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from warmserve_agent.config import AgentConfig, parse_simulated_gpus
from warmserve_agent.server import AgentServer


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, type=Path)
    ap.add_argument("--gpus", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--address-file", required=True, type=Path)
    ap.add_argument("--memory-dir", required=True, type=Path)
    ap.add_argument(
        "--sim-copy-gbps", type=float, default=0.0, help="host-to-GPU GB/s (0: memcpy speed)"
    )
    # Model sources (tests/e2e/test_model_sources_e2e.py) and metrics (the dashboard test).
    ap.add_argument("--hf-endpoint", default="")
    ap.add_argument("--store-budget", type=int, default=0)
    ap.add_argument("--fetch-attempts", type=int, default=3)
    ap.add_argument("--metrics-port", type=int, default=None)
    # A deliberately slow agent (tests/e2e/test_leader_fencing_e2e.py): while this file exists,
    # every Describe waits the seconds it holds before answering.
    ap.add_argument("--slow-describe-file", type=Path, default=None)
    # A call in flight (tests/e2e/test_leader_fencing_e2e.py): a unary mutating call that arrives
    # while ``--hold-calls-file`` exists waits, before the servicer sees it, until
    # ``--release-calls-file`` exists: what a network partition or a paused sender does to a
    # call already on its way.
    ap.add_argument("--hold-calls-file", type=Path, default=None)
    ap.add_argument("--release-calls-file", type=Path, default=None)
    # The admin's engine-argument widening, as the chart passes it (test_engine_args_e2e.py).
    ap.add_argument("--allow-engine-arg", action="append", default=[])
    # The engines the node hosts, as the chart's agent.engines (test_real_engine_e2e.py: vllm,
    # in the venv of hack/vllm/setup.sh); the GPUs' page size (--page-size).
    ap.add_argument("--engines", default="simulated")
    ap.add_argument("--page-bytes", type=int, default=2 * 1024**2)
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s agent=" + args.node + " %(message)s"
    )
    cfg = AgentConfig(
        model_dir=args.models,
        simulate_gpus=parse_simulated_gpus(args.gpus),
        listen="127.0.0.1:0",
        node_name=args.node,
        memory_dir=args.memory_dir,
        use_workers=False,
        spare_workers=0,
        host_cache_bytes=64 * 1024**2,
        sim_copy_bytes_per_s=args.sim_copy_gbps * 1e9,
        hf_endpoint=args.hf_endpoint,
        store_budget_bytes=args.store_budget,
        fetch_attempts=args.fetch_attempts,
        fetch_backoff_s=0.2,
        metrics_port=args.metrics_port,
        engines=tuple(args.engines.split(",")),
        page_bytes=args.page_bytes,
        **_engine_policy(args.allow_engine_arg),
    )
    if args.slow_describe_file is not None:
        _slow_describe(args.slow_describe_file)
    if args.hold_calls_file is not None and args.release_calls_file is not None:
        _hold_calls(args.hold_calls_file, args.release_calls_file)
    server = await AgentServer(cfg).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.metrics_port is not None:  # the port the kernel picked, for the test's scrape config
        args.address_file.with_suffix(".metrics").write_text(str(server.metrics_port))
    tmp = args.address_file.with_suffix(".tmp")
    tmp.write_text(server.address)
    tmp.rename(args.address_file)
    await stop.wait()
    await server.stop(0.2)


def _engine_policy(allowed: list[str]) -> dict[str, object]:
    if not allowed:
        return {}
    from warmserve.engine_args import EngineArgPolicy

    return {"engine_policy": EngineArgPolicy.from_admin(allowed)}


def _slow_describe(path: Path) -> None:
    from warmserve_agent.service import AgentService

    describe = AgentService.Describe

    async def slow(self: AgentService, request: object, context: object) -> object:
        try:
            delay = float(path.read_text() or 0)
        except (OSError, ValueError):
            delay = 0.0
        if delay > 0:
            logging.info("event=slow_describe seconds=%s", delay)
            await asyncio.sleep(delay)
        return await describe(self, request, context)

    AgentService.Describe = slow  # type: ignore[method-assign]


def _hold_calls(hold: Path, release: Path) -> None:
    from warmserve_agent.service import AgentService

    def held(name: str) -> None:
        rpc = getattr(AgentService, name)

        async def late(self: AgentService, request: object, context: object) -> object:
            logging.info("event=call_held method=%s", name)
            for _ in range(1200):  # at most 2 minutes
                if release.exists():
                    break
                await asyncio.sleep(0.1)
            logging.info("event=call_released method=%s", name)
            return await rpc(self, request, context)

        async def wrapper(self: AgentService, request: object, context: object) -> object:
            if not hold.exists():
                return await rpc(self, request, context)
            # Shielded from the caller's deadline: a call delayed in the network gets its
            # deadline from when it arrives, so the agent still acts on it then.
            task = asyncio.ensure_future(late(self, request, context))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return await asyncio.shield(task)

        setattr(AgentService, name, wrapper)

    for name in ("Activate", "BeginGrace", "EndInstance", "Evict"):
        held(name)


if __name__ == "__main__":
    asyncio.run(main())
