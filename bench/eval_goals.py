"""Goals and ablations of ``docs/evaluation.md``: the goal table and verdicts per
start-up profile, the free-starts reference column, and which ablation's mechanism acted and
changed anything.  Pure: rows in, markdown lines out; :mod:`eval_tables` assembles the page.
"""

from __future__ import annotations

from typing import Any

from warmserve.sim.report import fmt_seconds

# the evaluation's goals for the `paper` profile on the paper grid (docs/evaluation.md)
GOAL_GAIN, GOAL_HIT, GOAL_VS_DED, GOAL_GPUH = 10.0, 0.90, 2.0, 0.60
CAPACITY_BOUND_S = 5.0  # `dedicated` P99 above this: the point is capacity-bound at its batch

# ablation -> (what it removes, the warmserve counter that says the mechanism acted)
ABLATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "warmserve-no-lending": ("grace-period lending (Eq. 1, §4.1)", ("lent_placements",)),
    "warmserve-no-keep-weights": ("keeping a stopped instance's weights (§4.1)",
                                  ("kept_replica_hits",)),
    "warmserve-no-evict-aware": ("evict-aware placement (Alg. 1, §5.2)",
                                 ("evict_aware_choices",)),
    "warmserve-no-prediction": ("prediction-driven prewarm replicas (§5)", ("prewarms",)),
    "warmserve-no-reclaim": ("reclaim for a starving model", ("reclaim_drains",)),
    "warmserve-no-proactive": ("both halves of §4.1 (the paper's §7.5 ablation)",
                               ("lent_placements", "kept_replica_hits")),
}
# what "the results differ" means: latency, starts, GPU time, and the weight loads made
# (host->GPU traffic: a mechanism that saves loads without moving latency still acted)
COMPARED = ("warm_starts", "cold_starts", "ttft_p99_s", "ttft_p999_s", "ttft_p50_s",
            "ttft_mean_s", "start_delayed_share", "gpu_hours", "prewarm_gpu_hours", "prewarms")


def fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def fmt_pct(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v * 100:.{digits}f}%"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def rows_by(point: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["system"]: r for r in point["rows"]}


def grid_key(p: dict[str, Any]) -> tuple[float, float]:
    return p["overrides"]["alpha"], p["overrides"]["total_rps"]


def row_head(p: dict[str, Any]) -> str:
    a, r = grid_key(p)
    return f"| {a:g} | {r:g} "


def by_profile(points: list[dict[str, Any]], profile: str) -> list[dict[str, Any]]:
    return [p for p in points if p["overrides"].get("startup") == profile]


# ------------------------------------------------------------------------------------ ablations


def ablation_effects(point: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ablation in the point: whether WarmServe's mechanism acted (its counter > 0),
    whether the ablation's results differ from WarmServe's, and the tail ratios."""
    r = rows_by(point)
    w = r.get("warmserve")
    out = []
    if w is None:
        return out
    for name, (what, counters) in ABLATIONS.items():
        a = r.get(name)
        if a is None:
            continue
        acted = sum(int(w.get(c) or 0) for c in counters)
        differs = any(
            (w.get(k) is None) != (a.get(k) is None)
            or (w.get(k) is not None and abs(float(w[k]) - float(a[k])) > 1e-9)
            for k in COMPARED
        )
        out.append({
            "ablation": name, "mechanism": what, "acted": acted, "exercised": acted > 0,
            "differs": differs,
            "p99_ratio": ratio(a.get("ttft_p99_s"), w.get("ttft_p99_s")),
            "p999_ratio": ratio(a.get("ttft_p999_s"), w.get("ttft_p999_s")),
            "delayed": (w.get("start_delayed_share"), a.get("start_delayed_share")),
            "hits": (w.get("hit_ratio"), a.get("hit_ratio")),
            "loads": (w.get("prewarms"), a.get("prewarms")),
            "latency_differs": any(
                abs(float(w.get(k) or 0) - float(a.get(k) or 0)) > 1e-9
                for k in ("ttft_p99_s", "ttft_p999_s", "ttft_mean_s", "start_delayed_share")
            ),
        })
    return out


def ablation_section(points: list[dict[str, Any]]) -> list[str]:
    names = [n for n in ABLATIONS if any(n in rows_by(p) for p in points)]
    head = "| alpha | RPS | " + " | ".join(f"`{n.removeprefix('warmserve-')}`" for n in names)
    lines = [head + " |", "|" + "---|" * (len(names) + 2)]
    # exercised, results differ, points, latency differs
    verdict: dict[str, list[int]] = {n: [0, 0, 0, 0] for n in names}
    for p in points:
        eff = {e["ablation"]: e for e in ablation_effects(p)}
        cells = []
        for n in names:
            e = eff.get(n)
            if e is None:
                cells.append("-")
                continue
            verdict[n][2] += 1
            verdict[n][0] += e["exercised"]
            verdict[n][1] += e["exercised"] and e["differs"]
            verdict[n][3] += e["exercised"] and e["latency_differs"]
            mark = "" if e["exercised"] else " (not exercised)"
            cells.append(f"P99 {fmt_x(e['p99_ratio'])}, P99.9 {fmt_x(e['p999_ratio'])}, delayed "
                         f"{fmt_pct(e['delayed'][1], 2)} vs {fmt_pct(e['delayed'][0], 2)}, loads "
                         f"{e['loads'][1]} vs {e['loads'][0]}{mark}")
        lines.append(row_head(p) + "| " + " | ".join(cells) + " |")
    lines += ["", "| ablation | removes | grid points where WarmServe's mechanism acted | "
              "... and the ablation's results differ | ... and its latencies differ |",
              "|---|---|---|---|---|"]
    for n in names:
        ex, df, tot, lat = verdict[n]
        note = " **never exercised on this grid**" if ex == 0 else ""
        lines.append(f"| `{n}` | {ABLATIONS[n][0]} | {ex} of {tot}{note} | {df} of {ex} | "
                     f"{lat} of {ex} |")
    return lines


# ------------------------------------------------------------------------------------ goals


def goal_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in points:
        r = rows_by(p)
        w, s, d = r.get("warmserve", {}), r.get("sllm-gpu", {}), r.get("dedicated", {})
        out.append({
            "alpha": grid_key(p)[0], "rps": grid_key(p)[1],
            "w_p99": w.get("ttft_p99_s"), "s_p99": s.get("ttft_p99_s"),
            "gain": ratio(s.get("ttft_p99_s"), w.get("ttft_p99_s")),
            "hit": w.get("hit_ratio"),
            "d_p99": d.get("ttft_p99_s"),
            "vs_ded": ratio(w.get("ttft_p99_s"), d.get("ttft_p99_s")),
            "gpuh": ratio(w.get("gpu_hours"), d.get("gpu_hours")),
            "w_gpuh": w.get("gpu_hours"), "d_gpuh": d.get("gpu_hours"),
            "noproactive": ratio(r.get("warmserve-no-proactive", {}).get("ttft_p99_s"),
                                  w.get("ttft_p99_s")),
        })
    return out


def reference_p99(refs: list[dict[str, Any]]) -> dict[tuple[float, float], float | None]:
    """(alpha, RPS) -> P99 of the free-starts reference run (``paper_eval.REFERENCE``)."""
    return {grid_key(p): next((r.get("ttft_p99_s") for r in p["rows"]), None) for p in refs}


def goals_section(points: list[dict[str, Any]],
                   refs: dict[tuple[float, float], float | None] | None = None) -> list[str]:
    g = goal_rows(points)
    refs = refs or {}
    ref_col = bool(refs)
    lines = [
        "| alpha | RPS | WarmServe P99 | SLLM-GPU P99 | P99 gain | hit ratio | dedicated P99 | "
        "WarmServe / dedicated P99 | GPU-h WarmServe / dedicated | no-proactive / WarmServe P99 |"
        + (" reactive P99, every start free |" if ref_col else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if ref_col else ""),
    ]
    for x in g:
        lines.append(
            f"| {x['alpha']:g} | {x['rps']:g} | {fmt_seconds(x['w_p99'])} | "
            f"{fmt_seconds(x['s_p99'])} | {fmt_x(x['gain'])} | {fmt_pct(x['hit'])} | "
            f"{fmt_seconds(x['d_p99'])} | {fmt_x(x['vs_ded'])} | "
            f"{fmt_pct(x['gpuh'])} ({x['w_gpuh'] or 0:.1f} / {x['d_gpuh'] or 0:.1f}) | "
            f"{fmt_x(x['noproactive'])} |"
            + (f" {fmt_seconds(refs.get((x['alpha'], x['rps'])))} |" if ref_col else "")
        )
    top = max((x["rps"] for x in g), default=0)
    heavy = [x for x in g if x["rps"] == top]

    def ok(cond: bool) -> str:
        return "**met**" if cond else "**not met**"

    gains = [x["gain"] for x in heavy]
    hits = [x["hit"] for x in heavy]
    vs = [x["vs_ded"] for x in g]
    gh = [x["gpuh"] for x in g]
    npro = [x["noproactive"] for x in g if x["noproactive"] is not None]
    lines += [
        "",
        f"* P99 >= {GOAL_GAIN:g}x better than SLLM-GPU at RPS {top:g}, both alpha: "
        + ", ".join(f"{fmt_x(v)} (alpha {x['alpha']:g})" for v, x in zip(gains, heavy, strict=True))
        + f" -> {ok(all(v is not None and v >= GOAL_GAIN for v in gains))}",
        f"* prewarm hit ratio >= {GOAL_HIT:.0%} at RPS {top:g}: "
        + ", ".join(f"{fmt_pct(v)} (alpha {x['alpha']:g})"
                    for v, x in zip(hits, heavy, strict=True))
        + f" -> {ok(all(v is not None and v >= GOAL_HIT for v in hits))}",
        f"* P99 within {GOAL_VS_DED:g}x of `dedicated` at every point: "
        f"{sum(1 for v in vs if v is not None and v <= GOAL_VS_DED)} of {len(vs)} points -> "
        f"{ok(all(v is not None and v <= GOAL_VS_DED for v in vs))}",
        f"* ... while using <= {GOAL_GPUH:.0%} of its GPU-hours: "
        f"{sum(1 for v in gh if v is not None and v <= GOAL_GPUH)} of {len(gh)} points "
        f"(range {fmt_pct(min(gh, default=None))}-{fmt_pct(max(gh, default=None))}) -> "
        f"{ok(all(v is not None and v <= GOAL_GPUH for v in gh))}",
        f"* proactive ablation measurably worse somewhere (P99 ratio > 1.05): "
        f"{sum(1 for v in npro if v > 1.05)} of {len(npro)} points, largest "
        f"{fmt_x(max(npro, default=None))} -> {ok(any(v > 1.05 for v in npro))}",
    ]
    # where even the best static allocation queues, capacity at the batch, not start-up, sets
    # the tail: say so, with what a larger batch (Prism's own 256) does at the same points
    bound = []
    for p in points:
        r = rows_by(p)
        d = r.get("dedicated", {}).get("ttft_p99_s")
        if d is not None and d > CAPACITY_BOUND_S:
            big = r.get("prism-256", {}).get("ttft_p99_s")
            free = refs.get(grid_key(p))
            bound.append(f"alpha {grid_key(p)[0]:g} RPS {grid_key(p)[1]:g} (`dedicated` "
                         f"{fmt_seconds(d)}, `prism-256` {fmt_seconds(big)}"
                         + (f", `reactive` with every start free {fmt_seconds(free)}, "
                            "SLLM-GPU / that "
                            f"{fmt_x(ratio(r.get('sllm-gpu', {}).get('ttft_p99_s'), free))}"
                            if free else "") + ")")
    if bound:
        lines += [
            f"* capacity-bound points at this batch (the best static allocation, which never "
            f"starts anything, has a P99 > {CAPACITY_BOUND_S:g} s: the tail is queueing for "
            f"batch slots, not start-up cost; Prism at batch 256 beside it): "
            + "; ".join(bound) + "."
        ]
    return lines
