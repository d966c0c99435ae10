"""``warmserve plan``: a cluster snapshot in, the prewarm plan out (WarmServe §5.2, Algorithm 1).

The command is a thin shell: :func:`warmserve.cluster_snapshot.load_cluster_state` validates the
file, :func:`warmserve.policy.evict_aware_placement.plan_prewarm` decides, and this module only
formats.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from warmserve.textfmt import columns

DESCRIPTION = """\
Read a cluster scenario (JSON) and print the prewarm plan: which resident replicas to keep,
which new replicas to load where (evict-aware placement, WarmServe Algorithm 1), which to evict,
and which requested replicas found no room (with the reason).

Scenario schema (unknown fields are errors; ? = optional, defaults in parentheses):
  nodes:     [{name, gpus: [{id, memory: SIZE, free?: SIZE,
                             state? (idle)|universal|dedicated|grace}]}]
  models:    [{name, weight: SIZE, tp? (1), max_batch? (32), cold_start_s, avg_load, peak_load,
               active_instances?, num_layers? (32), prewarm_layers?}]
  replicas?: [{model, node, gpus: [id...], kind?, rank?, score?, bytes_per_gpu?: SIZE,
               layers_resident?}]                      (resident prewarm replicas)
  instances?:[{model, node, gpus: [id...], name?, phase? (serving)|starting|grace, running? (0),
               kv_capacity?: SIZE, kv_used?: SIZE}]    (running instances)
  description?: str

SIZE is an integer number of bytes or a string with a unit: decimal KB/MB/GB/TB ("12.55GB")
or binary KiB/MiB/GiB/TiB ("80GiB").
GPU free defaults: idle/universal = memory minus resident replicas; dedicated = 0; grace = the
grace instance's lendable KV memory per GPU (Eq. 1) minus replicas already there.
Active instances K (Eq. 5-6) are counted from `instances` (phase other than grace);
`active_instances`, if given, must match that count.
Loads are requests in flight (avg and peak predicted for the next window).

Bad input (missing file, invalid JSON, unknown field, negative size, a tp no node can hold,
GPU ids that do not exist, duplicate names) prints one error line and exits 2.
Full description: docs/policy.md.  Example: warmserve/data/examples/cluster.json
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan prewarm replicas for a cluster snapshot (evict-aware placement)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario", metavar="SCENARIO.json", help="cluster snapshot (schema above)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--no-evict-aware",
        dest="evict_aware",
        action="store_false",
        help="ablation of §7.5: first-fit placement without the nesting rule or scores",
    )
    p.add_argument(
        "--start",
        metavar="MODEL",
        action="append",
        default=[],
        help="also report where one more instance of MODEL would start on the snapshot "
        "(prewarm hit or cold start); repeatable",
    )
    p.set_defaults(func=run)


def _replica_row(r: Any, action: str) -> dict[str, Any]:
    return {
        "action": action,
        "model": r.model,
        "kind": r.kind.value,
        "rank": r.rank,
        "score": round(r.score, 6),
        "node": r.node,
        "gpus": list(r.gpus),
        "bytes_per_gpu": r.bytes_per_gpu,
    }


def plan_document(state: Any, plan: Any, *, evict_aware: bool, starts: list[Any]) -> dict[str, Any]:
    """The JSON document ``warmserve plan --json`` prints."""
    from warmserve.policy.start_choice import NoCapacity

    doc: dict[str, Any] = {
        "evict_aware": evict_aware,
        "summary": {
            "gpus": state.total_gpus,
            "models": len(state.models),
            "requested": plan.requested,
            "kept": len(plan.keep),
            "placed": len(plan.place),
            "evicted": len(plan.evict),
            "unplaced": len(plan.unplaced),
        },
        "replicas": [_replica_row(r, "keep") for r in plan.keep]
        + [_replica_row(r, "place") for r in plan.place],
        "evict": [_replica_row(r, "evict") for r in plan.evict],
        "unplaced": [
            {
                "model": u.model,
                "kind": u.kind.value,
                "rank": u.rank,
                "score": round(u.score, 6),
                "reason": u.reason,
            }
            for u in plan.unplaced
        ],
    }
    if starts:
        rows = []
        for c in starts:
            if isinstance(c, NoCapacity):
                rows.append({"model": c.model, "start": "no-capacity", "reason": c.reason})
            else:
                rows.append(
                    {
                        "model": c.model,
                        "start": "hit" if c.hit else "cold",
                        "node": c.node,
                        "gpus": list(c.gpus),
                        "evicts": [f"{r.model}/{r.kind.value}/{r.rank}" for r in c.evicts],
                        "evicted_score": round(c.evicted_score, 6),
                    }
                )
        doc["starts"] = rows
    return doc



def render_text(doc: dict[str, Any], source: str) -> str:
    """The readable table ``warmserve plan`` prints without ``--json``."""
    s = doc["summary"]
    mode = "evict-aware" if doc["evict_aware"] else "first-fit ablation"
    lines = [
        f"prewarm plan for {source} ({mode}): {s['gpus']} GPUs, {s['models']} models, "
        f"{s['requested']} replicas requested: {s['kept']} kept, {s['placed']} placed, "
        f"{s['evicted']} evicted, {s['unplaced']} unplaced",
        "",
    ]
    rows = [["ACTION", "MODEL", "KIND", "RANK", "SCORE", "NODE", "GPUS", "REASON"]]
    for r in [*doc["replicas"], *doc["evict"]]:
        gpus = ",".join(str(g) for g in r["gpus"])
        rows.append(
            [r["action"], r["model"], r["kind"], str(r["rank"]), f"{r['score']:.3f}", r["node"],
             gpus, ""]
        )
    for u in doc["unplaced"]:
        rows.append(
            ["unplaced", u["model"], u["kind"], str(u["rank"]), f"{u['score']:.3f}", "-", "-",
             u["reason"]]
        )
    lines.append(columns(rows) if len(rows) > 1 else "(no replicas requested)")
    if "starts" in doc:
        lines += ["", "instance start choice:"]
        for st in doc["starts"]:
            if st["start"] == "no-capacity":
                lines.append(f"  {st['model']}: no capacity: {st['reason']}")
            else:
                ev = ", ".join(st["evicts"]) or "nothing"
                lines.append(
                    f"  {st['model']}: {st['start']} on {st['node']} GPUs "
                    f"{','.join(str(g) for g in st['gpus'])}; evicts {ev} "
                    f"(score {st['evicted_score']:.3f})"
                )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from warmserve.cluster_snapshot import load_cluster_state
    from warmserve.policy.evict_aware_placement import plan_prewarm
    from warmserve.policy.start_choice import choose_start

    state = load_cluster_state(args.scenario)
    plan = plan_prewarm(state, evict_aware=args.evict_aware)
    starts = [choose_start(state, m) for m in args.start]
    doc = plan_document(state, plan, evict_aware=args.evict_aware, starts=starts)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_text(doc, args.scenario))
    return 0
