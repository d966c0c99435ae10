#!/usr/bin/env python
"""vLLM engine benchmark: time to first token of a prewarmed model activated in a pooled vLLM
worker vs a fresh process that imports vLLM and loads the model from files.

* **pooled (warmserve)**: a running agent (gRPC, simulated GPU) whose worker process imported
  vLLM at start; the model is prewarmed in a slot.  Measured: ``Activate`` (vLLM builds its
  engine over the slot: no import, no weight read) + the first token of a 1-token request on the
  returned endpoint.  Between rounds the instance ends (grace, end) and the slot stays resident.
* **fresh (without warmserve)**: ``python -c 'from vllm import LLM; LLM(model=DIR).generate(...)'``
  in a new process — the cold path a user gets: interpreter start, ``import vllm``, engine build,
  weights read from the files, first token.  (Conservative: a real ``vllm serve`` also spawns its
  engine-core process and starts an API server.)

Both run in the same invocation, interleaved round by round, on the same random-weight Llama made
offline (``--layers/--hidden``), with the same engine arguments.  Printed as a table with medians
and the ratio; saved to ``bench/results/engine_bench.json``.  Absolute times are this machine's
(on CPU); compare the ratio.  Run it with the vLLM venv's python and this checkout on its path
(``hack/vllm/python``; the vllm test group runs its ``--smoke``):

    hack/vllm/python bench/engine_bench.py [--rounds 3] [--layers 4 --hidden 256]
    hack/vllm/python bench/engine_bench.py --smoke     # one round of a tiny model, temp JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from warmserve.testing.smoke import add_smoke_flag, apply_smoke

REPO = Path(__file__).resolve().parents[1]
SMOKE = {"rounds": 1, "layers": 2, "hidden": 128, "max_model_len": 64}

FRESH = r"""
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
                             "first_token_s": t_tok - t_engine, "ttft_s": t_tok - t0}))
"""


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def fresh_run(model_dir: Path, kv_bytes: int, max_len: int, gpu: bool = False) -> dict:
    kwargs = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": max_len,
        "kv_cache_memory_bytes": kv_bytes,
    }
    if gpu:
        kwargs["gpu_memory_utilization"] = 0.9
    env = dict(os.environ)  # vLLM is in this interpreter's venv; warmserve is not needed
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-c", FRESH, str(model_dir), json.dumps(kwargs), repr(t0)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("FRESH ")), None)
    if line is None:
        raise RuntimeError(f"fresh vLLM process failed:\n{out.stderr[-3000:]}")
    return json.loads(line[6:])


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="real GPU 0 through the cuda backend (memory in the worker); the fresh runs then "
        "follow the pooled ones (the agent holds the GPU's memory while it runs). Not yet run "
        "on a GPU.",
    )
    ap.add_argument("--out", help="result file (default: bench/results/engine_bench.json)")
    add_smoke_flag(ap, SMOKE)
    a = ap.parse_args()
    apply_smoke(a, SMOKE, {"out": str(REPO / "bench/results/engine_bench.json")})

    from warmserve_agent.config import AgentConfig
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient

    page = 2 * 1024**2
    gpu = 256 * 1024**2
    args = ["--enforce-eager", "--max-model-len", str(a.max_model_len)]
    load = [loadavg()]
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        root = Path(tmp) / "models"
        model_dir = make_tiny_llama(
            root / "bench-llama",
            layers=a.layers,
            hidden=a.hidden,
            intermediate=2 * a.hidden,
            heads=max(4, a.hidden // 64),
            kv_heads=max(2, a.hidden // 128),
            seed=0,
            max_positions=max(512, a.max_model_len),
        )
        weight_mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
        cfg = AgentConfig(
            model_dir=root,
            simulate_gpus=None if a.gpu else [gpu],
            listen="127.0.0.1:0",
            page_bytes=page,
            memory_dir=Path(tmp) / "mem",
            spare_workers=0,
            memory_in_workers=True,
            engines=("vllm",),
        )
        pooled: list[dict] = []
        fresh: list[dict] = []
        t_start = time.perf_counter()
        with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
            worker_ready_s = time.perf_counter() - t_start  # the pool preloads vLLM once
            client.prewarm_wait("bench-llama", [0])
            for r in range(a.rounds):
                t0 = time.perf_counter()
                res = client.activate("bench-llama", [0], engine="vllm", engine_args=args)
                t_act = time.perf_counter()
                _post(
                    f"{res.instance.endpoint}/v1/completions",
                    {"model": "bench-llama", "prompt": [0, 5, 7], "max_tokens": 1},
                )
                t_tok = time.perf_counter()
                assert res.prewarm_hit
                pooled.append(
                    {
                        "activate_s": t_act - t0,
                        "first_token_s": t_tok - t_act,
                        "ttft_s": t_tok - t0,
                    }
                )
                kv_bytes = int(res.instance.kv_capacity_bytes)
                client.begin_grace(res.instance.instance_id)
                client.end_instance(res.instance.instance_id)
                load.append(loadavg())
                if not a.gpu:  # interleaved on CPU; on a GPU after the agent released it
                    fresh.append(fresh_run(model_dir, kv_bytes, a.max_model_len))
                    load.append(loadavg())
                print(
                    f"round {r + 1}/{a.rounds}: pooled {pooled[-1]['ttft_s']:.2f}s", file=sys.stderr
                )
        for _ in range(a.rounds if a.gpu else 0):
            fresh.append(fresh_run(model_dir, kv_bytes, a.max_model_len, a.gpu))
            load.append(loadavg())
        for r, row in enumerate(fresh):
            print(f"round {r + 1}: fresh {row['ttft_s']:.2f}s", file=sys.stderr)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in rows)

    ratio = med(fresh, "ttft_s") / med(pooled, "ttft_s")
    result = {
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": {"min": min(load), "max": max(load)},
        "model": {"layers": a.layers, "hidden": a.hidden, "weight_mib": round(weight_mib, 2)},
        "engine_args": args,
        "rounds": a.rounds,
        "worker_pool_start_s": worker_ready_s,
        "pooled": pooled,
        "fresh": fresh,
        "median_ttft_s": {"pooled": med(pooled, "ttft_s"), "fresh": med(fresh, "ttft_s")},
        "ratio_fresh_over_pooled": ratio,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(
        f"model: random-weight Llama, {a.layers} layers, hidden {a.hidden}, "
        f"{weight_mib:.1f} MiB; vLLM {'GPU' if a.gpu else 'CPU'}; args {' '.join(args)}; "
        f"rounds={a.rounds}; "
        f"load avg {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'time to first token (median)':38} {'total':>8} {'parts':>34}")
    print(
        f"{'pooled vLLM worker, prewarmed slot':38} {med(pooled, 'ttft_s'):7.2f}s "
        f"   Activate {med(pooled, 'activate_s'):.2f}s "
        f"+ 1st token {med(pooled, 'first_token_s'):.2f}s"
    )
    print(
        f"{'fresh process, vLLM from files':38} {med(fresh, 'ttft_s'):7.2f}s "
        f"   import {med(fresh, 'import_s'):.1f}s + engine {med(fresh, 'engine_s'):.1f}s "
        f"+ 1st token {med(fresh, 'first_token_s'):.2f}s"
    )
    print(f"{'ratio fresh / pooled':38} {ratio:7.1f}x")
    print(f"(the pooled worker imported vLLM once at agent start: {worker_ready_s:.1f}s)")
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
