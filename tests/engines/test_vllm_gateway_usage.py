"""Token usage through the gateway with real vLLM (CPU; group ``vllm``, run by hack/test.sh in the
venv hack/vllm/setup.sh installs).

A tiny random-weight Llama (``make_tiny_llama``, with a chat template) served by warmserve's
``vllm`` engine, next to the simulated engine.  Checked:

* the simulated engine's ``stream_options`` behaviour has vLLM's shape: which chunks carry
  usage (none without ``include_usage``, a last chunk without choices with it, every chunk with
  ``continuous_usage_stats``), where ``system_fingerprint`` goes, the keys of the usage chunk,
  ``stream_options`` without ``stream`` refused;
* through the real gateway, vLLM's stream without ``include_usage`` reaches the client as vLLM
  sends it to a direct client (the usage chunk the gateway asked for taken out, the fingerprint
  back on the finish chunk), with ``include_usage`` unchanged, and the tokens vLLM reports are
  counted once per request in ``warmserve_gateway_tokens_total``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from warmserve_agent.node import NodeCore

from tests.engines.helpers import post_json

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "gateway") not in sys.path:  # the vllm group's PYTHONPATH has no gateway/
    sys.path.insert(0, str(REPO / "gateway"))

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = ["--enforce-eager", "--max-model-len", "256"]
CHAT = {"messages": [{"role": "user", "content": "what is a slot?"}], "max_tokens": 5}
COMPLETION = {"prompt": "hello world", "max_tokens": 4}
GREEDY = {"temperature": 0, "ignore_eos": True}  # exactly max_tokens, the same ones each time
OPTIONS: list[dict[str, Any] | None] = [
    None,
    {"include_usage": False},
    {"include_usage": True},
    {"include_usage": True, "continuous_usage_stats": True},
]


def _stream(url: str, body: dict[str, Any]) -> list[Any]:
    """The events of a streamed answer, parsed (``[DONE]`` as is), without id and created."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        raw = r.read()
    out: list[Any] = []
    for e in raw.split(b"\n\n"):
        data = e.strip().removeprefix(b"data: ")
        if not data:
            continue
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        doc = json.loads(data)
        doc.pop("id")
        doc.pop("created")
        out.append(doc)
    return out


def _shape(events: list[Any]) -> list[tuple[str, bool, bool]]:
    """(kind, has usage, has system_fingerprint) per event, runs of equal ones collapsed: the
    engines' texts and role chunks differ, their usage and fingerprint placement must not."""
    out: list[tuple[str, bool, bool]] = []
    for doc in events:
        if doc == "[DONE]":
            row = ("done", False, False)
        else:
            choices = doc["choices"]
            kind = "usage" if not choices else "finish" if choices[-1]["finish_reason"] else "text"
            row = (kind, "usage" in doc, "system_fingerprint" in doc)
        if not out or out[-1] != row:
            out.append(row)
    return out


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "tiny", layers=2, hidden=128, seed=11)  # head_dim 32 (CPU kernels)
    return root


def test_simulated_stream_options_have_vllms_shape_and_the_gateway_counts_vllm(
    make_core: Callable[..., NodeCore], tiny_root: Path
) -> None:
    vcore = make_core(gpus=1, gpu_bytes=48 * 1024**2, page=64 * 1024, root=tiny_root,
                      engines=("vllm",))  # fmt: skip
    vinst, _ = vcore.activate("tiny", [0], engine="vllm", engine_args=ARGS)
    sinst, _ = make_core(gpus=1).activate("gamma", [0])
    engines = {"vllm": (vinst.endpoint, "tiny"), "simulated": (sinst.endpoint, "gamma")}

    # --- the simulated engine's shape is vLLM's
    for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        for opts in OPTIONS:
            shapes, keys = {}, {}
            for name, (url, model) in engines.items():
                req = {"model": model, **body, **GREEDY, "stream": True}
                if opts is not None:
                    req["stream_options"] = opts
                events = _stream(url + route, req)
                shapes[name] = _shape(events)
                last = events[-2]  # before [DONE]
                keys[name] = (sorted(last), sorted(last.get("usage") or ()))
            assert shapes["simulated"] == shapes["vllm"], (route, opts, shapes)
            assert keys["simulated"] == keys["vllm"], (route, opts, keys)
        for name, (url, model) in engines.items():
            status, err = post_json(
                url + route, {"model": model, **body, "stream_options": {"include_usage": True}}
            )
            assert status == 400 and "stream" in json.dumps(err), (name, err)

    # --- the gateway in front of vLLM
    from warmserve_gateway.config import GatewayConfig
    from warmserve_gateway.server import Gateway

    from tests.gateway.gw_support import ListSource, md

    async def through_gateway() -> str:
        src = ListSource([md("tiny", "tiny", [(vinst.instance_id, vinst.endpoint)])])
        cfg = GatewayConfig(
            host="127.0.0.1", port=0, admin_host="127.0.0.1", admin_port=0, replica="vllm-usage"
        )
        gw = Gateway(cfg, src)
        await gw.start()
        try:
            api = gw.urls["api"]
            for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
                for opts in OPTIONS:
                    req = {"model": "tiny", **body, **GREEDY, "stream": True}
                    if opts is not None:
                        req["stream_options"] = opts
                    direct = await asyncio.to_thread(_stream, vinst.endpoint + route, req)
                    via = await asyncio.to_thread(_stream, api + route, req)
                    assert via == direct, (route, opts)
                    if not (opts and opts.get("include_usage")):
                        assert not [e for e in via if "usage" in e], (route, opts)
                        assert "system_fingerprint" in via[-2], "the finish chunk's, put back"
                req = {"model": "tiny", **body, **GREEDY}
                status, whole = await asyncio.to_thread(post_json, api + route, req)
                assert status == 200 and whole["usage"]["completion_tokens"] == body["max_tokens"]
            return await asyncio.to_thread(
                lambda: urllib.request.urlopen(gw.urls["admin"] + "/metrics").read().decode()
            )
        finally:
            await gw.stop()

    text = asyncio.run(through_gateway())
    # per route: 4 streams + 1 whole answer, each counted once with vLLM's own usage
    usage = {
        route: post_json(vinst.endpoint + route, {"model": "tiny", **body, **GREEDY})[1]["usage"]
        for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION))
    }
    want_in = 5 * sum(u["prompt_tokens"] for u in usage.values())
    want_out = 5 * sum(u["completion_tokens"] for u in usage.values())
    assert want_out == 5 * (5 + 4)
    series = (
        'warmserve_gateway_tokens_total{key="_anonymous",model="tiny",namespace="default",'
        'type="%s"}'
    )
    assert f"{series % 'input'} {float(want_in)}" in text, text
    assert f"{series % 'output'} {float(want_out)}" in text, text
    assert "warmserve_gateway_usage_errors_total{" not in text
