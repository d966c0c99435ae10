"""The simulated engine through the engine boundary: queue bound, abandoned requests, engine
args, TTFT stats (243 abandoned requests stayed queued and counted as load)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from warmserve_agent.node import NodeCore

from tests.engines.helpers import post_json


def _slow_core(make_core: Callable[..., NodeCore], model_root: Path) -> NodeCore:
    """One instance of a model whose batch is 1 and whose decode is slow (1 s per token)."""
    cfg = model_root / "gamma" / "config.json"
    data = json.loads(cfg.read_text())
    data["warmserve"].update(max_batch=1, decode_tok_s=1.0)
    cfg.write_text(json.dumps(data))
    return make_core(gpus=1)


async def _flood(endpoint: str, n: int, timeout: float) -> list[BaseException | int]:
    import aiohttp

    async def one(s: aiohttp.ClientSession) -> int:
        async with s.post(f"{endpoint}/v1/completions", json={"prompt": "x", "max_tokens": 8}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        return await asyncio.gather(*(one(s) for _ in range(n)), return_exceptions=True)


def test_queue_is_bounded_and_abandoned_requests_are_dropped(
    make_core: Callable[..., NodeCore], model_root: Path
) -> None:
    core = _slow_core(make_core, model_root)
    inst, _ = core.activate("gamma", [0])
    eng = inst.engine
    limit = 4 * 1  # 4 x max_batch
    # 12 clients that give up after 3 s (the first request needs 8 s): one runs, `limit`
    # wait, the rest are refused (429) at once; 3 s leaves a loaded CI machine (load 4.5 failed
    # with 1.5 s against a 4 s request) time to connect and be refused
    results = asyncio.run(_flood(inst.endpoint, 12, timeout=3.0))
    refused = [r for r in results if r == 429]
    assert len(refused) == 12 - 1 - limit, results
    # every client went away: nothing may stay queued or running and count as load
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        st = eng.stats()
        if st.waiting == 0 and st.running == 0:
            break
        time.sleep(0.05)
    st = eng.stats()
    assert (st.running, st.waiting, st.kv_used_bytes, st.kv_reserved_bytes) == (0, 0, 0, 0)
    assert st.dropped == 12, "refused + abandoned requests are counted"
    # the engine still serves afterwards
    status, body = post_json(f"{inst.endpoint}/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    assert eng.stats().ttft_samples >= 1


def test_engine_args_are_honoured(make_core: Callable[..., NodeCore]) -> None:
    core = make_core(gpus=1)
    inst, _ = core.activate(
        "gamma", [0], engine="simulated", engine_args=["--max-model-len", "8", "--enforce-eager"]
    )
    url = f"{inst.endpoint}/v1/completions"
    status, body = post_json(url, {"prompt": "a b c", "max_tokens": 6})
    assert status == 400 and "maximum context length is 8" in body["error"]["message"]
    status, _ = post_json(url, {"prompt": "a b c", "max_tokens": 5})
    assert status == 200


def test_unknown_engine_and_bad_args_refused_before_any_change(
    make_core: Callable[..., NodeCore],
) -> None:
    from warmserve_agent.node_records import Refusal

    core = make_core(gpus=1)
    before = core.generation
    with pytest.raises(Refusal) as e:
        core.activate("gamma", [0], engine_args=["--max-num-seqs", "many"])
    assert e.value.code == "INVALID_ARGUMENT" and "--max-num-seqs" in e.value.message
    with pytest.raises(Refusal) as e:
        core.activate("gamma", [0], engine="vllm")  # not enabled on this node
    assert e.value.code == "FAILED_PRECONDITION" and "--engines" in e.value.message
    with pytest.raises(Refusal) as e:
        core.activate("gamma", [0], engine="tgi")
    assert e.value.code == "INVALID_ARGUMENT"
    assert core.generation == before and not core.instances and not core.slots


@pytest.mark.parametrize(
    ("flags", "msg"),
    [
        (["--engines", "simulated,tgi"], "--engines 'simulated,tgi': choose from simulated, vllm"),
        (["--engines", "simulated", "--engine", "vllm"], "--engine 'vllm' must be one of"),
    ],
)
def test_agent_cli_refuses_unknown_engines(
    flags: list[str], msg: str, model_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from warmserve.cli import main

    argv = ["agent", "--simulate-gpus", "1x4MiB", "--model-dir", str(model_root), *flags]
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_a_stopped_engine_refuses_loop_calls_at_once_and_leaks_no_coroutine() -> None:
    """A prewarm streamer's layers_ready racing stop(): before, the coroutine was handed to a
    stopped loop (the caller waited out the 10 s timeout, Python warned 'never awaited')."""
    import gc
    import threading
    import warnings

    from warmserve_agent.engines.simulated import SimulatedEngine

    class _Runner:
        cleaned = 0

        async def cleanup(self) -> None:
            _Runner.cleaned += 1

    eng = SimulatedEngine()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    eng._loop, eng._runner, eng._thread = loop, _Runner(), thread

    async def condition() -> asyncio.Condition:
        return asyncio.Condition()

    eng._st.cond = asyncio.run_coroutine_threadsafe(condition(), loop).result(5)
    assert eng.set_kv_capacity(1 << 20) == 1 << 20  # served while running
    eng.stop()
    eng.stop()  # idempotent: no second cleanup on a stopped loop
    assert _Runner.cleaned == 1 and not thread.is_alive()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped"):
            eng.set_kv_capacity(1 << 21)
        assert time.monotonic() - t0 < 1.0
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    loop.close()


def test_stop_aborts_the_requests_in_flight_at_once_as_vllm_does(
    make_core: Callable[..., NodeCore], model_root: Path
) -> None:
    """Ending an instance with a request decoding (streamed) and one queued behind it: the
    engine aborts both, each answered at once as vLLM answers an aborted request (the tokens so
    far, ``finish_reason`` ``abort``), instead of waiting for them (before, stop waited for the
    handlers: aiohttp's shutdown timeout, cut off after 10 s with the engine left running)."""
    import threading
    import urllib.request

    core = _slow_core(make_core, model_root)  # batch 1, 1 s per token
    inst, _ = core.activate("gamma", [0])
    url = f"{inst.endpoint}/v1/completions"
    streamed: list[bytes] = []
    queued: list[tuple[int, dict]] = []

    def stream() -> None:
        body = json.dumps({"prompt": "x", "max_tokens": 60, "stream": True}).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            streamed.append(r.read())

    threads = [
        threading.Thread(target=stream, daemon=True),
        threading.Thread(
            target=lambda: queued.append(post_json(url, {"prompt": "y", "max_tokens": 60}, 60)),
            daemon=True,
        ),
    ]
    threads[0].start()
    deadline = time.monotonic() + 15
    while inst.engine.stats().running < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    threads[1].start()
    while inst.engine.stats().waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    st = inst.engine.stats()
    assert (st.running, st.waiting) == (1, 1), st
    time.sleep(1.2)  # the streamed request has sent a token or two
    core.begin_grace(inst.instance_id)
    t0 = time.monotonic()
    core.end_instance(inst.instance_id)
    took = time.monotonic() - t0
    for t in threads:
        t.join(10)
    assert took < 3.0, f"EndInstance waited {took:.1f} s for the requests in flight"
    # queued: nothing generated (vLLM answers 200, empty text, finish_reason abort)
    assert queued and queued[0][0] == 200, queued
    (choice,) = queued[0][1]["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("", "abort")
    assert queued[0][1]["usage"]["completion_tokens"] == 0
    # streamed: its tokens, then a last chunk that says abort, then the end
    assert streamed, "the streamed request got no answer"
    events = [json.loads(e[6:]) for e in streamed[0].decode().split("\n\n")[:-2]]
    assert streamed[0].decode().endswith("data: [DONE]\n\n")
    assert [e["choices"][0]["finish_reason"] for e in events][-2:] == [None, "abort"], events
