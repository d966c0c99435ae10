"""Simulator speed (issue 12 §5): simulated requests per second of one core, unsaturated and
saturated, and a 1,024-GPU / 200-model / 24-hour run.

    python bench/sim_speed.py                 # all three parts (the 24 h run takes a while)
    python bench/sim_speed.py --parts unsat,sat
    python bench/sim_speed.py --scale-hours 2 # a shorter scale run
    python bench/sim_speed.py --parts scale --scale-hours 1 --scale-start 19:00 --scale-rps 500
                                              # the busy hour (docs/simulator.md)
    python bench/sim_speed.py --json bench/results/sim_speed.json
    python bench/sim_speed.py --compiled      # the simulator compiled with mypyc (built once
                                              # per source change; docs/simulator.md)
    python bench/sim_speed.py --smoke         # seconds: unsat+sat, 5 min, two systems, temp JSON

Parts:

* ``unsat``: the paper testbed (``bench/scenarios/paper-testbed.yaml``) at alpha 2, RPS 10:
  every start finds GPUs (no failed start), every system.
* ``sat``: alpha 0.5, RPS 25: the cluster is full, thousands of start attempts fail.
* ``scale``: ``bench/scenarios/scale-1024.yaml`` (128 x 8 GPUs, 200 models, 24 h), WarmServe.

``dedicated`` first sizes its layout by simulating each model alone
(:mod:`warmserve.sim.baselines.dedicated`); that sizing is printed apart, not counted in its
requests per second.

The figure that matters is **requests per CPU second** of the simulation (``time.process_time``
of the one process that runs it): it is what one core does, whatever else runs on the machine.
Wall seconds are printed too, with the load average, because the machine this runs on is shared
(on a quiet machine wall ~= CPU).  Preparing a run (drawing the workload and its history:
"prepare") and setting it up (folding the predictor over the history, placing the initial
instances: "set-up CPU s"; the fold is checkpointed, so only a process's first run from a
history pays it) are reported separately from simulating it; the scale run's time includes
both.  Goals (issue 12): >= 20,000 requests/s unsaturated, >= 10,000 saturated (judged on
WarmServe's own rate), the 24-hour 1,024-GPU run within 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from warmserve.sim.runner import prepare, run_system
from warmserve.sim.scenario import load_scenario
from warmserve.testing.smoke import add_smoke_flag, apply_smoke

ROOT = Path(__file__).resolve().parent.parent
# --compiled runs this script again with the compiled copy of warmserve first on PYTHONPATH
# (warmserve.sim.compiled), ahead of the editable install's source tree.
COMPILED = os.environ.get("WARMSERVE_COMPILED")

TESTBED = ROOT / "bench/scenarios/paper-testbed.yaml"
SCALE = ROOT / "bench/scenarios/scale-1024.yaml"
GOALS = {"unsat": 20_000.0, "sat": 10_000.0}
# the scale part is left out: preparing 1,024 GPUs x 200 models alone takes a minute
SMOKE = {"duration": 300.0, "systems": "warmserve,reactive", "parts": "unsat,sat"}


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return "?"


def run_part(name: str, scenario: Path, overrides: dict[str, Any], systems: list[str]) -> dict:
    sc = load_scenario(scenario).with_overrides(**overrides)
    load0 = _load()
    t0, c0 = time.perf_counter(), time.process_time()
    prep = prepare(sc)
    prep_wall, prep_cpu = time.perf_counter() - t0, time.process_time() - c0
    n = prep.n_requests
    print(f"\n== {name}: {sc.name}, {sc.nodes * sc.gpus_per_node} GPUs, {len(sc.models)} models, "
          f"{sc.duration_s / 3600:g} h, {n:,} requests; prepare {prep_cpu:.1f} s CPU "
          f"({prep_wall:.1f} s wall); load average {load0}", flush=True)
    print(f"{'system':<28}{'CPU s':>8}{'wall s':>8}{'req/CPU s':>11}{'req/wall s':>11}"
          f"{'failed starts':>15}{'events':>13}{'set-up CPU s':>14}", flush=True)
    rows = []
    for s in systems:
        out, wall = run_system(prep, s)
        # dedicated's sizing simulates each model alone first, and a run's set-up folds the
        # predictor over days of history (once per process: later runs from the same history
        # reuse its checkpoint) and places the initial instances: not part of simulating
        sizing = float(out.extra.get("layout_cpu_s", 0.0))
        setup = float(out.extra.get("setup_cpu_s", 0.0))
        cpu = float(out.extra["cpu_s"]) - sizing - setup
        row = {"system": s, "cpu_s": cpu, "wall_s": wall, "requests": out.requests,
               "requests_per_cpu_s": out.requests / cpu, "requests_per_wall_s": out.requests / wall,
               "start_failures": out.start_failures, "events": out.events,
               "starts": len(out.starts), "sizing_cpu_s": sizing, "setup_cpu_s": setup}
        rows.append(row)
        print(f"{s:<28}{cpu:>8.1f}{wall:>8.1f}{row['requests_per_cpu_s']:>11,.0f}"
              f"{row['requests_per_wall_s']:>11,.0f}{out.start_failures:>15,}{out.events:>13,}"
              f"{setup:>14.2f}"
              + (f"  (+{sizing:.1f} s CPU sizing the layout)" if sizing else ""),
              flush=True)
    cpu = sum(r["cpu_s"] for r in rows)
    total = sum(r["requests"] for r in rows)
    agg = total / cpu if cpu else 0.0
    print(f"{'all':<28}{cpu:>8.1f}{sum(r['wall_s'] for r in rows):>8.1f}{agg:>11,.0f}"
          f"  (load average now {_load()})", flush=True)
    return {"part": name, "scenario": str(scenario.relative_to(ROOT)), "overrides": overrides,
            "requests": n, "prepare_cpu_s": prep_cpu, "prepare_wall_s": prep_wall,
            "load_before": load0, "load_after": _load(), "rows": rows,
            "requests_per_cpu_s": agg}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="unsat,sat,scale", help="comma list of unsat,sat,scale")
    ap.add_argument("--systems", help="systems of the unsat/sat parts (default: the scenario's)")
    ap.add_argument("--scale-hours", type=float, default=24.0, help="length of the scale run")
    ap.add_argument("--scale-start", help='start of the scale run ("HH:MM"; default: the '
                    "scenario's, 00:00)")
    ap.add_argument("--scale-rps", type=float,
                    help="total_rps of the scale run (default: the scenario's, 400; the busy "
                    "hour 19:00 runs at about 500)")
    ap.add_argument("--duration", type=float,
                    help="duration_s of the unsat/sat parts (default: the scenario's, 2 h)")
    ap.add_argument("--json", help="result file (default: bench/results/sim_speed.json)")
    ap.add_argument("--compiled", action="store_true",
                    help="run the simulator compiled with mypyc (warmserve.sim.compiled: built "
                    "into ~/.cache/warmserve-mypyc once per source change; identical results)")
    add_smoke_flag(ap, SMOKE)
    args = ap.parse_args(argv)
    apply_smoke(args, SMOKE, {"json": str(ROOT / "bench/results/sim_speed.json")})
    if args.compiled:
        from warmserve.sim.compiled import CompiledError, run_compiled

        try:  # builds, then runs this script again from the compiled copy (returns there)
            run_compiled([str(Path(__file__).resolve()), *sys.argv[1:]])
        except CompiledError as e:
            ap.exit(2, f"sim_speed.py: error: {e}\n")
        print(f"compiled simulator: {COMPILED}", flush=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = set(parts) - {"unsat", "sat", "scale"}
    if bad:
        ap.error(f"unknown part(s) {sorted(bad)}")
    systems = (args.systems.split(",") if args.systems
               else list(load_scenario(TESTBED).systems))
    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count(), "compiled": bool(args.compiled),
                           "parts": {}}
    length = {} if args.duration is None else {"duration_s": args.duration}
    if "unsat" in parts:
        out["parts"]["unsat"] = run_part("unsaturated", TESTBED,
                                         {"alpha": 2.0, "total_rps": 10.0, **length}, systems)
    if "sat" in parts:
        out["parts"]["sat"] = run_part("saturated", TESTBED,
                                       {"alpha": 0.5, "total_rps": 25.0, **length}, systems)
    if "scale" in parts:
        hours = args.scale_hours
        t0 = time.perf_counter()
        overrides: dict[str, Any] = {"duration_s": hours * 3600.0}
        if args.scale_start is not None:
            overrides["start"] = args.scale_start
        if args.scale_rps is not None:
            overrides["total_rps"] = args.scale_rps
        res = run_part("scale", SCALE, overrides, ["warmserve"])
        res["end_to_end_wall_s"] = time.perf_counter() - t0
        res["hours"] = hours
        out["parts"]["scale"] = res
    print("\n== goals (one core, requests per CPU second; judged on WarmServe's own rate, the "
          "system the goal is about, and shown for all systems together and the slowest)")
    for key, goal in GOALS.items():
        if key in out["parts"]:
            part = out["parts"][key]
            rows = {r["system"]: r for r in part["rows"]}
            slow = min(part["rows"], key=lambda r: r["requests_per_cpu_s"])
            ws = rows.get("warmserve")
            got = ws["requests_per_cpu_s"] if ws else part["requests_per_cpu_s"]
            part["goal"] = {"goal": goal, "judged": got, "met": got >= goal}
            print(f"{key:<8} warmserve {got:>8,.0f} req/s, all systems "
                  f"{part['requests_per_cpu_s']:>8,.0f}, slowest {slow['system']} "
                  f"{slow['requests_per_cpu_s']:,.0f}; goal >= {goal:,.0f}: "
                  f"{'met' if got >= goal else 'NOT met'}")
    if "scale" in out["parts"]:
        s = out["parts"]["scale"]
        cpu = s["prepare_cpu_s"] + s["rows"][0]["cpu_s"] + s["rows"][0]["setup_cpu_s"]
        print(f"scale    {s['hours']:g} h x 1,024 GPUs: {cpu / 60:.1f} min CPU "
              f"({s['end_to_end_wall_s'] / 60:.1f} min wall) incl. prepare; goal (24 h) "
              f"<= 15 min: {'met' if s['hours'] >= 24 and cpu <= 900 else 'NOT met'}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
