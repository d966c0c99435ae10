"""Run one node agent with simulated GPUs as a separate process (a stand-in for a GPU node),
with the e2e tests' fault hooks.

``python tests/e2e/agent_proc.py --models DIR --gpus 4x256MiB --node node-a --address-file F``
is ``python -m warmserve_agent.testing`` (the agent on a free loopback port, ``host:port`` in
``F`` once it serves, until SIGTERM/SIGINT; engines inside the agent process) plus the hooks
below, which only tests install.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from warmserve_agent.testing import agent_parser, serve_simulated


async def main() -> None:
    ap = agent_parser()
    # A deliberately slow agent (tests/e2e/test_leader_fencing_e2e.py): while this file exists,
    # every Describe waits the seconds it holds before answering.
    ap.add_argument("--slow-describe-file", type=Path, default=None)
    # A call in flight (tests/e2e/test_leader_fencing_e2e.py): a unary mutating call that arrives
    # while ``--hold-calls-file`` exists waits, before the servicer sees it, until
    # ``--release-calls-file`` exists: what a network partition or a paused sender does to a
    # call already on its way.
    ap.add_argument("--hold-calls-file", type=Path, default=None)
    ap.add_argument("--release-calls-file", type=Path, default=None)
    args = ap.parse_args()
    if args.slow_describe_file is not None:
        _slow_describe(args.slow_describe_file)
    if args.hold_calls_file is not None and args.release_calls_file is not None:
        _hold_calls(args.hold_calls_file, args.release_calls_file)
    await serve_simulated(args)


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
