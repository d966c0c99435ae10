"""Fixtures for the gateway tests: a real node agent with simulated GPUs whose instances serve the
simulated engine's OpenAI API, and an in-process gateway fed ModelDeployment objects directly.

The deployment source here hands objects to the gateway through the same two callbacks the
Kubernetes watch uses (``on_list``, ``on_event``); the watch itself runs against the real API
server in ``tests/e2e/test_gateway_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from gw_support import Engines, ListSource
from warmserve_agent.config import AgentConfig, parse_simulated_gpus
from warmserve_agent.testing import AgentThread, write_model
from warmserve_gateway.config import GatewayConfig
from warmserve_gateway.server import Gateway

from warmserve.api.agent.client import SyncAgentClient


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    root = tmp_path_factory.mktemp("gw-agent")
    models = root / "models"
    # fast: 2000 tokens/s; slow: 20 tokens/s (a request of 40 tokens takes 2 s)
    write_model(models, "tiny", layers=2, hidden=32, seed=1, profile={"max_batch": 64})
    write_model(
        models,
        "slow",
        layers=2,
        hidden=32,
        seed=2,
        profile={"max_batch": 64, "decode_tok_s": 20.0},
    )
    cfg = AgentConfig(
        model_dir=models,
        simulate_gpus=parse_simulated_gpus("4x64MiB"),
        listen="127.0.0.1:0",
        node_name="gw-test",
        memory_dir=root / "mem",
        use_workers=False,
        spare_workers=0,
        host_cache_bytes=32 * 1024**2,
    )
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
        yield Engines(agent, client)


@pytest.fixture
async def make_gateway(tmp_path: Any) -> AsyncIterator[Callable[..., Any]]:
    """``await make_gateway(objects, mirrored=True, **config) -> (Gateway, ListSource)``;
    stopped afterwards.  /demand needs the token in ``gw.config.demand_token_file``
    (``gw_support.demand_headers``) unless the config says otherwise."""
    started: list[Gateway] = []
    token = tmp_path / "demand-token"
    token.write_text("demand-secret-for-tests\n")

    async def make(
        items: list[Mapping[str, Any]], mirrored: bool = True, **kw: Any
    ) -> tuple[Gateway, ListSource]:
        src = ListSource(list(items), mirrored=mirrored)
        base: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "admin_host": "127.0.0.1"}
        base["demand_token_file"] = token
        cfg = GatewayConfig(**{**base, "admin_port": 0, "replica": "test", **kw})
        gw = Gateway(cfg, src)
        await gw.start()
        started.append(gw)
        return gw, src

    yield make
    for gw in started:
        await gw.stop()
    await asyncio.sleep(0)


@dataclass
class Recorder:
    """A real HTTP engine stand-in that records what reaches it and answers a chat completion
    with hop-by-hop headers of its own (``Connection: keep-alive, X-Internal``)."""

    url: str = ""
    seen: list[tuple[str, str, list[tuple[str, str]]]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.seen]


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        rec.seen.append((request.method, request.raw_path, list(request.headers.items())))
        answer = {"object": "chat.completion", "model": "rec", "choices": []}
        return web.Response(
            body=json.dumps(answer).encode(),
            content_type="application/json",
            headers={
                "Connection": "keep-alive, X-Internal",
                "X-Internal": "engine-only",
                "Keep-Alive": "timeout=5",
                "Proxy-Authenticate": "Basic",
                "X-Engine": "visible",
            },
        )

    app = web.Application(client_max_size=8 * 1024**2)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    rec.url = f"http://127.0.0.1:{site.port}"
    yield rec
    await runner.cleanup()


@dataclass
class Hung:
    """A real socket server that accepts and reads but never answers (a hung engine)."""

    url: str = ""
    accepted: int = 0


@pytest.fixture
async def hung() -> AsyncIterator[Hung]:
    h = Hung()
    writers: list[asyncio.StreamWriter] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h.accepted += 1
        writers.append(writer)
        await reader.read()  # until the gateway gives up and closes

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    h.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield h
    server.close()
    for w in writers:
        w.close()
