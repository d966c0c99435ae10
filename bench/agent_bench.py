#!/usr/bin/env python
"""Node agent benchmark: activation latency from a pooled worker vs a freshly started process,
and the gRPC round-trip time.

Activation = ``NodeCore.activate`` of a prewarmed model (a prewarm hit): map the KV cache, hand
the slot to the engine in a worker process, the engine verifies its weights and starts serving
HTTP.  "pooled" uses the GPU's long-lived worker (already started, libraries imported); "fresh"
starts a new worker process for the activation.  Both run in the same process, interleaved, on
the same simulated GPUs and model; the result is the ratio fresh/pooled of the medians.

RTT: ``Describe`` and the standard health ``Check`` over loopback gRPC to a running agent.

    python bench/agent_bench.py [--rounds 5] [--rtt-calls 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.client import SyncAgentClient
from warmserve_agent.engine_host import FreshWorkerEngine, WorkerEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.server import AgentConfig
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import AgentThread
from warmserve_agent.worker import WorkerPool

MiB = 1024**2


def write_model(root: Path, name: str, layers: int, hidden: int) -> None:
    rng = np.random.default_rng(0)
    d = root / name
    d.mkdir(parents=True)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((1024, hidden), dtype=np.float32),
        "lm_head.weight": rng.standard_normal((1024, hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal((hidden,), dtype=np.float32),
    }
    for i in range(layers):
        t[f"model.layers.{i}.mlp.weight"] = rng.standard_normal(
            (hidden, 4 * hidden), dtype=np.float32
        )
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))


def bench_activation(root: Path, tmp: Path, rounds: int) -> dict:
    pool = WorkerPool([0], spares=0)
    pool.start()
    mode = {"fresh": False}

    def factory(group):
        return FreshWorkerEngine(group) if mode["fresh"] else WorkerEngine(pool, group)

    core = NodeCore(
        MemoryManager(SimulatedBackend(tmp / "gpus", page_bytes=2 * MiB)),
        WeightStore(root),
        {0: 256 * MiB},
        factory,
        node_name="bench",
    )
    times: dict[str, list[float]] = {"pooled": [], "fresh": []}
    try:
        slot = core.prewarm("m", [0])
        slot.loader.join()
        for r in range(2 * rounds + 1):
            kind = "fresh" if r % 2 else "pooled"
            mode["fresh"] = kind == "fresh"
            inst, _ = core.activate("m", [0])
            assert inst.prewarm_hit
            if r > 0:  # the first activation warms caches (digests, host copies)
                times[kind].append(inst.activation_seconds)
            core.begin_grace(inst.instance_id)
            core.end_instance(inst.instance_id)
    finally:
        core.shutdown()
        core.mm.close()
        pool.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model_bytes": core.store.model("m").weight_bytes,
        "rounds": rounds,
        "pooled_s": times["pooled"],
        "fresh_s": times["fresh"],
        "pooled_median_s": med["pooled"],
        "fresh_median_s": med["fresh"],
        "fresh_over_pooled": med["fresh"] / med["pooled"],
    }


def bench_rtt(root: Path, tmp: Path, calls: int) -> dict:
    cfg = AgentConfig(
        model_dir=root,
        simulate_gpus=[256 * MiB] * 2,
        listen="127.0.0.1:0",
        memory_dir=tmp / "rtt-gpus",
        use_workers=False,
        node_name="bench",
    )
    out = {}
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        for name, fn in (("describe", c.describe), ("health", c.health)):
            for _ in range(10):
                fn()
            samples = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            samples.sort()
            out[name] = {
                "calls": calls,
                "median_ms": 1000 * statistics.median(samples),
                "p99_ms": 1000 * samples[min(len(samples) - 1, int(0.99 * len(samples)))],
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5, help="activations per kind (5)")
    ap.add_argument("--rtt-calls", type=int, default=200, help="gRPC calls per RPC (200)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", default="bench/results/agent_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as td:
        tmp = Path(td)
        root = tmp / "models"
        write_model(root, "m", args.layers, args.hidden)
        act = bench_activation(root, tmp, args.rounds)
        rtt = bench_rtt(root, tmp, args.rtt_calls)
    print(f"model: {act['model_bytes'] / MiB:.1f} MiB, {args.layers} layers; rounds={args.rounds}")
    print(f"{'measure':<34}{'median':>12}")
    print(f"{'activation, pooled worker':<34}{act['pooled_median_s'] * 1000:>10.1f}ms")
    print(f"{'activation, fresh process':<34}{act['fresh_median_s'] * 1000:>10.1f}ms")
    print(f"{'ratio fresh / pooled':<34}{act['fresh_over_pooled']:>11.1f}x")
    for name, r in rtt.items():
        label = f"gRPC RTT {name} (p99 {r['p99_ms']:.2f}ms)"
        print(f"{label:<34}{r['median_ms']:>10.2f}ms")
    result = {
        "activation": act,
        "rtt": rtt,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "time_unix": time.time(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
