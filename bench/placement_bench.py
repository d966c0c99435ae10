"""Benchmark of evict-aware placement (``plan_prewarm``): wall time vs cluster and model count.

Grid: 8, 64 and 1,024 GPUs (nodes of 8 x 80 GiB) x 20, 100 and 500 models.  Each scenario is
generated from a fixed seed: model sizes drawn from the paper's Table 1 family plus a 34B TP2
and a Mixtral-sized TP4 model; about a quarter of the GPUs already serve instances (aligned
groups, so the scenario itself respects the nesting rule); forecasts give each model 0-2
instances' worth of average load and a peak 1-3x higher, so most models ask for 1-3 replicas.

It prints a table (GPUs, models, replicas requested, placed, median wall ms of N runs, the
first-fit ablation for comparison, and a re-plan of the same forecasts once the plan is applied,
where every replica is matched and kept) and saves JSON to ``bench/results/placement.json``.  Wall
time is measured on one process (the planner is single-threaded Python + numpy).

    python bench/placement_bench.py            # default grid, 7 runs each
    python bench/placement_bench.py --runs 3 --out /tmp/p.json
    python bench/placement_bench.py --smoke    # seconds: one small cell, JSON to a temp dir
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    GiB,
    Instance,
    LoadForecast,
    ModelSpec,
    Node,
    WorkerState,
)
from warmserve.policy.evict_aware_placement import apply_plan, plan_prewarm
from warmserve.testing.smoke import add_smoke_flag, apply_smoke

# (weight bytes, tp, cold start s): Table 1's Llama2 family plus two common larger shapes.
FAMILY = [
    (int(12.55e9), 1, 3.5),
    (int(24.24e9), 2, 3.4),
    (int(68.0e9), 2, 7.8),
    (int(93.4e9), 4, 5.7),
    (int(128.49e9), 4, 7.4),
]
GPUS_PER_NODE = 8
SMOKE = {"gpus": [8], "models": [5], "runs": 1}


def make_scenario(n_gpus: int, n_models: int, seed: int) -> ClusterState:
    """A reproducible cluster snapshot (see module docstring)."""
    rng = random.Random(seed * 1_000_003 + n_gpus * 1009 + n_models)
    models = {}
    for i in range(n_models):
        weight, tp, tc = FAMILY[rng.randrange(len(FAMILY))]
        name = f"m{i:04d}"
        models[name] = ModelSpec(name, weight, tp, 32, tc * rng.uniform(0.8, 1.2))
    n_nodes = max(n_gpus // GPUS_PER_NODE, 1)
    per_node = min(n_gpus, GPUS_PER_NODE)
    busy: dict[int, set[int]] = {k: set() for k in range(n_nodes)}
    instances = []
    names = sorted(models)
    target = n_gpus // 4
    used = 0
    for _ in range(20 * n_gpus):  # bounded: random aligned slots until a quarter is busy
        if used >= target:
            break
        m = models[names[rng.randrange(len(names))]]
        if m.tp > per_node:
            continue
        k = rng.randrange(n_nodes)
        start = rng.randrange(0, per_node - m.tp + 1, m.tp)
        gpus = set(range(start, start + m.tp))
        if gpus & busy[k]:
            continue
        busy[k] |= gpus
        used += m.tp
        instances.append(
            Instance(m.name, f"node{k:03d}", tuple(sorted(gpus)), rng.randrange(1, 32),
                     40 * GiB, 10 * GiB)
        )
    nodes = []
    for k in range(n_nodes):
        gpus = []
        for g in range(per_node):
            if g in busy[k]:
                gpus.append(GPU(g, 80 * GiB, 0, WorkerState.DEDICATED))
            else:
                gpus.append(GPU(g, 80 * GiB, 80 * GiB, WorkerState.IDLE))
        nodes.append(Node(f"node{k:03d}", tuple(gpus)))
    active = {n: 0 for n in models}
    for inst in instances:
        active[inst.model] += 1
    forecasts = {}
    for name, spec in models.items():
        avg = (active[name] + rng.uniform(0.0, 2.0)) * spec.max_batch * rng.uniform(0.5, 1.0)
        forecasts[name] = LoadForecast(avg, avg * rng.uniform(1.0, 3.0) + 1.0)
    return ClusterState(tuple(nodes), models, (), tuple(instances), forecasts)


def _median_ms(state: ClusterState, runs: int, evict_aware: bool) -> tuple[float, object]:
    times = []
    plan = None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = plan_prewarm(state, evict_aware=evict_aware)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times), plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 1024])
    ap.add_argument("--models", type=int, nargs="+", default=[20, 100, 500])
    ap.add_argument("--runs", type=int, default=7, help="runs per cell; the median is reported")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="result file (default: bench/results/placement.json)")
    add_smoke_flag(ap, SMOKE)
    args = ap.parse_args(argv)
    apply_smoke(args, SMOKE, {"out": Path(__file__).parent / "results" / "placement.json"})

    rows = []
    header = (
        f"{'GPUs':>6} {'models':>6} {'requested':>9} {'placed':>6} {'wall ms':>9} "
        f"{'first-fit ms':>12} {'replan ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for n_gpus in args.gpus:
        for n_models in args.models:
            state = make_scenario(n_gpus, n_models, args.seed)
            ms, plan = _median_ms(state, args.runs, True)
            ff_ms, _ = _median_ms(state, args.runs, False)
            # the next window with the plan executed: resident replicas are matched and kept
            re_ms, _ = _median_ms(apply_plan(state, plan), args.runs, True)
            row = {
                "gpus": n_gpus,
                "models": n_models,
                "instances": len(state.instances),
                "requested": plan.requested,
                "placed": len(plan.place),
                "unplaced": len(plan.unplaced),
                "wall_ms_median": round(ms, 2),
                "first_fit_ms_median": round(ff_ms, 2),
                "replan_ms_median": round(re_ms, 2),
                "runs": args.runs,
            }
            rows.append(row)
            print(
                f"{n_gpus:>6} {n_models:>6} {row['requested']:>9} {row['placed']:>6} "
                f"{ms:>9.1f} {ff_ms:>12.1f} {re_ms:>9.1f}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "placement",
        "seed": args.seed,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
