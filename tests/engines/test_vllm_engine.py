"""The ``vllm`` engine with real vLLM on CPU (group ``vllm``; hack/test.sh runs it in the venv
hack/vllm/setup.sh installs).

A tiny random-weight Llama and tokenizer are made offline at test time.  The reference is plain
``vllm.LLM(model=dir)`` loading the same files, in its own process.  Checked here:

* greedy tokens from a fully and from a partially prewarmed slot equal the reference;
* no re-read: after the prewarm the weight files' tensor bytes are overwritten with garbage
  (headers and mtimes kept), and the instance still produces the reference tokens;
* no copy: every vLLM parameter and KV cache tensor lies inside the slot's mapping;
* the OpenAI API (vLLM's own server) through a pooled worker, engine args passed through, a bad
  one refused before anything changes, stats from vLLM's scheduler, TTFT, grace lending.

KV mapped in the background, lending and growing back: ``test_vllm_kv.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from warmserve_agent.node import NodeCore

from tests.engines.helpers import post_json

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = 64 * 1024
GPU = 48 * 1024**2
PROMPT = [0, 5, 7, 9, 11, 13, 17]
ARGS = ["--enforce-eager", "--max-model-len", "256"]
REF_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          kv_cache_memory_bytes=32 * 1024**2)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                   SamplingParams(max_tokens=int(sys.argv[3]), temperature=0))
print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "tiny", layers=4, hidden=128, seed=7)
    return root


@pytest.fixture(scope="module")
def reference(tiny_root: Path) -> list[int]:
    """Greedy tokens of plain vLLM loading the model from its files (a separate process)."""
    out = subprocess.run(
        [sys.executable, "-c", REF_SCRIPT, str(tiny_root / "tiny"), json.dumps(PROMPT), "16"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("TOKENS ")), None)
    assert line, f"reference vLLM failed:\n{out.stderr[-3000:]}"
    return json.loads(line[7:])


def _tokens(endpoint: str, n: int = 16, model: str = "tiny") -> list[int]:
    status, body = post_json(
        f"{endpoint}/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": n,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def _garble_weight_files(model_dir: Path) -> int:
    """Overwrite every tensor byte of the safetensors files (header and mtime kept)."""
    from warmserve_agent.store import read_safetensors_header

    n = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        start, _ = read_safetensors_header(f)
        with open(f, "r+b") as fh:
            fh.seek(start)
            size = st.st_size - start
            fh.write(os.urandom(size))
            n += size
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    return n


def _check_inside_slot(engine: object) -> None:
    lay = engine.slot_layout()  # type: ignore[attr-defined]
    base, wbytes = lay["base"], lay["weight_bytes"]
    params = list(engine.model().named_parameters())  # type: ignore[attr-defined]
    assert params
    for name, p in params:
        ptr, n = p.data_ptr(), p.numel() * p.element_size()
        assert base <= ptr and ptr + n <= base + wbytes, f"{name} is not a view of the slot"
    kv_lo, kv_hi = lay["kv_range"]
    assert kv_lo >= wbytes and lay["kv"]
    for name, (ptr, n) in lay["kv"].items():
        assert base + kv_lo <= ptr and ptr + n <= base + kv_hi, f"KV {name} outside the slot"


def test_prewarmed_slot_equals_plain_vllm_without_rereading_or_copying(
    make_core: Callable[..., NodeCore], tiny_root: Path, reference: list[int], tmp_path: Path
) -> None:
    root = tmp_path / "own-models"  # this test garbles its weight files
    shutil.copytree(tiny_root, root)
    core = make_core(gpus=1, gpu_bytes=GPU, page=PAGE, root=root, engines=("vllm",))
    slot = core.prewarm("tiny", [0])
    slot.loader.join()
    assert slot.layers_resident == 4
    assert _garble_weight_files(root / "tiny") > 1_000_000
    inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
    assert inst.prewarm_hit
    assert _tokens(inst.endpoint) == reference
    eng = inst.engine.engine
    _check_inside_slot(eng)
    # a second instance in the same process (a pooled worker hosts many over its life)
    core.begin_grace(inst.instance_id)
    core.end_instance(inst.instance_id)
    inst2, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
    assert _tokens(inst2.endpoint) == reference


def test_partially_prewarmed_slot_equals_plain_vllm(
    tmp_path: Path, tiny_root: Path, reference: list[int]
) -> None:
    """Layers 3-4 load through the agent's streaming loader while vLLM builds; requests wait
    until every layer is resident."""
    from warmserve_agent.backends.simulated import SimulatedBackend
    from warmserve_agent.engine_host import InProcessEngine
    from warmserve_agent.memory import MemoryManager
    from warmserve_agent.store import WeightStore

    backend = SimulatedBackend(tmp_path / "gpus", page_bytes=PAGE, copy_bytes_per_s=1.5e6)
    core = NodeCore(
        MemoryManager(backend),
        WeightStore(tiny_root),
        {0: GPU},
        lambda g: InProcessEngine(g),
        engines=("vllm",),
    )
    try:
        slot = core.prewarm("tiny", [0], layers=2)
        slot.loader.join()
        assert slot.layers_resident == 2
        inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        started_with = slot.layers_resident
        assert _tokens(inst.endpoint) == reference
        assert inst.engine.stats().layers_resident == 4
        assert started_with < 4 or slot.load_seconds > 0
    finally:
        core.shutdown()
        core.mm.close()


def test_openai_api_through_a_pooled_worker(tmp_path: Path, tiny_root: Path) -> None:
    """The agent as deployed: gRPC, a pooled worker that preloaded vLLM, memory owned by the
    worker; vLLM's own OpenAI server answers on the endpoint Activate returns."""
    import grpc
    from warmserve_agent.config import AgentConfig
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import AgentError, SyncAgentClient

    cfg = AgentConfig(
        model_dir=tiny_root,
        simulate_gpus=[GPU],
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / "mem",
        spare_workers=0,
        memory_in_workers=True,
        engines=("vllm", "simulated"),
    )
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
        gen = client.describe().generation
        with pytest.raises(AgentError) as e:
            client.activate("tiny", [0], engine="vllm", engine_args=["--max-model-lenn", "64"])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-model-lenn" in e.value.message
        assert client.describe().generation == gen, "refused before anything changed"

        for _ in client.prewarm("tiny", [0]):
            pass
        res = client.activate(
            "tiny", [0], engine="vllm", engine_args=["--enforce-eager", "--max-model-len", "64"]
        )
        ep = res.instance.endpoint
        assert res.prewarm_hit and res.instance.engine == "vllm"
        # --max-model-len reached vLLM: a longer request is refused by vLLM itself
        status, body = post_json(
            f"{ep}/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 100}
        )
        assert status == 400 and "64" in json.dumps(body)
        status, body = post_json(
            f"{ep}/v1/completions",
            {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        status, body = post_json(
            f"{ep}/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "what is a slot?"}],
                "max_tokens": 5,
                "temperature": 0,
            },
        )
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        req = urllib.request.Request(
            f"{ep}/v1/chat/completions",
            data=json.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "stream": True,
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [ln for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
        with urllib.request.urlopen(f"{ep}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        for name in ("vllm:num_requests_running", "vllm:time_to_first_token_seconds_count"):
            assert name in metrics
        with urllib.request.urlopen(f"{ep}/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            (info,) = client.describe().instances
            if info.ttft_samples >= 3:
                break
            time.sleep(0.2)
        assert info.engine == "vllm" and info.ttft_samples >= 3 and info.ttft_p95_seconds > 0
        assert info.kv_capacity_bytes > 0 and info.max_batch > 0
        # grace: lending through the worker (memory owned by the worker: it can also regrow)
        client.begin_grace(res.instance.instance_id)
        (lend,) = client.lendable().instances
        assert lend.reservation_target_bytes <= lend.kv_capacity_bytes
        client.end_instance(res.instance.instance_id)
