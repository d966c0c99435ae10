"""Simulator speed: one paper-testbed run (default RPS 25, alpha 0.5, 2 h) for every system.

    python bench/sim_speed.py [--scenario bench/scenarios/paper-testbed.yaml] [--rps 25]
                              [--alpha 0.5] [--json bench/results/sim_speed.json]

Prints wall seconds and simulated requests per wall second per system (one process, one core).
The issue's target: all systems of one 2-hour RPS-25 run in under 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from warmserve.sim.runner import prepare, run_system  # noqa: E402
from warmserve.sim.scenario import load_scenario  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(ROOT / "bench/scenarios/paper-testbed.yaml"))
    ap.add_argument("--rps", type=float, default=25.0)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--json", default=str(ROOT / "bench/results/sim_speed.json"))
    args = ap.parse_args(argv)
    sc = load_scenario(args.scenario).with_overrides(total_rps=args.rps, alpha=args.alpha)
    t0 = time.perf_counter()
    prep = prepare(sc)
    prep_s = time.perf_counter() - t0
    n = len(prep.requests)
    rows = []
    print(f"{n} requests, {sc.duration_s / 3600:g} h, prepare {prep_s:.1f} s")
    print(f"{'system':<26}{'wall s':>8}{'req/wall s':>12}{'events':>10}")
    for s in sc.systems:
        out, wall = run_system(prep, s)
        rows.append({"system": s, "wall_s": wall, "requests_per_wall_s": n / wall,
                     "events": out.events})
        print(f"{s:<26}{wall:>8.1f}{n / wall:>12,.0f}{out.events:>10}")
    total = time.perf_counter() - t0
    sim = sum(r["wall_s"] for r in rows)
    print(f"all {len(rows)} systems: {total:.1f} s wall including prepare "
          f"({len(rows) * n / sim:,.0f} simulated requests per wall second)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(
        {"requests": n, "prepare_s": prep_s, "total_s": total, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
