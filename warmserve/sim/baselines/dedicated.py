"""``dedicated``: the best static allocation of the cluster's GPUs (docs/evaluation.md).

Every model gets a fixed number of always-on instances of its own (no sharing, no starts), as a
platform without autoscaling would run it.  The reference is only useful if it is the *best*
such allocation of the same GPUs, so the counts come from simulated service times, not from a
rule of thumb:

1. For each model alone and each instance count ``k`` it may need, the simulator runs the
   model's own requests of the period on ``k`` dedicated instances (the same event loop and
   engine model as every other system; instances of different models never interact, so a
   model's latencies depend only on its own ``k``).  Each run is made once and cached.
   A model's count grows only while one more instance still improves its own **tail mean**
   (the mean of its slowest 1 % of TTFTs) by at least 0.5 %, and while the others keep one
   instance each.
2. Every combination of those counts that fits the GPUs is scored on the merged histograms:
   the lowest overall **P99 TTFT** wins; P99s within 1 % of each other count as equal, and then
   the allocation with fewer GPUs wins (GPUs that cannot help stay free and are not counted in
   GPU-hours).  With more than 20,000 combinations (large clusters) a greedy marginal
   allocation replaces the search: the next instance goes to the model whose extra instance
   lowers the overall tail mean most per GPU it takes (the P99 of a mixture is flat in most
   single steps, so a greedy step on it stalls).
3. The instances are placed like any start on an empty cluster
   (:func:`~warmserve.policy.start_choice.choose_start`, largest TP first).

The result is the reference point of the evaluation: WarmServe's P99 against it, and its
GPU-hours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    Instance,
    InstancePhase,
    Node,
    WorkerState,
)
from warmserve.policy.scoring import instances_for
from warmserve.policy.start_choice import NoCapacity, choose_start
from warmserve.sim.cluster import SimCluster
from warmserve.sim.core import Simulation
from warmserve.sim.hooks import StaticLayout
from warmserve.sim.model import Prepared, StaticInstance
from warmserve.sim.stats import NBUCKETS, LogHistogram, ModelStats
from warmserve.sim.systems import get_system
from warmserve.sim.workload import Requests

TAIL = 0.01  # the tail whose mean the allocation minimises
MIN_GAIN = 0.005  # an instance must improve its model's own tail mean by this share


def _state(prep: Prepared, placed: list[StaticInstance]) -> ClusterState:
    sc = prep.scenario
    held = {(s.node, g) for s in placed for g in s.gpus}
    hbm = prep.profile.hbm_bytes
    nodes = tuple(
        Node(
            f"node-{n}",
            tuple(
                GPU(g, hbm, 0 if (f"node-{n}", g) in held else hbm,
                    WorkerState.DEDICATED if (f"node-{n}", g) in held else WorkerState.IDLE)
                for g in range(sc.gpus_per_node)
            ),
        )
        for n in range(sc.nodes)
    )
    specs = {m.spec.name: m.spec for m in prep.models}
    insts = tuple(Instance(s.model, s.node, s.gpus, phase=InstancePhase.SERVING) for s in placed)
    return ClusterState(nodes, specs, (), insts, {})


def place(prep: Prepared, counts: dict[str, int]) -> list[StaticInstance] | None:
    """``counts`` instances per model on an empty cluster, largest TP first (None: no fit)."""
    order = sorted(
        (m for m in prep.models if counts.get(m.spec.name, 0) > 0),
        key=lambda m: (-m.spec.tp, m.idx),
    )
    placed: list[StaticInstance] = []
    for m in order:
        for _ in range(counts[m.spec.name]):
            choice = choose_start(_state(prep, placed), m.spec.name)
            if isinstance(choice, NoCapacity):
                return None
            placed.append(StaticInstance(m.spec.name, choice.node, choice.gpus))
    return placed


def _one_model_source(prep: Prepared, idx: int) -> Iterator[Requests]:
    stream = prep.stream
    for c in range(math.ceil(prep.scenario.duration_s / stream.chunk_s)):
        t, inp, out = stream.model_chunk(idx, c)
        keep = t < prep.scenario.duration_s
        yield Requests(t[keep], np.full(int(keep.sum()), idx, dtype=np.int32), inp[keep],
                       out[keep])


def simulate_alone(prep: Prepared, idx: int, k: int) -> ModelStats:
    """Model ``idx``'s requests on ``k`` dedicated instances of its own."""
    sc = prep.scenario
    m = prep.models[idx]
    placed = place(prep, {m.spec.name: k})
    if placed is None:
        raise ValueError(f"{k} instances of {m.spec.name} do not fit the cluster")
    models = [replace(x, placeable=x.idx == idx, avg_history=[], peak_history=[])
              for x in prep.models]
    sim = Simulation(
        system=get_system("dedicated"),
        models=models,
        cluster=SimCluster(sc.nodes, sc.gpus_per_node, prep.profile.hbm_bytes),
        source=_one_model_source(prep, idx),
        duration_s=sc.duration_s,
        window_s=sc.window_s,
        autoscaler=AutoscalerConfig(),  # nothing autoscales
        scale_interval_s=sc.scale_interval_s,
        queue_timeout_s=sc.queue_timeout_s,
        drain_s=sc.drain_s,
        hooks=StaticLayout(placed),
    )
    return sim.run().stats[idx]


def _merged(hists: list[LogHistogram]) -> LogHistogram:
    out = LogHistogram()
    for h in hists:
        out.merge(h)
    return out


def tail_mean(hists: list[LogHistogram], tail: float = TAIL) -> float:
    """Mean of the slowest ``tail`` share of the merged histograms' values (bucket midpoints)."""
    counts = np.zeros(NBUCKETS)
    n = 0
    for h in hists:
        counts += np.asarray(h.counts, dtype=float)
        n += h.n
    if n == 0:
        return 0.0
    want = max(tail * n, 1.0)
    mids = np.sqrt(_EDGES[:-1] * _EDGES[1:])
    cum = np.cumsum(counts[::-1])
    k = int(np.searchsorted(cum, want))  # buckets from the top needed to cover the tail
    top = counts[::-1][: k + 1].copy()
    top[-1] -= cum[min(k, len(cum) - 1)] - want
    return float((top * mids[::-1][: k + 1]).sum() / want)


_EDGES = np.array([LogHistogram.edge(i) for i in range(NBUCKETS + 1)])
MAX_COMBOS = 20000  # above this many count vectors, greedy marginal allocation instead


def best_allocation(prep: Prepared) -> tuple[dict[str, int], dict[str, Any]]:
    """Instance counts per model (module docstring) and how they were found."""
    models = [m for m in prep.models if m.placeable and prep.facts[m.idx].requests > 0]
    gpus = prep.scenario.nodes * prep.scenario.gpus_per_node
    cache: dict[tuple[int, int], ModelStats] = {}

    def stats(idx: int, k: int) -> ModelStats:
        if (idx, k) not in cache:
            cache[(idx, k)] = simulate_alone(prep, idx, k)
        return cache[(idx, k)]

    # 1. each model alone, one more instance at a time until one more stops helping
    floor = sum(m.spec.tp for m in models)
    useful: dict[str, int] = {}
    for m in models:
        k = 1
        room = gpus - floor + m.spec.tp  # the others keep one instance each
        while (k + 1) * m.spec.tp <= room and place(prep, {m.spec.name: k + 1}) is not None:
            if tail_mean([stats(m.idx, k + 1).ttft]) > tail_mean([stats(m.idx, k).ttft]) * (
                1 - MIN_GAIN
            ):
                break
            k += 1
        stats(m.idx, k)
        useful[m.spec.name] = k
    # 2. every combination of useful counts that fits, lowest P99 first, then fewest GPUs
    names = [m.spec.name for m in models]
    tps = np.array([m.spec.tp for m in models])
    ranges = [range(1, useful[n] + 1) for n in names]
    n_combos = int(np.prod([len(r) for r in ranges])) if ranges else 0
    how = "exhaustive"
    best: tuple[float, int, tuple[int, ...]] | None = None
    if 0 < n_combos <= MAX_COMBOS and floor <= gpus:
        for combo in itertools.product(*ranges):
            g = int((tps * np.array(combo)).sum())
            if g > gpus:
                continue
            merged = _merged([stats(m.idx, k).ttft for m, k in zip(models, combo, strict=True)])
            p99 = merged.quantile(0.99) or 0.0
            key = (round(math.log(max(p99, 1e-9)) / math.log(1 + P99_TIE)), g, combo)
            if best is None or key < best:
                best = key
    if best is not None:
        counts = dict(zip(names, best[2], strict=True))
        if place(prep, counts) is None:
            best = None
    if best is None:
        how = "greedy"
        counts = _greedy(prep, models, gpus, stats)
    used = sum(counts.get(m.spec.name, 0) * m.spec.tp for m in models)
    info = {
        "counts": dict(counts),
        "gpus_used": used,
        "gpus": gpus,
        "search": how,
        "combinations": n_combos,
        "single_model_runs": len(cache),
        "useful_counts": useful,
        "peak_rule_counts": {
            m.spec.name: max(1, instances_for(prep.facts[m.idx].peak_inflight, m.spec.max_batch))
            for m in models
        },
    }
    return counts, info


P99_TIE = 0.01  # P99s within 1 % of each other count as equal (then fewer GPUs win)


def _greedy(prep: Prepared, models: list[Any], gpus: int, stats: Any) -> dict[str, int]:
    """Greedy marginal allocation by tail mean per GPU (large clusters, module docstring)."""
    counts = {m.spec.name: 1 for m in models}
    if place(prep, counts) is None:  # not even one each: largest first until full
        counts = {}
        for m in sorted(models, key=lambda m: -m.spec.tp):
            if place(prep, {**counts, m.spec.name: 1}) is not None:
                counts[m.spec.name] = 1
    used = sum(counts[m.spec.name] * m.spec.tp for m in models if m.spec.name in counts)
    saturated: set[str] = set()
    while True:
        current = [stats(m.idx, counts[m.spec.name]).ttft for m in models if m.spec.name in counts]
        base = tail_mean(current)
        best: tuple[float, Any] | None = None
        for m in models:
            name = m.spec.name
            if name not in counts or name in saturated or used + m.spec.tp > gpus:
                continue
            k = counts[name]
            if place(prep, {**counts, name: k + 1}) is None:
                saturated.add(name)
                continue
            mine, more = stats(m.idx, k).ttft, stats(m.idx, k + 1).ttft
            if tail_mean([more]) > tail_mean([mine]) * (1 - MIN_GAIN):
                saturated.add(name)  # more instances do not help this model
                continue
            trial = [stats(x.idx, counts[x.spec.name] + (x is m)).ttft
                     for x in models if x.spec.name in counts]
            gain = (base - tail_mean(trial)) / m.spec.tp
            if best is None or gain > best[0]:
                best = (gain, m)
        if best is None:
            return counts
        counts[best[1].spec.name] += 1
        used += best[1].spec.tp


def static_instances(prep: Prepared) -> tuple[list[StaticInstance], dict[str, Any]]:
    counts, info = best_allocation(prep)
    placed = place(prep, counts)
    assert placed is not None
    return placed, info
