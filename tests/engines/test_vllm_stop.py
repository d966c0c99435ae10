"""Stopping the ``vllm`` engine never waits for a request (group ``vllm``): real vLLM (CPU) over
the tiny Llama, engine in this process.  A request starved of KV blocks (none mapped yet: the
pager is not running) stays queued in vLLM's scheduler; ending the instance aborts it in vLLM, so
the client gets its answer and the stop returns within seconds, not after uvicorn's wait for the
request (30 s, longer than the agent's worker call)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore

from tests.engines.helpers import post_json
from tests.engines.test_vllm_engine import (  # noqa: F401  (tiny_root: fixture)
    ARGS,
    GPU,
    PAGE,
    PROMPT,
    tiny_root,
)


def _stream(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_end_instance_aborts_a_request_starved_of_kv_blocks(
    tmp_path: Path, tiny_root: Path  # noqa: F811
) -> None:
    core = NodeCore(
        MemoryManager(SimulatedBackend(tmp_path / "gpus", page_bytes=PAGE)),
        WeightStore(tiny_root),
        {0: GPU},
        lambda g: InProcessEngine(g),
        engines=("vllm",),
        kv_pager_thread=False,  # no KV page is mapped: a request waits for blocks
    )
    try:
        inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        eng = inst.engine.engine  # type: ignore[attr-defined]
        url = f"{inst.endpoint}/v1/completions"
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        answer: list[tuple[int, dict]] = []
        streamed: list[bytes] = []
        clients = [
            threading.Thread(target=lambda: answer.append(post_json(url, body, 120)), daemon=True),
            threading.Thread(target=lambda: streamed.append(_stream(url, body)), daemon=True),
        ]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while eng.stats().waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.stats().waiting == 2 and not answer, "the requests wait for KV blocks"
        core.begin_grace(inst.instance_id)
        t0 = time.monotonic()
        core.end_instance(inst.instance_id, evict_weights=True)  # no engine prepared after
        took = time.monotonic() - t0
        for c in clients:
            c.join(30)
        # an idle instance's end takes 2.4 s at load 6.6 on 2 CPUs (vLLM's teardown); before,
        # this one took 32.6 s (uvicorn waited 30 s for the requests)
        assert took < 10.0, f"EndInstance waited {took:.1f} s for the starved requests"
        # vLLM's answers to an aborted request: what it has (nothing here), finish_reason abort
        assert answer and answer[0][0] == 200, answer
        (choice,) = answer[0][1]["choices"]
        assert (choice["text"], choice["finish_reason"]) == ("", "abort"), choice
        assert streamed == [b"data: [DONE]\n\n"], streamed
    finally:
        core.shutdown()
        core.mm.close()
