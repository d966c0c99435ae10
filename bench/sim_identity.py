"""Identical results, value by value (issue 12 §5): the compiled simulator against pure Python,
or a branch against main.

    # dump every result of a run: each system's row (warmserve simulate --json's), its starts,
    # its GPU-state timeline and its counters
    python bench/sim_identity.py run bench/scenarios/paper-testbed.yaml --duration 1800 \\
        --out pure.json
    python bench/sim_identity.py run bench/scenarios/paper-testbed.yaml --duration 1800 \\
        --out compiled.json --compiled
    python bench/sim_identity.py run bench/scenarios/scale-1024.yaml --duration 1800 \\
        --start 19:00 --rps 500 --systems warmserve --out scale.json
    # compare two dumps (or two `warmserve simulate --json` files)
    python bench/sim_identity.py compare pure.json compiled.json
    # seconds: two short runs of the testbed into a temp dir, compared
    python bench/sim_identity.py --smoke

``compare`` prints the number of values compared and every difference (type included: 1 and
1.0 differ, as JSON prints them differently); timing facts (wall and CPU seconds) are left out.
It exits 1 if there is any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import astuple, fields
from pathlib import Path
from typing import Any

# --compiled runs this script again from the compiled copy (warmserve.sim.compiled), first on
# PYTHONPATH, ahead of the editable install's source tree
from warmserve.sim.compiled import TIMING_KEYS, CompiledError, compare, run_compiled

ROOT = Path(__file__).resolve().parent.parent
SMOKE_RUN = ["--duration", "120", "--systems", "warmserve,reactive"]


def _hist(h: Any) -> dict[str, Any]:
    return {"n": h.n, "total": h.total, "lo": h.lo, "hi": h.hi,
            "counts": [[i, c] for i, c in enumerate(h.counts) if c]}


def _stats(st: Any) -> dict[str, Any]:
    """A model's online statistics, every histogram bucket included."""
    out = {f.name: getattr(st, f.name) for f in fields(st)
           if f.name not in ("ttft", "tpot", "drops")}  # (compiled: no vars())
    return {**out, "ttft": _hist(st.ttft), "tpot": _hist(st.tpot),
            "drops": dict(sorted(st.drops.items()))}


def dump(args: argparse.Namespace) -> dict[str, Any]:
    from warmserve.sim import metrics
    from warmserve.sim.runner import describe, prepare, run_system
    from warmserve.sim.scenario import load_scenario
    from warmserve.sim.systems import DEFAULT_SYSTEMS, parse_systems

    sc = load_scenario(args.scenario)
    over: dict[str, Any] = {}
    for key, val in (("duration_s", args.duration), ("start", args.start),
                     ("total_rps", args.rps), ("seed", args.seed)):
        if val is not None:
            over[key] = val
    if over:
        sc = sc.with_overrides(**over)
    systems = parse_systems(args.systems, sc.systems or DEFAULT_SYSTEMS)
    prep = prepare(sc)
    names = [m.spec.name for m in prep.models]
    out: dict[str, Any] = {"facts": describe(prep), "systems": {}}
    for s in systems:
        res, wall = run_system(prep, s)
        row = metrics.summarize(res, names, wall)
        out["systems"][s] = {
            "row": row,
            "starts": [list(astuple(r)) for r in res.starts],
            "timeline": [[t, dict(sorted(c.items()))] for t, c in res.timeline],
            "extra": {k: v for k, v in res.extra.items() if k not in TIMING_KEYS},
            "gpu_seconds": res.gpu_seconds,
            "universal_gpu_seconds": res.universal_gpu_seconds,
            "end_s": res.end_s,
            "stats": [_stats(st) for st in res.stats],
        }
        print(f"{s}: {res.requests:,} requests, {len(res.starts):,} starts, "
              f"{res.events:,} events", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="a run of seconds that checks the bench still works: `run` the paper "
                    f"testbed ({' '.join(SMOKE_RUN)}) twice into a temp dir and `compare` the "
                    "dumps (identical, or status 1)")
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="run a scenario and dump every result as JSON")
    r.add_argument("scenario")
    r.add_argument("--out", required=True)
    r.add_argument("--systems", help="systems (default: the scenario's)")
    r.add_argument("--duration", type=float, help="override duration_s")
    r.add_argument("--start", help="override the start time of day (HH:MM)")
    r.add_argument("--rps", type=float, help="override workload.total_rps")
    r.add_argument("--seed", type=int, help="override the seed")
    r.add_argument("--compiled", action="store_true", help="run the compiled simulator")
    c = sub.add_parser("compare", help="compare two dumps value by value")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        return _smoke()
    if args.cmd is None:
        ap.error("a command is required: run or compare (or --smoke)")
    if args.cmd == "run":
        if args.compiled:
            try:
                run_compiled([str(Path(__file__).resolve()), *sys.argv[1:]])
            except CompiledError as e:
                ap.exit(2, f"sim_identity.py: error: {e}\n")
        Path(args.out).write_text(json.dumps(dump(args), sort_keys=True))
        return 0
    n, diffs = compare(json.loads(args.first.read_text()), json.loads(args.second.read_text()))
    for d in diffs[:50]:
        print(d)
    print(f"{args.first} vs {args.second}: {n:,} values compared, {len(diffs)} differences")
    return 1 if diffs else 0


def _smoke() -> int:
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="sim-identity-smoke-"))
    scenario = str(ROOT / "bench/scenarios/paper-testbed.yaml")
    for name in ("first.json", "second.json"):
        if main(["run", scenario, *SMOKE_RUN, "--out", str(tmp / name)]) != 0:
            return 1
    return main(["compare", str(tmp / "first.json"), str(tmp / "second.json")])


if __name__ == "__main__":
    sys.exit(main())
