"""A fresh vLLM process, timed: interpreter start and ``import vllm``, the engine's build with
stock vLLM's loader, one greedy token — Figure 8's "no prewarm" start, shared by the engine
bench's TP=1 and TP=2 rows (``bench/engine_bench.py``, ``bench/engine_tp.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = r"""
import json, os, sys, time
t0 = float(sys.argv[3])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
t_import = time.time()
llm = LLM(model=sys.argv[1], **json.loads(sys.argv[2]))
t_engine = time.time()
llm.generate([{"prompt_token_ids": [0, 5, 7]}], SamplingParams(max_tokens=1, temperature=0))
t_tok = time.time()
print("FRESH " + json.dumps({"import_s": t_import - t0, "engine_s": t_engine - t_import,
                             "first_token_s": t_tok - t_engine, "ttft_s": t_tok - t0}), flush=True)
os._exit(0)  # timed; a TP engine's worker processes need not be shut down politely
"""


def fresh_run(model_dir: Path, llm_kwargs: dict[str, Any], env: dict[str, str]) -> dict:
    """Run the model in a fresh process with ``LLM(**llm_kwargs)``; its stage times (s)."""
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), json.dumps(llm_kwargs), repr(t0)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("FRESH ")), None)
    if line is None:
        raise RuntimeError(f"fresh vLLM process ({llm_kwargs}) failed:\n{out.stderr[-3000:]}")
    return json.loads(line[6:])
