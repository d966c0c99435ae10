"""Run the WarmServe §7.1 testbed grid in the simulator and write ``docs/evaluation.md``.

    python bench/paper_eval.py                      # full grid, all systems, ~2 min per point
    python bench/paper_eval.py --jobs 2             # grid points in parallel processes
    python bench/paper_eval.py --duration 600 --out /tmp/eval.md   # a quick look

The scenario is ``bench/scenarios/paper-testbed.yaml``; its ``grid`` (alpha x total_rps) is swept,
every point running every system on the same requests.  Results also go to
``bench/results/paper_eval.json``.  Nothing here is tuned to the paper: the physics constants
come from the cited GPU profile (``warmserve/sim/profiles/h800.yaml``) and the policies are the
project's policy modules; the paper's numbers are printed beside ours for comparison only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from warmserve.sim import workload as wl  # noqa: E402
from warmserve.sim.report import fmt_seconds, table  # noqa: E402
from warmserve.sim.runner import run_scenario  # noqa: E402
from warmserve.sim.scenario import Scenario, load_scenario  # noqa: E402

CODE_LENGTHS = "azure_code_2023_1h.csv.gz"  # §7.3 "Evaluation on AzureCode", alpha 0.5
WINDOWS_S = (180, 300, 600, 2400)  # §7.5: 3, 5 (default), 10 and 40 minutes
WINDOW_POINT = {"alpha": 0.5, "total_rps": 20.0}  # loaded, below the saturation of RPS 25

PAPER = {
    "p95_vs_sllm": (1.07, 10.06),
    "p99_vs_sllm": (1.53, 50.79),
    "proactive_tail": (1.03, 32.87),
    "hit_light": 1.00,
    "hit_rps25_avg": 0.82,
    "mux_rps15_a05": (34.5, 134.03),
    "ablation_100ms": {"warmserve-no-evict-aware": 0.29, "warmserve-no-proactive": 0.88},
}


def _point(args: tuple[str, dict[str, Any], list[str]]) -> dict[str, Any]:
    path, overrides, systems = args
    sc = load_scenario(path).with_overrides(**overrides)
    t0 = time.perf_counter()
    res = run_scenario(sc, systems)
    res["wall_s"] = time.perf_counter() - t0
    res["overrides"] = overrides
    return res


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _rows_by(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["system"]: r for r in res["rows"]}


def _main_table(points: list[dict[str, Any]]) -> str:
    head = (
        "| alpha | RPS | WarmServe P95 | WarmServe P99 | SLLM-GPU P95 | SLLM-GPU P99 | "
        "P95 gain | P99 gain | P99 gain vs SLLM-GPU-pooled | hit ratio | MuxServe P95 | "
        "MuxServe P99 | no-proactive P99 |"
    )
    lines = [head, "|" + "---|" * 13]
    for p in points:
        r = _rows_by(p)
        w, s = r.get("warmserve", {}), r.get("sllm-gpu", {})
        mx, npv = r.get("muxserve", {}), r.get("warmserve-no-proactive", {})
        lines.append(
            f"| {p['overrides']['alpha']:g} | {p['overrides']['total_rps']:g} "
            f"| {fmt_seconds(w.get('ttft_p95_s'))} | {fmt_seconds(w.get('ttft_p99_s'))} "
            f"| {fmt_seconds(s.get('ttft_p95_s'))} | {fmt_seconds(s.get('ttft_p99_s'))} "
            f"| {_x(_ratio(s.get('ttft_p95_s'), w.get('ttft_p95_s')))} "
            f"| {_x(_ratio(s.get('ttft_p99_s'), w.get('ttft_p99_s')))} "
            f"| {_x(_ratio(r.get('sllm-gpu-pooled', {}).get('ttft_p99_s'), w.get('ttft_p99_s')))} "
            f"| {_pct(w.get('hit_ratio'))} "
            f"| {fmt_seconds(mx.get('ttft_p95_s'))} | {fmt_seconds(mx.get('ttft_p99_s'))} "
            f"| {fmt_seconds(npv.get('ttft_p99_s'))} |"
        )
    return "\n".join(lines)


def _range(vals: list[float]) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return f"{min(vals):.2f}x-{max(vals):.2f}x"


def _comparison(points: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    p95 = [_ratio(_rows_by(p).get("sllm-gpu", {}).get("ttft_p95_s"),
                  _rows_by(p).get("warmserve", {}).get("ttft_p95_s")) for p in points]
    p99 = [_ratio(_rows_by(p).get("sllm-gpu", {}).get("ttft_p99_s"),
                  _rows_by(p).get("warmserve", {}).get("ttft_p99_s")) for p in points]
    pro = []
    for p in points:
        r = _rows_by(p)
        for q in ("ttft_p95_s", "ttft_p99_s"):
            pro.append(_ratio(r.get("warmserve-no-proactive", {}).get(q),
                              r.get("warmserve", {}).get(q)))
    light = [
        _rows_by(p).get("warmserve", {}).get("hit_ratio")
        for p in points if p["overrides"]["total_rps"] == min(
            q["overrides"]["total_rps"] for q in points)
    ]
    heavy = [
        _rows_by(p).get("warmserve", {}).get("hit_ratio")
        for p in points if p["overrides"]["total_rps"] == max(
            q["overrides"]["total_rps"] for q in points)
    ]
    light = [v for v in light if v is not None]
    heavy = [v for v in heavy if v is not None]
    mux15 = next(
        (p for p in points if p["overrides"]["total_rps"] == 15 and p["overrides"]["alpha"] == 0.5),
        None,
    )
    mux = ("-", "-")
    if mux15 is not None:
        r = _rows_by(mux15)
        mux = (
            _x(_ratio(r.get("muxserve", {}).get("ttft_p95_s"),
                      r.get("warmserve", {}).get("ttft_p95_s"))),
            _x(_ratio(r.get("muxserve", {}).get("ttft_p99_s"),
                      r.get("warmserve", {}).get("ttft_p99_s"))),
        )
    ours = {
        "p95_vs_sllm": _range(p95),
        "p99_vs_sllm": _range(p99),
        "proactive_tail": _range(pro),
        "hit_light": _pct(sum(light) / len(light)) if light else "-",
        "hit_heavy": _pct(sum(heavy) / len(heavy)) if heavy else "-",
        "mux15": mux,
    }
    lines = [
        "| claim (paper §7.3) | paper | this simulator |",
        "|---|---|---|",
        f"| P95 TTFT, SLLM-GPU / WarmServe | {PAPER['p95_vs_sllm'][0]}x-"
        f"{PAPER['p95_vs_sllm'][1]}x | {ours['p95_vs_sllm']} |",
        f"| P99 TTFT, SLLM-GPU / WarmServe | {PAPER['p99_vs_sllm'][0]}x-"
        f"{PAPER['p99_vs_sllm'][1]}x | {ours['p99_vs_sllm']} |",
        f"| tail TTFT, no-proactive / WarmServe | {PAPER['proactive_tail'][0]}x-"
        f"{PAPER['proactive_tail'][1]}x | {ours['proactive_tail']} |",
        f"| prewarm hit ratio, lightest load | 100% | {ours['hit_light']} |",
        f"| prewarm hit ratio, RPS 25 (mean over alpha) | 82% | {ours['hit_heavy']} |",
        f"| MuxServe / WarmServe at RPS 15, alpha 0.5 (P95, P99) | 34.5x, 134.03x "
        f"| {mux[0]}, {mux[1]} |",
    ]
    return "\n".join(lines), ours


def _tpot_table(points: list[dict[str, Any]]) -> str:
    lines = [
        "| alpha | RPS | system | TPOT p50 | TPOT p99 | TPOT < 50 ms | TPOT > 100 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        for name in ("warmserve", "sllm-gpu", "muxserve", "prism"):
            r = _rows_by(p).get(name)
            if r is None:
                continue
            lines.append(
                f"| {p['overrides']['alpha']:g} | {p['overrides']['total_rps']:g} | {name} "
                f"| {fmt_seconds(r['tpot_p50_s'])} | {fmt_seconds(r['tpot_p99_s'])} "
                f"| {_pct(r['tpot_under_50ms'])} | {_pct(r['tpot_over_100ms'])} |"
            )
    return "\n".join(lines)


def _ablation_table(points: list[dict[str, Any]]) -> str:
    lines = [
        "| alpha | RPS | WarmServe TTFT<100ms | no-evict-aware (ratio) | no-proactive (ratio) |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        r = _rows_by(p)
        base = r.get("warmserve", {}).get("ttft_under_100ms")
        cells = []
        for name in ("warmserve-no-evict-aware", "warmserve-no-proactive"):
            v = r.get(name, {}).get("ttft_under_100ms")
            cells.append(f"{_pct(v)} ({_x(_ratio(v, base))})")
        lines.append(
            f"| {p['overrides']['alpha']:g} | {p['overrides']['total_rps']:g} | {_pct(base)} | "
            + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _per_model(point: dict[str, Any]) -> str:
    r = _rows_by(point)
    systems = [s for s in ("warmserve", "sllm-gpu", "reactive", "muxserve", "prism", "dedicated")
               if s in r]
    models = list(r[systems[0]]["per_model"])
    lines = ["| model | share | " + " | ".join(f"{s} P99" for s in systems) + " |",
             "|" + "---|" * (len(systems) + 2)]
    shares = point["facts"]["shares"]
    for m in models:
        cells = [fmt_seconds(r[s]["per_model"][m]["ttft_p99_s"]) for s in systems]
        lines.append(f"| {m} | {shares[m] * 100:.1f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kinds(kinds: dict[str, int] | None) -> str:
    if not kinds:
        return ""
    return "(" + ", ".join(f"{k} {v}" for k, v in kinds.items()) + ")"


def _diagnostics(points: list[dict[str, Any]]) -> str:
    lines = [
        "| alpha | RPS | system | starts (warm/cold) | median start latency | failed start "
        "attempts (no free GPU group) | GPU-h | prewarm-only GPU-h | lent replicas |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        for r in p["rows"]:
            if r["system"] in ("muxserve", "prism", "dedicated"):
                continue
            lines.append(
                f"| {p['overrides']['alpha']:g} | {p['overrides']['total_rps']:g} | "
                f"{r['system']} | {r['warm_starts']}/{r['cold_starts']} | "
                f"{fmt_seconds(r['start_latency_p50_s'])} | {r['start_failures']} "
                f"{_kinds(r.get('start_failure_kinds'))} | "
                f"{r['gpu_hours']:.2f} | {r['prewarm_gpu_hours']:.2f} | {r['lent_placements']} |"
            )
    return "\n".join(lines)


def _narrative(points: list[dict[str, Any]], sc: Scenario) -> str:
    """Explain the numbers from the simulation's own state (start costs, failed starts)."""
    from warmserve.sim.hardware import load_profile
    from warmserve.sim.perf import EngineModel, ModelArch
    from warmserve.sim.systems import STOCK_VLLM_LOAD_SLOWDOWN

    prof = load_profile(sc.profile)
    st = prof.startup
    e7 = EngineModel(prof, ModelArch.named("llama2-7b"), 1)
    e70 = EngineModel(prof, ModelArch.named("llama2-70b"), 4)
    pool_engine = st.process_start_s + st.import_s + st.device_init_s + st.engine_init_s
    heavy_rps = max(p["overrides"]["total_rps"] for p in points)
    light_rps = min(p["overrides"]["total_rps"] for p in points)

    def hits(rps: float) -> str:
        vals = [
            f"{_pct(_rows_by(p).get('warmserve', {}).get('hit_ratio'))} (alpha "
            f"{p['overrides']['alpha']:g})"
            for p in points if p["overrides"]["total_rps"] == rps
        ]
        return ", ".join(vals)

    cap_lines = []
    for p in points:
        if p["overrides"]["total_rps"] != heavy_rps:
            continue
        r = _rows_by(p)
        kinds: dict[str, int] = {}
        for name in ("warmserve", "warmserve-no-proactive", "sllm-gpu", "reactive"):
            for k, v in (r.get(name, {}).get("start_failure_kinds") or {}).items():
                kinds[k] = kinds.get(k, 0) + v
        total = sum(kinds.values())
        full = kinds.get("full", 0)
        ded = r.get("dedicated", {})
        ws = r.get("warmserve", {})
        cap_lines.append(
            f"at alpha {p['overrides']['alpha']:g}, RPS {heavy_rps:g}, WarmServe's P99 is "
            f"{fmt_seconds(ws.get('ttft_p99_s'))} and the always-on `dedicated` reference's "
            f"{fmt_seconds(ded.get('ttft_p99_s'))}; WarmServe, its no-proactive ablation, "
            f"SLLM-GPU and reactive together made {total} failed start attempts, "
            f"{_pct(full / total if total else None)} of them with fewer free GPUs in the whole "
            f"cluster than the model's TP degree"
        )
    lengths = wl.read_lengths(sc.lengths)
    med_prompt = max(1, int(np.median(lengths[0])))
    p70 = e70.prefill_s(med_prompt)
    p7 = e7.prefill_s(med_prompt)
    pooled_range = _range([
        _ratio(_rows_by(p).get("sllm-gpu-pooled", {}).get("ttft_p99_s"),
               _rows_by(p).get("warmserve", {}).get("ttft_p99_s"))
        for p in points
    ])
    gpu_range = _range([
        _ratio(_rows_by(p).get("warmserve", {}).get("gpu_hours"),
               _rows_by(p).get("dedicated", {}).get("gpu_hours"))
        for p in points
    ])
    spread_lines = []
    for p in points:
        if p["overrides"]["total_rps"] != heavy_rps:
            continue
        r = _rows_by(p)
        per = []
        for name in ("warmserve", "warmserve-no-proactive"):
            k = r.get(name, {}).get("start_failure_kinds") or {}
            per.append(f"`{name}` {k.get('spread', 0) + k.get('fragmented', 0)}")
        spread_lines.append(f"alpha {p['overrides']['alpha']:g}: " + ", ".join(per))
    return f"""\
## Reading the results: where and why we differ from the paper

Everything here is derived from the simulation's own state (start costs of the engine model,
failed start attempts, the diagnostics table below), not from the paper.

1. **What a start costs.**  With the `{prof.name}` profile a start that prewarms nothing
   (stock vLLM) pays process, import and device init ({st.process_start_s + st.import_s
   + st.device_init_s:.1f} s), engine init with CUDA-graph capture ({st.engine_init_s:.2f} s),
   an NCCL group for TP > 1 ({st.comm_group_s:.1f} s), activation ({st.activation_s:.2f} s) and
   the weights at {prof.host_to_gpu_bw / 1e9:.0f} GB/s per GPU ({e7.load_s():.2f} s for a 7B
   shard, {e70.load_s():.2f} s for a 70B shard; `reactive` reads safetensors
   {STOCK_VLLM_LOAD_SLOWDOWN:.1f}x slower).  A WarmServe prewarm hit pays only activation.  A
   WarmServe *miss* also skips the {pool_engine:.1f} s of process and engine stages (they are
   model-agnostic, §7.2) and streams the weights behind the first layer, so for TP-1 models a
   miss costs about as much as a hit: with a {prof.host_to_gpu_bw / 1e9:.0f} GB/s link the
   weights are not what makes starts slow.  SLLM-GPU as we read the paper (§7.1 grants it
   WarmServe's memory switching; §6 presents the process pool and pre-created engines as
   WarmServe's own) pays the {pool_engine:.1f} s even on a cache hit, which is where our
   WarmServe gains over it come from.  `sllm-gpu-pooled`, given the pool, pays only the
   NCCL group (TP > 1) and the un-streamed weights more than WarmServe per start, and its P99
   relative to WarmServe's spans {pooled_range} over the grid: on par, within the allocation
   effects of point 2.  The paper's Figure 8
   attributes a 7.0-7.8x TTFT reduction to resident weights + NCCL group, i.e. a far slower
   weight path than the cited {prof.host_to_gpu_bw / 1e9:.0f} GB/s; that is the main reason
   the gains that come from prewarmed *weights* (hit ratio, proactive prewarming, evict-aware
   placement) barely move our latencies.  The §7.5 metric (share of requests with TTFT under
   100 ms) is then set by prefill time, not by starts: the median prompt
   ({med_prompt} tokens) takes {p7 * 1000:.0f} ms to prefill on a 7B and {p70 * 1000:.0f} ms
   on the 70B (TP 4), so the ablation and window-size tables move by a few percent at most.
2. **Heavy load is a capacity problem here.**  {"; ".join(cap_lines)}.  Under the busiest two
   hours of the trace days, scaled to RPS {heavy_rps:g}, the four models' peaks together can
   need more than the 16 GPUs (at alpha 0.5 the load is spread over all four models, the 13B
   and 70B each needing 2 or 4 GPUs per instance); a model whose next instance has no free
   GPU group waits
   for another model's scale-down, which the autoscaler's hysteresis (scale down only below
   {sc.scale_down_utilization:.0%} utilisation, after {sc.scale_down_delay_s:g} s) delays.
   Which model starves depends on who grabbed the GPUs first, so tail latencies at this load
   differ between systems by allocation order more than by start-up cost.  One systematic
   effect: start attempts that failed although enough GPUs were free in the cluster, just not
   as one allowed group on one node ({"; ".join(spread_lines)}).  Evict-aware placement
   isolates high-score replicas on separate blocks and proactive prewarming keeps a released
   model's weights where its instance ran, so TP-1 instances restart scattered over both nodes
   and a TP-2/TP-4 model can find its GPUs split across nodes.  No
   prewarmed replica helps a model that has nowhere to start.  WarmServe's tails in the paper
   stay low at RPS 25, so its testbed was not saturated at that rate; our arrival shape (the
   busiest two hours of the Azure multimodal week, a different day per model) is burstier than
   the AzureConv days it replayed.
3. **Hit ratio.**  WarmServe hits at RPS {light_rps:g}: {hits(light_rps)}; at RPS
   {heavy_rps:g}: {hits(heavy_rps)}.  Misses at light load are starts the forecast did not
   ask for (Eq. 5-6 request replicas only up to the predicted peak); at heavy load the cluster
   has few idle GPUs to prewarm on and grace lending (Eq. 1) adds only a few replicas (see
   the diagnostics), yet hits stay frequent because a scale-down leaves the model's weights
   resident on its GPUs (§4.1) and the same model often scales up again on them within the
   window.  Hits only help when a GPU group is free at all (point 2).
4. **MuxServe and Prism** (baselines, see docs/simulator.md).  MuxServe colocates models
   statically, all instances created in advance, with its own per-model batch limit (its KV
   quota over an average request, at most 256) and a sharing slowdown that follows which
   co-located models are busy at each step; its TPOT therefore degrades under load, as the
   paper reports.  Prism runs vLLM's default batch of 256, activates a model on the
   lowest-KV-pressure GPUs when its requests find no room, and evicts idle models when memory
   is short.  WarmServe, SLLM-GPU and reactive run the paper's batch of 32 per instance
   (§7.1), so one Prism or MuxServe instance admits up to 8x the requests of one of theirs:
   where Prism's tail TTFT beats WarmServe's at heavy load, that comes from per-instance
   batch (capacity per GPU) rather than from start-up paths, and its TPOT p99 is higher.
   A deployment of warmserve sets `maxBatchSize` per model; this grid keeps the paper's 32.
5. **GPU-hours.**  WarmServe holds {gpu_range} of the GPU-hours of the always-on `dedicated`
   reference over the grid.  The saving depends on how far each model's load falls below its
   peak within the period (the rate is scaled to the same mean whatever `workload.start` is),
   and the autoscaler releases an instance only after utilisation stayed under
   {sc.scale_down_utilization:.0%} for {sc.scale_down_delay_s:g} s; `dedicated` is sized to
   the period's oracle peak, so it is a tight reference.
"""


def _window_table(windows: list[dict[str, Any]]) -> str:
    base = next((w for w in windows if w["overrides"]["window_s"] == 300), None)
    ref = _rows_by(base)["warmserve"]["ttft_under_100ms"] if base else None
    lines = [
        "| window | TTFT < 100 ms | vs 5 min | TTFT P95 | TTFT P99 | hit ratio | starts |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in windows:
        r = _rows_by(w)["warmserve"]
        lines.append(
            f"| {w['overrides']['window_s'] / 60:g} min | {_pct(r['ttft_under_100ms'])} "
            f"| {_x(_ratio(r['ttft_under_100ms'], ref))} | {fmt_seconds(r['ttft_p95_s'])} "
            f"| {fmt_seconds(r['ttft_p99_s'])} | {_pct(r['hit_ratio'])} "
            f"| {r['warm_starts'] + r['cold_starts']} |"
        )
    return "\n".join(lines)


def _code_table(code: list[dict[str, Any]]) -> str:
    lines = [
        "| RPS | WarmServe P95 | WarmServe P99 | SLLM-GPU P99 | P99 gain | no-proactive P99 "
        "| P99 gain (proactive) | MuxServe P99 | MuxServe / WarmServe mean TPOT |",
        "|" + "---|" * 9,
    ]
    for p in code:
        r = _rows_by(p)
        w, s = r.get("warmserve", {}), r.get("sllm-gpu", {})
        n, mx = r.get("warmserve-no-proactive", {}), r.get("muxserve", {})
        lines.append(
            f"| {p['overrides']['total_rps']:g} | {fmt_seconds(w.get('ttft_p95_s'))} "
            f"| {fmt_seconds(w.get('ttft_p99_s'))} | {fmt_seconds(s.get('ttft_p99_s'))} "
            f"| {_x(_ratio(s.get('ttft_p99_s'), w.get('ttft_p99_s')))} "
            f"| {fmt_seconds(n.get('ttft_p99_s'))} "
            f"| {_x(_ratio(n.get('ttft_p99_s'), w.get('ttft_p99_s')))} "
            f"| {fmt_seconds(mx.get('ttft_p99_s'))} "
            f"| {_x(_ratio(mx.get('tpot_mean_s'), w.get('tpot_mean_s')))} |"
        )
    return "\n".join(lines)


def write_markdown(
    path: Path, points: list[dict[str, Any]], sc: Scenario, total_wall: float, cmd: str,
    windows: list[dict[str, Any]] | None = None,
    code: list[dict[str, Any]] | None = None,
) -> None:
    comparison, _ours = _comparison(points)
    heavy = [p for p in points if p["overrides"]["total_rps"] == max(
        q["overrides"]["total_rps"] for q in points)]
    speed_point = next((p for p in heavy if p["overrides"]["alpha"] == 0.5), heavy[0])
    sp_rows = speed_point["rows"]
    sp_req = sum(r["requests"] for r in sp_rows)
    sp_wall = sum(r["wall_s"] for r in sp_rows)
    facts = points[0]["facts"]
    cold = ", ".join(f"{k} {v:.1f} s" for k, v in facts["cold_start_s"].items())
    parts = [
        "# Evaluation: the WarmServe §7.1 testbed in the simulator",
        "",
        f"Generated by `{cmd}` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC "
        f"({platform.processor() or platform.machine()}, Python {platform.python_version()}); "
        f"{len(points)} grid points x {len(points[0]['rows'])} systems in {total_wall:.0f} s "
        "wall.  Do not edit by hand: rerun the command.",
        "",
        f"Setup (`bench/scenarios/paper-testbed.yaml`): {facts['cluster']} GPUs, models "
        f"{', '.join(facts['shares'])} (TP 1, 1, 2, 4; batch 32), {sc.window_s / 60:g}-minute "
        f"windows, {sc.duration_s / 3600:g} h from {facts['start']} (the busiest 2 h of the "
        "models' trace days), arrival shape from the Azure multimodal week (a different day per "
        f"model), lengths from `{sc.lengths}`, predictor `{facts.get('predictor', '?')}` "
        f"with {sc.history_days} days of history, seed "
        f"{sc.seed}.  Cold start (stock vLLM, all stages + all weights): {cold}.",
        "",
        "## Main table: tail TTFT, WarmServe vs SLLM-GPU and MuxServe",
        "",
        "Gain = SLLM-GPU / WarmServe (the paper's \"x reduction\").",
        "",
        _main_table(points),
        "",
        "## Our numbers next to the paper's",
        "",
        comparison,
        "",
        _narrative(points, sc),
        "## Inference performance (TPOT)",
        "",
        "Paper (§7.3, RPS 25, alpha 0.5): over 60% of autoscaling systems' requests have TPOT < "
        "50 ms; over 40% of MuxServe's exceed 100 ms.",
        "",
        _tpot_table(points),
        "",
        "## Ablation (§7.5): requests with TTFT under 100 ms",
        "",
        "Paper: disabling evict-aware placement or proactive prewarming leaves 0.29x and 0.88x "
        "as many requests under 100 ms.",
        "",
        _ablation_table(points),
        "",
    ]
    if code:
        parts += [
            "## AzureCode lengths (§7.3, Figures 14-15), alpha 0.5",
            "",
            "Same arrivals, (input, output) lengths from `azure_code_2023_1h.csv.gz` (longer "
            "prompts, much shorter outputs).  Paper: P99 TTFT 4.23x-34.52x better than "
            "SLLM-GPU and 3.81x-23.34x better than without proactive prewarming; MuxServe's "
            "P99 0.85x WarmServe's at RPS 10 but far higher under heavier load; MuxServe's mean "
            "TPOT 3.26x WarmServe's.",
            "",
            _code_table(code),
            "",
        ]
    if windows:
        parts += [
            f"## Window size (§7.5), WarmServe at alpha {WINDOW_POINT['alpha']:g}, RPS "
            f"{WINDOW_POINT['total_rps']:g}",
            "",
            "Paper: 3- and 40-minute windows serve 0.46x and 0.30x as many requests under "
            "100 ms as 5-minute windows; 10 minutes is comparable (1.02x).",
            "",
            _window_table(windows),
            "",
        ]
    for p in heavy:
        parts += [
            f"## Per model at RPS {p['overrides']['total_rps']:g}, alpha "
            f"{p['overrides']['alpha']:g} (P99 TTFT; paper Figure 10)",
            "",
            _per_model(p),
            "",
        ]
    parts += [
        "## Diagnostics (autoscaling systems)",
        "",
        _diagnostics(points),
        "",
        "## All systems, every grid point",
        "",
    ]
    for p in points:
        parts += [
            f"### alpha {p['overrides']['alpha']:g}, RPS {p['overrides']['total_rps']:g} "
            f"({p['facts']['requests']} requests)",
            "",
            table(p["rows"], markdown=True),
            "",
        ]
    parts += [
        "## Simulator speed",
        "",
        f"alpha {speed_point['overrides']['alpha']:g}, RPS "
        f"{speed_point['overrides']['total_rps']:g}, all {len(sp_rows)} systems: "
        f"{sp_req} simulated requests in {sp_wall:.1f} s of wall time on one core = "
        f"**{sp_req / sp_wall:,.0f} simulated requests per wall second** "
        f"(+ {speed_point['facts']['prep_s']:.1f} s to build the workload and the "
        "predictor's history).",
        "",
        "| system | wall s | requests / wall s | events |",
        "|---|---|---|---|",
        *[
            f"| {r['system']} | {r['wall_s']:.1f} | {r['sim_requests_per_wall_s']:,.0f} "
            f"| {r['events']} |"
            for r in sp_rows
        ],
        "",
    ]
    path.write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(ROOT / "bench/scenarios/paper-testbed.yaml"))
    ap.add_argument("--out", default=str(ROOT / "docs/evaluation.md"))
    ap.add_argument("--json", default=str(ROOT / "bench/results/paper_eval.json"))
    ap.add_argument("--jobs", type=int, default=1, help="grid points run in parallel")
    ap.add_argument("--duration", type=float, help="override duration_s (quick looks)")
    ap.add_argument("--systems", help="comma-separated systems (default: the scenario's)")
    ap.add_argument("--no-window-ablation", action="store_true",
                    help="skip the §7.5 window-size runs")
    ap.add_argument("--no-code", action="store_true",
                    help="skip the AzureCode runs (§7.3, alpha 0.5, every RPS of the grid)")
    ap.add_argument(
        "--from-json", metavar="RESULTS.json",
        help="re-render the markdown from a previous run's JSON instead of simulating",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        sc = load_scenario(saved["scenario"])
        if saved.get("duration_s"):
            sc = sc.with_overrides(duration_s=saved["duration_s"])
        write_markdown(Path(args.out), saved["points"], sc, saved["wall_s"], saved["command"],
                       saved.get("windows", []), saved.get("code", []))
        print(f"wrote {args.out} from {args.from_json}", file=sys.stderr)
        return 0

    from warmserve.sim.systems import parse_systems

    sc = load_scenario(args.scenario)
    systems = parse_systems(args.systems, sc.systems)
    base: dict[str, Any] = {}
    if args.duration:
        base["duration_s"] = args.duration
    grid = [
        {**base, "alpha": float(a), "total_rps": float(r)}
        for a in sc.grid.get("alpha", (sc.alpha,))
        for r in sc.grid.get("total_rps", (sc.total_rps,))
    ]
    t0 = time.perf_counter()
    jobs = [(args.scenario, g, systems) for g in grid]
    code_rps = sc.grid.get("total_rps", (sc.total_rps,))
    n_code = 0
    if not args.no_code:
        code = [{**base, "alpha": 0.5, "total_rps": float(r), "lengths": CODE_LENGTHS}
                for r in code_rps]
        jobs += [(args.scenario, g, systems) for g in code]
        n_code = len(code)
    if "warmserve" in systems and not args.no_window_ablation:
        jobs += [
            (args.scenario, {**base, **WINDOW_POINT, "window_s": float(w)}, ["warmserve"])
            for w in WINDOWS_S
        ]
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(_point, jobs))
    else:
        results = []
        for j in jobs:
            results.append(_point(j))
            print(f"{j[1]}: {results[-1]['wall_s']:.0f} s", file=sys.stderr)
    points = results[: len(grid)]
    code_points = results[len(grid): len(grid) + n_code]
    windows = results[len(grid) + n_code:]
    total = time.perf_counter() - t0
    cmd = "python bench/paper_eval.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])
        if (argv if argv is not None else sys.argv[1:]) else ""
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(
        {"scenario": args.scenario, "systems": systems, "wall_s": total, "command": cmd,
         "duration_s": args.duration,
         "points": [{k: v for k, v in p.items() if k != "raw"} for p in points],
         "windows": [{k: v for k, v in p.items() if k != "raw"} for p in windows],
         "code": [{k: v for k, v in p.items() if k != "raw"} for p in code_points]},
        indent=1, default=float) + "\n")
    scp = sc if not args.duration else sc.with_overrides(duration_s=args.duration)
    write_markdown(Path(args.out), points, scp, total, cmd, windows, code_points)
    print(f"wrote {args.out} and {args.json} in {total:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
