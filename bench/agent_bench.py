#!/usr/bin/env python
"""Node agent benchmark: weight-load bandwidth through the worker data path, activation latency
from a pooled worker vs a freshly started process, and the gRPC round-trip time.

Load: a model is prewarmed into a slot whose memory a GPU worker process owns (simulated backend
in the worker, as ``--gpus auto`` runs the cuda backend there).  "file ranges" is the current
path (the worker reads the safetensors ranges itself through its staging ring); "pickled" is the
path before issue 13 (the agent reads the bytes and sends them through the worker's pipe), kept
here only as the baseline.  Interleaved rounds, medians, ratio.

Activation = ``NodeCore.activate`` of a prewarmed model (a prewarm hit): map the KV cache, hand
the slot to the engine in a worker process, the engine verifies its weights and starts serving
HTTP.  "pooled" uses the GPU's long-lived worker (already started, libraries imported); "fresh"
starts a new worker process for the activation; "cold" activates with nothing resident (the
model loads while the engine waits).  All kinds run in the same process, interleaved, on the same
simulated GPU and model; reported as medians and ratios, also "Activate + first token" (the
latency a user's first request sees).

KV mapping: the same prewarm-hit activation with the KV range mapped synchronously before the
engine starts vs in the background while it starts (WarmServe §4.2), interleaved, on an 80 GiB
simulated GPU with a per-page driver cost (``--kv-map-us``).

RTT: ``Describe`` and the standard health ``Check`` over loopback gRPC to a running agent.
(Just over 400 lines: one script, its four parts and their table, read top to bottom.)

    python bench/agent_bench.py [--rounds 5] [--rtt-calls 200] [--load-mib 256] [--out FILE.json]
    python bench/agent_bench.py --smoke    # seconds: tiny sizes, JSON to a temp dir
"""

from __future__ import annotations

import argparse
import asyncio
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

import numpy as np
from safetensors.numpy import save_file
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.backends.workers import WorkerMemoryBackend
from warmserve_agent.config import AgentConfig
from warmserve_agent.engine_host import FreshWorkerEngine, WorkerEngine
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import AgentThread
from warmserve_agent.worker import WorkerPool

from warmserve.api.agent.client import SyncAgentClient
from warmserve.testing.procs import run_supervised
from warmserve.testing.smoke import add_smoke_flag, apply_smoke

MiB = 1024**2
SMOKE = {
    "rounds": 1,
    "rtt_calls": 10,
    "load_mib": 16,
    "watch_cycles": 10,
    "kv_map_us": "2",
    "kv_gpu_gib": 4,
}


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


def load_pickled(mm: MemoryManager, store: WeightStore, layout, slot_id: str, gpus) -> None:
    """The pre-issue-13 data path, verbatim in effect: the agent reads each tensor from its host
    cache and ``MemoryManager.write`` pickles the bytes through the worker's pipe."""
    for layer in range(layout.model.num_layers):
        for pl in layout.layer_placements(layer):
            host = store.host_view(pl.tensor)
            for rank, gpu in enumerate(gpus):
                s, n = pl.shard(rank)
                mm.ensure_mapped(slot_id, pages_for(pl.slot_offset + n, mm.page_bytes))
                mm.write(slot_id, gpu, pl.slot_offset, host[s : s + n])
        for gpu in gpus:
            mm.backend.sync(gpu)


def bench_load(root: Path, tmp: Path, rounds: int) -> dict:
    """Prewarm bandwidth of model "big" into worker-owned (simulated) memory, both paths."""
    pool = WorkerPool([0], spares=0)
    pool.start()
    backend = WorkerMemoryBackend(pool, "simulated", 2 * MiB, directory=str(tmp / "load-gpus"))
    core = NodeCore(
        MemoryManager(backend),
        WeightStore(root),
        {0: 4 * 1024 * MiB},
        lambda group: WorkerEngine(pool, group),
        node_name="bench",
    )
    layout = core.store.layout("big", 1)
    model_bytes = layout.model.weight_bytes
    secs: dict[str, list[float]] = {"file_ranges": [], "pickled": []}
    try:
        for r in range(2 * rounds + 2):
            kind = ("file_ranges", "pickled")[r % 2]
            t0 = time.perf_counter()
            if kind == "file_ranges":  # the production path: NodeCore's loader
                slot = core.prewarm("big", [0])
                slot.loader.join()
                assert slot.state == "ready", slot.message
                dt = time.perf_counter() - t0
                core.evict(slot.slot_id)
            else:
                core.mm.create_slot("pickled", [0])
                load_pickled(core.mm, core.store, layout, "pickled", [0])
                dt = time.perf_counter() - t0
                core.mm.destroy_slot("pickled")
            if r >= 2:  # one warm-up round per kind (page cache, host cache, worker imports)
                secs[kind].append(dt)
    finally:
        core.shutdown()
        core.mm.close()
        pool.close()
    bw = {k: model_bytes / statistics.median(v) for k, v in secs.items()}
    return {
        "model_bytes": model_bytes,
        "rounds": rounds,
        "seconds": secs,
        "bandwidth_bytes_per_s": bw,
        "file_ranges_over_pickled": bw["file_ranges"] / bw["pickled"],
    }


def first_token(endpoint: str) -> None:
    """One completion with max_tokens=1: returns when the first token is served."""
    body = json.dumps({"prompt": "warm", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        endpoint + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


KINDS = ("pooled_hit", "fresh_hit", "pooled_cold")


def bench_activation(root: Path, tmp: Path, rounds: int, copy_gbps: float = 0.0) -> dict:
    """Per kind: Activate latency and Activate + first token (the cold start the user sees).

    pooled_hit: prewarmed slot, the GPU's long-lived worker hosts the engine;
    fresh_hit: prewarmed slot, a freshly started worker process hosts it;
    pooled_cold: nothing resident (slot evicted first), pooled worker: the whole model loads
    while the engine waits for its layers.
    """
    pool = WorkerPool([0], spares=0)
    pool.start()
    mode = {"fresh": False}

    def factory(group):
        return FreshWorkerEngine(group) if mode["fresh"] else WorkerEngine(pool, group)

    core = NodeCore(
        MemoryManager(
            SimulatedBackend(
                tmp / "gpus",
                page_bytes=2 * MiB,
                copy_bytes_per_s=copy_gbps * 1e9 if copy_gbps > 0 else None,
            )
        ),
        WeightStore(root),
        {0: 256 * MiB},
        factory,
        node_name="bench",
    )
    act: dict[str, list[float]] = {k: [] for k in KINDS}
    ttft: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        for r in range(len(KINDS) * rounds + 1):
            kind = KINDS[r % len(KINDS)]
            mode["fresh"] = kind == "fresh_hit"
            for s in list(core.slots.values()):
                if kind == "pooled_cold":
                    core.evict(s.slot_id)
            if kind != "pooled_cold" and not core.slots:
                slot = core.prewarm("m", [0])
                slot.loader.join()
            t0 = time.perf_counter()
            inst, _ = core.activate("m", [0])
            t_act = time.perf_counter() - t0
            first_token(inst.endpoint)
            t_tok = time.perf_counter() - t0
            assert inst.prewarm_hit == (kind != "pooled_cold")
            if r > 0:  # the first round warms caches (digests, host copies)
                act[kind].append(t_act)
                ttft[kind].append(t_tok)
            core.begin_grace(inst.instance_id)
            core.end_instance(inst.instance_id)
    finally:
        core.shutdown()
        core.mm.close()
        pool.close()
    med = {k: statistics.median(v) for k, v in act.items()}
    med_tok = {k: statistics.median(v) for k, v in ttft.items()}
    return {
        "model_bytes": core.store.model("m").weight_bytes,
        "rounds": rounds,
        "activate_s": act,
        "activate_first_token_s": ttft,
        "activate_median_s": med,
        "activate_first_token_median_s": med_tok,
        "fresh_over_pooled": med["fresh_hit"] / med["pooled_hit"],
        "cold_over_hit_first_token": med_tok["pooled_cold"] / med_tok["pooled_hit"],
    }


_STALLED_CLIENTS = """
import sys, time, grpc
from warmserve.api.agent.v1 import agent_pb2_grpc as g, agent_pb2 as pb
opts = [("grpc.http2.bdp_probe", 0)]  # 64 KiB windows: the agent sees the stall early
chans = [grpc.insecure_channel(sys.argv[1], options=opts) for _ in range(int(sys.argv[2]))]
calls = [g.NodeAgentStub(c).Watch(pb.WatchRequest()) for c in chans]
print("ready", flush=True)
time.sleep(3600)
"""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def bench_watch(root: Path, tmp: Path, cycles: int, stalled: int = 20) -> dict:
    """Prewarm+evict cycles over gRPC with no Watch clients, then with ``stalled`` clients that
    opened a Watch and never read it (issue 16: they made the agent ~4x slower and held 8 MB).
    The agent runs in this process, so RSS growth is the agent's."""
    cfg = AgentConfig(
        model_dir=root,
        simulate_gpus=[256 * MiB],
        listen="127.0.0.1:0",
        memory_dir=tmp / "watch-gpus",
        use_workers=False,
        node_name="bench",
    )
    out: dict = {"cycles": cycles, "stalled_clients": stalled}
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:

        def run() -> tuple[float, float]:
            """(wall seconds, CPU seconds of this process: agent + the bench's own client)."""
            t0, c0 = time.perf_counter(), os.times()
            for _ in range(cycles):
                c.evict(c.prewarm_wait("m", [0]).slot_id)
            c1 = os.times()
            return time.perf_counter() - t0, (c1.user - c0.user) + (c1.system - c0.system)

        run()  # warm-up
        out["alone_s"], out["alone_cpu_s"] = run()
        rss0 = _rss_bytes()
        # The stalled clients live in another process, so RSS growth here is the agent's.
        clients = subprocess.Popen(
            [sys.executable, "-c", _STALLED_CLIENTS, a.address, str(stalled)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert clients.stdout is not None and clients.stdout.readline().strip() == "ready"
            svc = a.server.service
            t0 = time.monotonic()
            while svc.watcher_count < stalled and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            # First run: the stalled clients are served until their flow-control windows fill,
            # then dropped; second run: they are still connected but dropped.
            out["with_stalled_s"], out["with_stalled_cpu_s"] = run()
            out["after_drop_s"], out["after_drop_cpu_s"] = run()
            out["rss_growth_bytes"] = _rss_bytes() - rss0
            out["watchers_dropped"] = svc.watchers_dropped
            out["events_queued_at_end"] = a.run(asyncio.to_thread(svc.queued_events))
        finally:
            clients.kill()
            clients.wait()
    out["slowdown"] = out["with_stalled_s"] / out["alone_s"]
    out["cpu_ratio_with_stalled"] = out["with_stalled_cpu_s"] / out["alone_cpu_s"]
    out["cpu_ratio_after_drop"] = out["after_drop_cpu_s"] / out["alone_cpu_s"]
    return out


def bench_kv_mapping(
    root: Path, tmp: Path, rounds: int, map_us: tuple[float, ...], gpu_gib: int
) -> dict:
    """Activate (a prewarm hit) with the KV range mapped synchronously before the engine starts
    vs mapped in the background while it starts (WarmServe §4.2), on a simulated GPU of
    ``gpu_gib`` GiB with 2 MiB pages and a driver cost of ``map_us`` per page mapped or
    unmapped (the timing model of ``--sim-map-us``).  Both modes in this process, interleaved,
    same model, the GPU's pooled worker hosting the engine; between rounds every page is
    unmapped (so neither mode reuses pages still mapped).  Also: when the background mode's
    range was fully mapped, measured from the start of Activate."""
    pool = WorkerPool([0], spares=0)
    pool.start()
    out: dict = {"gpu_bytes": gpu_gib * 1024 * MiB, "rounds": rounds, "by_map_us": {}}
    try:
        for us in map_us:
            cores = {
                mode: NodeCore(
                    MemoryManager(
                        SimulatedBackend(
                            tmp / f"kv-{mode}-{us}", page_bytes=2 * MiB, map_s_per_page=us * 1e-6
                        )
                    ),
                    WeightStore(root),
                    {0: gpu_gib * 1024 * MiB},
                    lambda group: WorkerEngine(pool, group),
                    node_name="bench",
                    kv_background=mode == "background",
                )
                for mode in ("sync", "background")
            }
            act: dict[str, list[float]] = {m: [] for m in cores}
            tok: dict[str, list[float]] = {m: [] for m in cores}
            full: list[float] = []
            try:
                for r in range(2 * rounds + 2):
                    mode = ("sync", "background")[r % 2]
                    core = cores[mode]
                    if not core.slots:
                        core.prewarm("m", [0]).loader.join()  # type: ignore[union-attr]
                    assert core.kv_idle(600)
                    t0 = time.perf_counter()
                    inst, _ = core.activate("m", [0])
                    t_act = time.perf_counter() - t0
                    first_token(inst.endpoint)
                    t_tok = time.perf_counter() - t0
                    assert core.kv_idle(600)
                    t_full = time.perf_counter() - t0
                    kv_pages = inst.kv_pages_initial
                    if r >= 2:  # one warm-up round per mode
                        act[mode].append(t_act)
                        tok[mode].append(t_tok)
                        if mode == "background":
                            full.append(t_full)
                    core.begin_grace(inst.instance_id)
                    core.end_instance(inst.instance_id)
            finally:
                for core in cores.values():
                    core.shutdown()
                    core.mm.close()
            med = {m: statistics.median(v) for m, v in act.items()}
            med_tok = {m: statistics.median(v) for m, v in tok.items()}
            out["by_map_us"][str(us)] = {
                "kv_pages": kv_pages,
                "activate_s": act,
                "activate_first_token_s": tok,
                "activate_median_s": med,
                "activate_first_token_median_s": med_tok,
                "background_fully_mapped_median_s": statistics.median(full),
                "saved_median_s": med["sync"] - med["background"],
                "sync_over_background": med["sync"] / med["background"],
            }
    finally:
        pool.close()
    return out


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
    ap.add_argument(
        "--copy-gbps",
        type=float,
        default=0.0,
        help="simulated host-to-GPU copy bandwidth in GB/s (0: no timing model, memcpy speed)",
    )
    ap.add_argument(
        "--load-mib", type=int, default=256, help="model size for the load bandwidth part (256)"
    )
    ap.add_argument(
        "--watch-cycles", type=int, default=200, help="prewarm+evict cycles per watch run (200)"
    )
    ap.add_argument(
        "--kv-map-us",
        default="2,40",
        help="simulated driver cost per page mapped/unmapped for the KV mapping part, "
        "comma-separated microseconds (2: cuMemMap alone; 40: the paper's 10 GB in 0.2 s)",
    )
    ap.add_argument("--kv-gpu-gib", type=int, default=80, help="simulated GPU size (80 GiB)")
    ap.add_argument("--out", help="result file (default: bench/results/agent_bench.json)")
    add_smoke_flag(ap, SMOKE)
    args = ap.parse_args()
    apply_smoke(args, SMOKE, {"out": "bench/results/agent_bench.json"})
    return run_supervised(lambda: _run(args), "agent_bench")


def _run(args: argparse.Namespace) -> int:
    kv_map_us = tuple(float(x) for x in args.kv_map_us.split(",") if x)
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as td:
        tmp = Path(td)
        root = tmp / "models"
        write_model(root, "m", args.layers, args.hidden)
        # 16 layers of hidden x 4*hidden float32 (+ embeddings) ~= load_mib
        hidden = max(64, int((args.load_mib * MiB / (16 * 16)) ** 0.5))
        write_model(root, "big", 16, hidden)
        load = bench_load(root, tmp, args.rounds)
        act = bench_activation(root, tmp, args.rounds, args.copy_gbps)
        kvmap = bench_kv_mapping(root, tmp, args.rounds, kv_map_us, args.kv_gpu_gib)
        rtt = bench_rtt(root, tmp, args.rtt_calls)
        watch = bench_watch(root, tmp, args.watch_cycles)
    timing = f"{args.copy_gbps} GB/s copies" if args.copy_gbps > 0 else "no timing model"
    print(
        f"load: {load['model_bytes'] / MiB:.0f} MiB model into worker-owned simulated memory, "
        f"rounds={args.rounds}"
    )
    for k in ("pickled", "file_ranges"):
        label = {"pickled": "before (pickled over the pipe)", "file_ranges": "after (file ranges)"}
        print(f"{'load ' + label[k]:<40}{load['bandwidth_bytes_per_s'][k] / 1e9:>8.2f} GB/s")
    print(f"{'ratio after / before':<40}{load['file_ranges_over_pickled']:>8.2f}x")
    print(
        f"model: {act['model_bytes'] / MiB:.1f} MiB, {args.layers} layers; "
        f"rounds={args.rounds}; {timing}"
    )
    print(f"{'measure (median)':<36}{'Activate':>11}{'+1st token':>12}")
    for k in KINDS:
        a_ms = act["activate_median_s"][k] * 1000
        t_ms = act["activate_first_token_median_s"][k] * 1000
        print(f"{'activation, ' + k.replace('_', ' '):<36}{a_ms:>9.1f}ms{t_ms:>10.1f}ms")
    print(f"{'ratio fresh / pooled (Activate)':<36}{act['fresh_over_pooled']:>10.1f}x")
    print(f"{'ratio cold / hit (+1st token)':<36}{act['cold_over_hit_first_token']:>10.1f}x")
    print(
        f"KV mapping: {args.kv_gpu_gib} GiB simulated GPU, 2 MiB pages, prewarm hit, "
        f"rounds={args.rounds}"
    )
    print(f"{'measure (median)':<36}{'Activate':>11}{'+1st token':>12}{'KV mapped':>12}")
    for us, k in kvmap["by_map_us"].items():
        for mode in ("sync", "background"):
            a_ms = k["activate_median_s"][mode] * 1000
            t_ms = k["activate_first_token_median_s"][mode] * 1000
            f_ms = (
                k["background_fully_mapped_median_s"] * 1000 if mode == "background" else a_ms
            )
            label = f"KV {mode}, {float(us):g} us/page ({k['kv_pages']} pages)"
            print(f"{label:<36}{a_ms:>9.1f}ms{t_ms:>10.1f}ms{f_ms:>10.1f}ms")
        print(
            f"{'  activation time saved':<36}{k['saved_median_s'] * 1000:>9.1f}ms"
            f"{'':>12}{k['sync_over_background']:>10.1f}x"
        )
    for name, r in rtt.items():
        label = f"gRPC RTT {name} (p99 {r['p99_ms']:.2f}ms)"
        print(f"{label:<36}{r['median_ms']:>9.2f}ms")
    w = watch
    print(f"watch: {w['cycles']} prewarm+evict cycles over gRPC (wall / CPU of agent+client)")
    for label, k in (
        ("  no Watch clients", "alone"),
        (f"  {w['stalled_clients']} stalled clients connect", "with_stalled"),
        ("  same clients, after they were dropped", "after_drop"),
    ):
        print(f"{label:<40}{w[k + '_s']:>7.2f} s {w[k + '_cpu_s']:>6.2f} s CPU")
    print(
        f"  dropped {w['watchers_dropped']}, events still queued {w['events_queued_at_end']}, "
        f"RSS +{w['rss_growth_bytes'] / MiB:.1f} MiB"
    )
    result = {
        "watch": watch,
        "load": load,
        "activation": act,
        "kv_mapping": kvmap,
        "copy_gbps": args.copy_gbps,
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
