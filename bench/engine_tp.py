"""Tensor-parallel rows of ``bench/engine_bench.py``: a TP=2 prewarm hit on real vLLM (CPU).

The tiny Llama (its heads and KV heads divide by 2; SmolLM2's 9/3 do not) on an agent with two
simulated GPUs whose memory their pooled workers own.  Each round, interleaved:

* **TP=1 hit**: the same model prewarmed on GPU 0 with its engine prepared, Activate + 1 token;
  what the TP=2 hits are compared with.
* **TP=2 hit, group pre-formed**: prewarmed on GPUs 0-1 with the activation's arguments, so rank
  0's worker prepares the engine and the ranks' process group forms at prewarm time.
* **TP=2 hit, group formed at activation**: prewarmed on GPUs 0-1 with other arguments (its
  prepared engine does not fit the activation and is dropped), so the engine is built and the
  group formed inside Activate; the weights are resident either way.
* **fresh TP=2 process**: ``LLM(model, tensor_parallel_size=2)`` in a new process (vLLM's own
  multiprocessing executor spawns its ranks), as the fresh row of the bench.

Goal: a TP=2 hit's time to first token at most 1.5x the TP=1 hit's.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fresh_vllm

GOAL_TP2_OVER_TP1 = 1.5
KINDS = ("tp1", "tp2_preformed", "tp2_at_activation")
LABELS = {
    "tp1": "TP=1 hit",
    "tp2_preformed": "TP=2 hit, group formed at prewarm",
    "tp2_at_activation": "TP=2 hit, group formed at Activate",
}
OTHER_ARGS = ["--max-num-seqs", "17"]  # a prepared engine the activation cannot use



def _wait(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def _first_token(endpoint: str, model: str) -> None:
    body = {"model": model, "prompt": [1, 5, 7, 9], "max_tokens": 1}
    req = urllib.request.Request(
        f"{endpoint}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        json.loads(r.read())


def tp_round(client: Any, model: str, kind: str, args: list[str]) -> dict:
    """Prewarm (engine prepared, READY), then Activate + a 1-token request, then end it."""
    from warmserve.api.agent.v1 import agent_pb2 as pb

    gpus = [0] if kind == "tp1" else [0, 1]
    prep_args = args + OTHER_ARGS if kind == "tp2_at_activation" else args
    t0 = time.perf_counter()
    client.prewarm_wait(model, gpus, 0, engine="vllm", engine_args=prep_args)
    prewarm_s = time.perf_counter() - t0

    def ready() -> Any:
        (s,) = client.describe().slots
        st = s.prepared_engine.state
        if st == pb.PREPARED_ENGINE_STATE_FAILED:
            raise RuntimeError(f"engine not prepared: {s.prepared_engine.message}")
        return s if st == pb.PREPARED_ENGINE_STATE_READY else None

    slot = _wait(ready, 600, "the prepared engine")
    t0 = time.perf_counter()
    res = client.activate(model, gpus, slot_id=slot.slot_id, engine="vllm", engine_args=args)
    t_act = time.perf_counter()
    _first_token(res.instance.endpoint, model)
    t_tok = time.perf_counter()
    client.begin_grace(res.instance.instance_id)
    client.end_instance(res.instance.instance_id, evict_weights=True)
    time.sleep(0.3)  # the workers tear the engine and ranks down after answering
    return {
        "kind": kind,
        "tp": len(gpus),
        "prewarm_s": prewarm_s,
        "prepared_build_s": slot.prepared_engine.build_seconds,
        "activate_s": t_act - t0,
        "ttft_s": t_tok - t0,
        "prewarm_hit": res.prewarm_hit,
        "engine_prepared": res.instance.stages.engine_prepared,
    }


def fresh_tp_run(model_dir: Path, kv_bytes: int, max_len: int) -> dict:
    """A fresh vLLM TP=2 process (vLLM's own multiprocessing executor spawns rank 1)."""
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "dtype": "auto",
        "enforce_eager": True,
        "max_model_len": max_len,
        "kv_cache_memory_bytes": kv_bytes,
    }
    env = dict(
        os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    )
    return fresh_vllm.fresh_run(model_dir, kwargs, env)


def bench_tp(
    name: str,
    model_dir: Path,
    root: Path,
    tmp: Path,
    gpu_bytes: int,
    a: Any,
    args: list[str],
    warm_up: Callable[[Any], None],
    loadavg: Callable[[], float],
) -> dict:
    """The rows above for ``name`` (module docstring); ``warm_up(client)``: the bench's
    unmeasured start that lets the agent time the model's forward first."""
    from warmserve_agent.config import AgentConfig
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient

    cfg = AgentConfig(
        model_dir=root,
        simulate_gpus=[gpu_bytes, gpu_bytes],
        listen="127.0.0.1:0",
        page_bytes=2 * 1024**2,
        memory_dir=tmp / f"mem-{name}-tp",
        spare_workers=0,
        memory_in_workers=True,
        engines=("vllm",),
    )
    kinds = ("tp1", "tp2_preformed") if a.smoke else KINDS
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    fresh: list[dict] = []
    load = [loadavg()]
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    kv_bytes = gpu_bytes - -(-weights // 2 // 2**21) * 2**21  # what a rank's GPU has left
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
        del agent
        # the agent times the forward in the first instance; a probe cut short by an instance
        # ended after one token moves to the next (the smoke too)
        warm_up(client)
        if not a.smoke:
            tp_round(client, name, "tp2_preformed", args)  # unmeasured: first TP=2 build
        for r in range(a.rounds):
            for kind in kinds:
                row = tp_round(client, name, kind, args)
                rows[kind].append(row)
                load.append(loadavg())
                print(
                    f"{name} round {r + 1}/{a.rounds} {kind}: ttft {row['ttft_s'] * 1000:.0f} ms "
                    f"prepared={row['engine_prepared']}",
                    file=sys.stderr,
                )
            if not a.smoke and r < a.fresh_rounds:
                fresh.append(fresh_tp_run(model_dir, kv_bytes, a.max_model_len))
                load.append(loadavg())
                print(f"{name} fresh TP=2 {fresh[-1]['ttft_s']:.1f}s", file=sys.stderr)
    return {"model": name, "rows": rows, "fresh": fresh, "loadavg_1m": [min(load), max(load)]}


def summarize_tp(m: dict) -> dict:
    def p50(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    out: dict = {
        k: {
            "ttft_p50_s": p50([r["ttft_s"] for r in rows]),
            "activate_p50_s": p50([r["activate_s"] for r in rows]),
            "prepared_build_p50_s": p50([r["prepared_build_s"] for r in rows]),
            "all_prepared": all(r["engine_prepared"] for r in rows),
            "rounds": len(rows),
        }
        for k, rows in m["rows"].items()
    }
    if m["fresh"]:
        out["fresh_tp2"] = {
            "ttft_p50_s": p50([r["ttft_s"] for r in m["fresh"]]),
            "import_p50_s": p50([r["import_s"] for r in m["fresh"]]),
            "engine_p50_s": p50([r["engine_s"] for r in m["fresh"]]),
            "rounds": len(m["fresh"]),
        }
    ratio = out["tp2_preformed"]["ttft_p50_s"] / out["tp1"]["ttft_p50_s"]
    out["tp2_over_tp1"] = ratio
    out["goal_tp2_le_1.5x_tp1"] = ratio <= GOAL_TP2_OVER_TP1
    return out


def print_tp(m: dict, s: dict) -> None:
    print(f"\ntensor parallel, {m['model']} (p50, client)       TTFT  Activate  prepared")
    for k in m["rows"]:
        print(
            f"  {LABELS[k]:40} {s[k]['ttft_p50_s'] * 1000:6.0f} ms "
            f"{s[k]['activate_p50_s'] * 1000:6.0f} ms  {s[k]['all_prepared']!s:>8}"
        )
    if "fresh_tp2" in s:
        f = s["fresh_tp2"]
        print(
            f"  {'fresh vLLM TP=2 process':40} {f['ttft_p50_s']:7.1f} s   (import "
            f"{f['import_p50_s']:.1f} s + engine {f['engine_p50_s']:.1f} s)"
        )
    print(
        f"  goal: TP=2 hit / TP=1 hit {s['tp2_over_tp1']:.2f}x <= {GOAL_TP2_OVER_TP1}x: "
        f"{s['goal_tp2_le_1.5x_tp1']} (load {m['loadavg_1m'][0]:.1f}-{m['loadavg_1m'][1]:.1f})"
    )
