"""``warmserve simulate``: replay a scenario's traffic on a simulated cluster, compare systems.

A thin shell over :mod:`warmserve.sim`: :func:`warmserve.sim.scenario.load_scenario` validates,
:func:`warmserve.sim.runner.run_scenario` runs, :mod:`warmserve.sim.report` formats.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DESCRIPTION = """\
Simulate a GPU cluster serving several LLMs from real traces and compare serving systems:
warmserve (predictive prewarming), its ablations, reactive autoscaling, ServerlessLLM with GPU
caching, MuxServe, Prism and always-on dedicated GPUs.  Every system drives the same requests.

Prints one table: TTFT p50/p95/p99, TPOT p50/p99, prewarm hit ratio, warm and cold starts,
GPU-hours held by instances, requests served and dropped (with reasons).
--json adds the per-model breakdown and run facts; --plot draws TTFT CDFs and GPU-state
timelines.  Example: warmserve simulate bench/scenarios/paper-testbed.yaml --systems
warmserve,reactive.  Scenario format: docs/simulator.md.

Bad scenarios (unknown model, tp larger than a node, missing trace file, negative rates,
unknown fields) print one error line and exit 2.
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay traces on a simulated cluster and compare serving systems",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", metavar="SCENARIO.yaml", help="scenario file (docs/simulator.md)")
    from warmserve.sim.systems import SYSTEMS

    p.add_argument(
        "--systems",
        metavar="A,B,...",
        help="systems to run (default: the scenario's `systems`, else all). Known: "
        + ", ".join(SYSTEMS),
    )
    p.add_argument(
        "--startup",
        metavar="PROFILE",
        help="override cluster.startup: a start-up profile name (paper, fast-path, "
        "measured-<gpu>, measured-cpu) or a profile YAML path (docs/simulator.md)",
    )
    p.add_argument("--json", metavar="OUT.json", help="write rows, per-model breakdown and facts")
    p.add_argument("--plot", metavar="OUT.png", help="TTFT CDFs and GPU-state timelines")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--rps", type=float, help="override workload.total_rps")
    p.add_argument("--alpha", type=float, help="override workload.alpha")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="override duration_s")
    p.add_argument(
        "--progress", action="store_true", help="show progress on stderr even when not a TTY"
    )
    p.add_argument("--start", metavar="HH:MM", help="override the scenario's start time of day")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="run the simulator's hot modules compiled with mypyc (identical results, faster; "
        "built once per source change into ~/.cache/warmserve-mypyc, needs mypy and a C "
        "compiler; docs/simulator.md, Compiled simulator)",
    )
    p.set_defaults(func=run)


class _Progress:
    """One status line on stderr per system: simulated minutes done."""

    def __init__(self, duration_s: float) -> None:
        self.duration = duration_s
        self.t0 = time.perf_counter()

    def __call__(self, system: str, t: float) -> None:
        frac = min(t / self.duration, 1.0) if self.duration else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(
            f"\r{system:<26} [{bar:<30}] {frac * 100:5.1f}%  {time.perf_counter() - self.t0:6.1f}s"
        )
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")


def run(args: argparse.Namespace) -> int:
    if args.compiled:
        from warmserve.cli import CliError
        from warmserve.sim.compiled import CompiledError, run_compiled

        try:  # builds, then runs this command again from the compiled copy (returns there)
            run_compiled(["-m", "warmserve", *args.argv])
        except CompiledError as e:
            raise CliError(str(e)) from None
    from warmserve.sim import report
    from warmserve.sim.runner import run_scenario
    from warmserve.sim.scenario import load_scenario
    from warmserve.sim.systems import DEFAULT_SYSTEMS, parse_systems

    sc = load_scenario(args.scenario)
    overrides: dict[str, Any] = {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.rps is not None:
        overrides["total_rps"] = args.rps
    if args.alpha is not None:
        overrides["alpha"] = args.alpha
    if args.duration is not None:
        overrides["duration_s"] = args.duration
    if args.startup is not None:
        overrides["startup"] = args.startup
    if args.start is not None:
        overrides["start"] = args.start
    if overrides:
        sc = sc.with_overrides(**overrides)
    systems = parse_systems(args.systems, sc.systems or DEFAULT_SYSTEMS)
    show = args.progress or sys.stderr.isatty()
    prog = _Progress(sc.duration_s) if show else None
    result = run_scenario(sc, systems, progress=prog, keep_raw=bool(args.plot))
    if prog is not None:
        prog.done()
    facts = result["facts"]
    rows = result["rows"]
    print(
        f"scenario {facts['scenario']}: {facts['cluster']}, {facts['requests']} requests, "
        f"{facts['total_rps']:g} req/s, alpha {facts['alpha']:g}, "
        f"{facts['duration_s'] / 3600:g} h from {facts['start']} (seed {facts['seed']})"
    )
    print(report.table(rows))
    speed = sum(r["requests"] for r in rows) / max(sum(r["wall_s"] for r in rows), 1e-9)
    print(f"simulated {speed:,.0f} requests per wall second")
    if args.json:
        report.write_json(args.json, {"facts": facts, "rows": rows})
    if args.plot:
        title = f"{facts['scenario']}: {facts['total_rps']:g} req/s, alpha {facts['alpha']:g}"
        report.plot(args.plot, result["raw"], title)
    return 0
