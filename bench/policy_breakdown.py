"""Why WarmServe's starts miss a prewarm replica, and where its GPU-hours go (issue 12 §6).

Runs one system (default ``warmserve``) on grid points of a scenario with read-only probes on
the simulator and prints, per point:

* **misses by cause**, classified at the moment of each cold start from the simulator's own
  state: ``no-replica/unplaced`` (the last plan wanted a replica of the model it could not place),
  ``no-replica/used-up`` (every replica the plan asked for was already turned into an instance:
  more starts than N_basic + N_burst), ``no-replica/evicted`` (the plan placed more than are
  resident now: another start or placement took them), ``replica-busy`` (a replica exists but
  its GPUs are held by an instance, e.g. the grace instance that lent it memory);
* **GPU-hours by phase**: starting (start issued until serving), serving, grace (drained until
  its GPUs are free), and *needed*: the GPUs the model's requests in flight need at batch B,
  ``tp · ceil(in flight / B)``, integrated over time — a lower bound on what any autoscaler
  that serves every request in a batch slot at once must hold.

    python bench/policy_breakdown.py [--scenario S] [--profiles paper fast-path]
        [--alpha 0.5 2] [--rps 10 15 20 25] [--system warmserve] [--json out.json]
    python bench/policy_breakdown.py --smoke     # seconds: one point, 60 s, JSON to a temp dir

Probes only observe (they wrap methods and call the originals); results are identical to an
unprobed run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

from warmserve.sim import core, executor, runner
from warmserve.sim.cluster import STOPPED
from warmserve.sim.metrics import summarize
from warmserve.sim.scenario import load_scenario
from warmserve.testing.smoke import add_smoke_flag, apply_smoke

ROOT = Path(__file__).resolve().parents[1]
SMOKE = {"alpha": [2.0], "rps": [10.0], "set": ["duration_s=60"]}


class Probe:
    def __init__(self) -> None:
        self.sim = None
        self.misses: Counter[str] = Counter()
        self.hits = 0
        self.phase_s: Counter[str] = Counter()
        self.need_s = 0.0
        self.inflight_t: dict[int, tuple[float, int]] = {}
        self.spans: dict[int, list[float]] = {}
        self.detail: list[tuple] = []
        self.latency: dict[str, list[float]] = {"hit": [], "miss": []}

    # -------------------------------------------------------------- misses
    def classify(self, ex: executor.ControlExecutor, d) -> str:  # type: ignore[no-untyped-def]
        sim = ex.sim
        reps = [r for r in sim.cl.replicas if r.model == d.model]
        if reps:
            busy = all(any((r.node, g) in sim.cl.holder for g in r.gpus) for r in reps)
            return "replica-busy" if busy else "replica-free(same-instant)"
        plan = ex.ctl.last_plan
        if plan is None:
            return "no-replica/no-plan"
        if any(u.model == d.model for u in plan.unplaced):
            return "no-replica/unplaced"
        planned = sum(1 for r in (*plan.keep, *plan.place) if r.model == d.model)
        fc = ex.ctl.forecast_of(d.model)
        m = sim.by_name[d.model]
        active = sum(1 for i in sim.by_model[m.idx] if i.phase in ("starting", "serving"))
        self.detail.append((round(sim.t_now, 1), d.model, planned, active,
                            round(fc.avg, 1) if fc else None,
                            round(fc.peak, 1) if fc else None, sim.inflight[m.idx]))
        return "no-replica/used-up" if planned == 0 else "no-replica/evicted-or-used"

    # -------------------------------------------------------------- GPU time
    def close(self, duration: float) -> None:
        for t0, ready, grace, stop, gpus in self.spans.values():
            stop = min(stop, duration)
            ready = min(ready, stop)
            grace = min(grace, stop)
            self.phase_s["starting"] += gpus * max(ready - t0, 0)
            self.phase_s["serving"] += gpus * max(grace - ready, 0)
            self.phase_s["grace"] += gpus * max(stop - grace, 0)


def install(probe: Probe) -> None:
    orig_start = executor.ControlExecutor._start
    orig_term = core.Simulation.terminate
    orig_new = core.Simulation.new_instance
    orig_inflight = core.Simulation._set_inflight
    orig_drain = executor.ControlExecutor._drain
    orig_ready = core.Simulation._ready

    def _start(self, d, t, prewarmed=False):  # type: ignore[no-untyped-def]
        if not prewarmed:
            if d.hit:
                probe.hits += 1
            else:
                probe.misses[probe.classify(self, d)] += 1
        n = len(self.sim.starts)
        orig_start(self, d, t, prewarmed)
        if len(self.sim.starts) > n:
            rec = self.sim.starts[-1]
            probe.latency["hit" if rec.hit else "miss"].append(rec.latency_s)

    def new_instance(self, m, node, gpus, t, ready, full, hit):  # type: ignore[no-untyped-def]
        inst = orig_new(self, m, node, gpus, t, ready, full, hit)
        probe.sim = self
        probe.spans[inst.iid] = [t, math.inf, math.inf, math.inf, len(gpus)]
        return inst

    def _ready(self, inst, t):  # type: ignore[no-untyped-def]
        s = probe.spans.get(inst.iid)
        if s is not None and inst.phase == "starting":
            s[1] = t
        return orig_ready(self, inst, t)

    def _drain(self, d, t):  # type: ignore[no-untyped-def]
        inst = self._find(d.instance_id)
        orig_drain(self, d, t)
        if inst is not None and inst.phase == "grace":
            probe.spans[inst.iid][2] = t

    def terminate(self, inst, t):  # type: ignore[no-untyped-def]
        s = probe.spans.get(inst.iid)
        if s is not None and inst.phase != STOPPED:
            s[3] = t
            s[1] = min(s[1], t)
        return orig_term(self, inst, t)

    def _set_inflight(self, midx, t, delta):  # type: ignore[no-untyped-def]
        prev_t, prev_n = probe.inflight_t.get(midx, (0.0, 0))
        m = self.models[midx]
        tt = min(t, self.duration)
        if tt > prev_t:
            probe.need_s += m.spec.tp * math.ceil(prev_n / m.spec.max_batch) * (tt - prev_t)
        orig_inflight(self, midx, t, delta)
        probe.inflight_t[midx] = (max(prev_t, tt), self.inflight[midx])

    executor.ControlExecutor._start = _start  # type: ignore[method-assign]
    core.Simulation.new_instance = new_instance  # type: ignore[method-assign]
    core.Simulation._ready = _ready  # type: ignore[method-assign]
    executor.ControlExecutor._drain = _drain  # type: ignore[method-assign]
    core.Simulation.terminate = terminate  # type: ignore[method-assign]
    core.Simulation._set_inflight = _set_inflight  # type: ignore[method-assign]


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "bench/scenarios/paper-testbed.yaml"))
    ap.add_argument("--system", default="warmserve")
    ap.add_argument("--profiles", nargs="+", default=["paper"])
    ap.add_argument("--alpha", nargs="+", type=float, default=[0.5, 2.0])
    ap.add_argument("--rps", nargs="+", type=float, default=[10, 15, 20, 25])
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="scenario field overrides (numbers), e.g. scale_down_utilization=0.7")
    add_smoke_flag(ap, SMOKE)
    args = ap.parse_args()
    apply_smoke(args, SMOKE, {"json": "policy_breakdown.json"} if args.smoke else None)
    base = load_scenario(args.scenario)
    if args.set:
        base = base.with_overrides(
            **{k: _number(v) for k, v in (x.split("=", 1) for x in args.set)}
        )
    probe = Probe()  # the wrappers close over it; reset before each run
    install(probe)
    rows = []
    print("| profile | alpha | RPS | P99 | P99.9 | delayed | hit | misses by cause | GPU-h "
          "| starting | serving | grace | needed (tp·ceil(L/B)) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for prof in args.profiles:
        for a in args.alpha:
            for rps in args.rps:
                sc = base.with_overrides(alpha=a, total_rps=rps, startup=prof)
                probe.__init__()  # type: ignore[misc]
                prep = runner.prepare(sc)
                out, wall = runner.run_system(prep, args.system)
                probe.close(sc.duration_s)
                s = summarize(out, [m.spec.name for m in prep.models])
                row = {
                    "profile": prof, "alpha": a, "rps": rps, "system": args.system,
                    "p99": s["ttft_p99_s"], "p999": s["ttft_p999_s"],
                    "delayed": s["start_delayed_share"], "hit_ratio": s["hit_ratio"],
                    "gpu_h": s["gpu_hours"], "wall_s": wall,
                    **{f"{k}_h": v / 3600.0 for k, v in probe.phase_s.items()},
                    "needed_h": probe.need_s / 3600.0, "hits": probe.hits,
                    "miss_causes": dict(probe.misses), "no_replica_misses": probe.detail,
                    "start_latency_mean_s": {
                        k: (sum(v) / len(v) if v else None) for k, v in probe.latency.items()
                    },
                    "start_latency_max_s": {
                        k: max(v, default=None) for k, v in probe.latency.items()
                    },
                    "per_model_p99": {
                        k: v["ttft_p99_s"] for k, v in s["per_model"].items()
                    },
                    "per_model_starts": {
                        k: (v["warm_starts"], v["cold_starts"]) for k, v in s["per_model"].items()
                    },
                }
                rows.append(row)
                causes = ", ".join(f"{k} {v}" for k, v in sorted(probe.misses.items()))
                starts = probe.hits + sum(probe.misses.values())
                print(
                    f"| {prof} | {a:g} | {rps:g} | {row['p99']:.2f} s | {row['p999']:.2f} s | "
                    f"{(row['delayed'] or 0):.2%} | {(row['hit_ratio'] or 0):.0%} "
                    f"({probe.hits}/{starts}) | {causes} | {row['gpu_h']:.1f} | "
                    + " | ".join(f"{probe.phase_s[k] / 3600:.1f}"
                                 for k in ("starting", "serving", "grace"))
                    + f" | {row['needed_h']:.1f} |",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
