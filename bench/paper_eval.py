"""Run the WarmServe §7.1 testbed grid in the simulator and write ``docs/evaluation.md``.

    python bench/paper_eval.py                      # full grid, both start-up profiles
    python bench/paper_eval.py --jobs 2             # grid points in parallel processes
    python bench/paper_eval.py --duration 600 --out /tmp/eval.md   # a quick look
    python bench/paper_eval.py --from-json bench/results/paper_eval.json   # re-render
    python bench/paper_eval.py --smoke              # seconds: one point, 60 s, to a temp dir

The scenario is ``bench/scenarios/paper-testbed.yaml``; its ``grid`` (alpha x total_rps x
start-up profile) is swept, every point running every system on the same requests.  Systems
whose results cannot depend on the start-up profile (``dedicated``, ``muxserve*``: nothing
starts) run once per point and are shown under every profile.  Results also go to
``bench/results/paper_eval.json``.  Nothing here is tuned to the paper: the physics constants
come from the cited GPU and start-up profiles (``warmserve/sim/profiles``,
``warmserve/sim/startup_profiles``) and the policies are the project's policy modules; the
paper's numbers are printed beside ours for comparison only.  Tables: ``eval_tables.py``
(goals and ablations: ``eval_goals.py``).
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

from eval_tables import render

from warmserve.sim.runner import run_scenario
from warmserve.sim.scenario import load_scenario
from warmserve.sim.systems import get_system, parse_systems
from warmserve.testing.smoke import add_smoke_flag, apply_smoke

ROOT = Path(__file__).resolve().parent.parent

CODE_LENGTHS = "azure_code_2023_1h.csv.gz"  # §7.3 "Evaluation on AzureCode", alpha 0.5
CODE_SYSTEMS = ("warmserve", "warmserve-no-proactive", "sllm-gpu", "muxserve")
WINDOWS_S = (180, 300, 600, 2400)  # §7.5: 3, 5 (default), 10 and 40 minutes
WINDOW_POINT = {"alpha": 0.5, "total_rps": 20.0}  # loaded, below the saturation of RPS 25
PROFILE_FREE_MODES = ("dedicated", "muxserve")  # no start, no weight load: profile-independent
# a reference, not a system: `reactive` with every start free, at every grid point; what is left
# of its tail is queueing for batch slots and GPUs, which no start-up path can remove
REFERENCE = ("reactive", "free-starts")
SMOKE = {"duration": 60.0, "profiles": "paper", "alpha": "2", "rps": "10",
         "no_window_ablation": True}


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return []


def _point(args: tuple[str, dict[str, Any], list[str]]) -> dict[str, Any]:
    path, overrides, systems = args
    sc = load_scenario(path).with_overrides(**overrides)
    t0 = time.perf_counter()
    load = _load()
    res = run_scenario(sc, systems)
    res["wall_s"] = time.perf_counter() - t0
    res["overrides"] = overrides
    res["load"] = [load, _load()]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(ROOT / "bench/scenarios/paper-testbed.yaml"))
    ap.add_argument("--out", help="the page (default: docs/evaluation.md)")
    ap.add_argument("--json", help="the results (default: bench/results/paper_eval.json)")
    ap.add_argument("--jobs", type=int, default=1, help="grid points run in parallel")
    ap.add_argument("--duration", type=float, help="override duration_s (quick looks)")
    ap.add_argument("--systems", help="comma-separated systems (default: the scenario's)")
    ap.add_argument("--profiles", help="comma-separated start-up profiles (default: grid.startup)")
    ap.add_argument("--alpha", help="comma-separated alphas (default: grid.alpha)")
    ap.add_argument("--rps", help="comma-separated total RPS (default: grid.total_rps)")
    ap.add_argument("--no-window-ablation", action="store_true",
                    help="skip the §7.5 window-size runs")
    ap.add_argument("--no-reference", action="store_true",
                    help=f"skip the `{REFERENCE[0]}` runs with every start free "
                         f"(profile `{REFERENCE[1]}`, one per grid point)")
    ap.add_argument("--no-code", action="store_true",
                    help="skip the AzureCode runs (§7.3, alpha 0.5, every RPS of the grid)")
    ap.add_argument(
        "--from-json", metavar="RESULTS.json",
        help="re-render the markdown from a previous run's JSON instead of simulating",
    )
    add_smoke_flag(ap, SMOKE)
    args = ap.parse_args(argv)
    apply_smoke(args, SMOKE, {"out": str(ROOT / "docs/evaluation.md"),
                              "json": str(ROOT / "bench/results/paper_eval.json")})
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        Path(args.out).write_text(render(saved))
        print(f"wrote {args.out} from {args.from_json}", file=sys.stderr)
        return 0

    sc = load_scenario(args.scenario)
    systems = parse_systems(args.systems, sc.systems)
    profiles = (args.profiles.split(",") if args.profiles
                else list(sc.grid.get("startup", (sc.startup,))))
    static = [s for s in systems if get_system(s).mode in PROFILE_FREE_MODES]
    dynamic = [s for s in systems if s not in static]
    base: dict[str, Any] = {}
    if args.duration:
        base["duration_s"] = args.duration
    alphas = args.alpha.split(",") if args.alpha else sc.grid.get("alpha", (sc.alpha,))
    rates = args.rps.split(",") if args.rps else sc.grid.get("total_rps", (sc.total_rps,))
    grid = [{**base, "alpha": float(a), "total_rps": float(r)} for a in alphas for r in rates]
    jobs: list[tuple[str, dict[str, Any], list[str]]] = []
    for g in grid:
        for k, prof in enumerate(profiles):
            mine = dynamic + (static if k == 0 else [])
            jobs.append((args.scenario, {**g, "startup": prof}, mine))
    n_grid = len(jobs)
    main_prof = profiles[0]
    if not args.no_code:
        code_sys = [s for s in CODE_SYSTEMS if s in systems]
        jobs += [(args.scenario, {**base, "alpha": 0.5, "total_rps": float(r),
                                  "lengths": CODE_LENGTHS, "startup": main_prof}, code_sys)
                 for r in rates]
    n_code = len(jobs) - n_grid
    if "warmserve" in systems and not args.no_window_ablation:
        jobs += [(args.scenario, {**base, **WINDOW_POINT, "window_s": float(w),
                                  "startup": main_prof}, ["warmserve"]) for w in WINDOWS_S]
    n_win = len(jobs) - n_grid - n_code
    if REFERENCE[0] in systems and not args.no_reference:
        jobs += [(args.scenario, {**g, "startup": REFERENCE[1]}, [REFERENCE[0]]) for g in grid]
    t0 = time.perf_counter()
    load0 = _load()
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(_point, jobs))
    else:
        results = []
        for j in jobs:
            results.append(_point(j))
            print(f"{j[1]}: {results[-1]['wall_s']:.0f} s", file=sys.stderr)
    total = time.perf_counter() - t0
    points = results[:n_grid]
    # profile-independent systems ran once per point (first profile): show them under each
    by_key = {(p["overrides"]["alpha"], p["overrides"]["total_rps"]): p for p in points
              if p["overrides"]["startup"] == main_prof}
    for p in points:
        if p["overrides"]["startup"] != main_prof:
            first = by_key[(p["overrides"]["alpha"], p["overrides"]["total_rps"])]
            p["rows"] += [dict(r, shared_from=main_prof) for r in first["rows"]
                          if r["system"] in static]
    cmd = "python bench/paper_eval.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])
        if (argv if argv is not None else sys.argv[1:]) else ""
    )
    saved = {
        "scenario": str(Path(args.scenario).resolve().relative_to(ROOT))
        if Path(args.scenario).resolve().is_relative_to(ROOT) else args.scenario,
        "systems": systems, "profiles": profiles, "wall_s": total, "command": cmd,
        "duration_s": args.duration, "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"Python {platform.python_version()}",
        "load": {"start": load0, "end": _load(),
                 "per_job": [r.get("load") for r in results]},
        "points": points,
        "code": results[n_grid:n_grid + n_code],
        "windows": results[n_grid + n_code:n_grid + n_code + n_win],
        "references": results[n_grid + n_code + n_win:],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(saved, indent=1, default=float) + "\n")
    Path(args.out).write_text(render(saved))
    print(f"wrote {args.out} and {args.json} in {total:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
