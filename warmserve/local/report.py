"""The report of a ``warmserve up`` replay: a summary table, ``report.md`` with PNG plots, and
the raw data (``requests.jsonl``, ``samples.json``, ``summary.json``) in the run's directory.

Plots: the TTFT CDF measured at the client through the gateway (one line per system), demand
vs prediction per model (the trace's load per window, the operator's forecast and its
observation), GPU worker states over time, and prewarm hits vs cold starts per model.  With
``--compare reactive`` every plot shows both systems on the same replay.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .observe import GPU_STATES, ModelSample, NodeSample
from .replay import Result
from .summary import Row, fmt_ratio, fmt_s, gpu_seconds, rows
from .workload import ReplayPlan


@dataclass
class RunData:
    label: str  # "warmserve" or "reactive"
    plan: ReplayPlan
    results: list[Result]
    models: list[ModelSample]
    nodes: list[NodeSample]
    t0_unix: float  # wall-clock time of the measured start
    interrupted: bool = False

    def rows(self) -> list[Row]:
        return rows(self.plan.models, self.results, self.models)


def table(runs: Sequence[RunData]) -> list[list[str]]:
    out = [
        [
            "system",
            "model",
            "requests ok/capped/dropped",
            "TTFT p50",
            "p90",
            "p99",
            "prewarm hits",
            "cold starts",
            "hit ratio",
        ]
    ]
    for run in runs:
        for r in run.rows():
            out.append(
                [
                    run.label,
                    r.model,
                    f"{r.ok}/{r.capped}/{r.dropped}",
                    fmt_s(r.p50),
                    fmt_s(r.p90),
                    fmt_s(r.p99),
                    str(r.hits),
                    str(r.cold),
                    fmt_ratio(r.hit_ratio),
                ]
            )
    return out


def headline(runs: Sequence[RunData]) -> str:
    cut = [f"{r.label} interrupted" for r in runs if r.interrupted]
    note = f" ({', '.join(cut)}: open requests cancelled)" if cut else ""
    return _headline(runs) + note


def _headline(runs: Sequence[RunData]) -> str:
    tot = {run.label: run.rows()[-1] for run in runs}
    if "warmserve" in tot and "reactive" in tot:
        w, r = tot["warmserve"], tot["reactive"]
        ratio = f" ({r.p99 / w.p99:.1f}x lower)" if w.p99 and r.p99 and w.p99 > 0 else ""
        return (
            f"gateway TTFT p99 on the same replay: warmserve {fmt_s(w.p99)} vs reactive "
            f"{fmt_s(r.p99)}{ratio}; prewarm hits {w.hits}/{w.hits + w.cold} vs "
            f"{r.hits}/{r.hits + r.cold}"
        )
    (label, t), *_ = tot.items()
    return (
        f"{label}: gateway TTFT p50 {fmt_s(t.p50)}, p99 {fmt_s(t.p99)}; {t.ok} ok, "
        f"{t.capped} capped, {t.dropped} dropped; prewarm hits {t.hits}, cold starts {t.cold}"
    )


def _md_table(rows_: list[list[str]]) -> str:
    head, *body = rows_
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------------------

_COLORS = {"warmserve": "tab:blue", "reactive": "tab:red"}


def _plot_ttft(runs: Sequence[RunData], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        v = np.sort([x for r in run.rows()[-1:] for x in r.ttft])
        if v.size:
            ax.step(
                v,
                np.arange(1, v.size + 1) / v.size,
                where="post",
                color=_COLORS.get(run.label),
                label=f"{run.label} (n={v.size})",
            )
    ax.set_xscale("log")
    ax.set_xlabel("time to first token at the client, through the gateway (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("TTFT CDF (measured period, answered requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _windows(run: RunData, model: str) -> dict[str, list[tuple[float, float]]]:
    """Per window start (s from the measured start): forecast and observation, from samples."""
    w = run.plan.window_s
    pred: dict[float, tuple[float, float]] = {}
    obs: dict[float, tuple[float, float]] = {}
    for s in run.models:
        if s.model != model or s.window_start is None:
            continue
        start = round((s.window_start - run.t0_unix) / w) * w
        if s.pred_avg is not None:
            pred[start] = (s.pred_avg, s.pred_peak or s.pred_avg)
        if s.obs_avg is not None:  # observed = the window before the current one
            obs[start - w] = (s.obs_avg, s.obs_peak or s.obs_avg)
    return {
        "pred": sorted((k, *v) for k, v in pred.items()),
        "obs": sorted((k, *v) for k, v in obs.items()),
    }  # type: ignore[misc]


def _plot_demand(runs: Sequence[RunData], path: Path) -> None:
    import matplotlib.pyplot as plt

    plan = runs[0].plan
    n = len(plan.models)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.3 * n), sharex=True, squeeze=False)
    w = plan.window_s
    for ax, model in zip(axes[:, 0], plan.models, strict=True):
        avg, _ = plan.planned[model]
        x0 = -plan.warmup_s
        xs = [x0 + i * w for i in range(len(avg))]
        ax.step(
            [*xs, xs[-1] + w] if xs else [],
            avg + avg[-1:] if avg else [],
            where="post",
            color="black",
            lw=2.2,
            label="trace load (avg in flight)",
        )
        for run in runs:
            win = _windows(run, model)
            c = _COLORS.get(run.label)
            if win["obs"]:
                ox, oa, _op = zip(*win["obs"], strict=True)
                ax.step(
                    list(ox),
                    list(oa),
                    where="post",
                    color=c,
                    lw=1.2,
                    ls="-",
                    label=f"{run.label}: observed avg",
                )
            if win["pred"] and run.label == "warmserve":
                px, pa, pp = zip(*win["pred"], strict=True)
                for ys, ls, lw, what in ((pa, "--", 1.4, "avg"), (pp, ":", 0.9, "peak")):
                    ax.step(
                        list(px),
                        list(ys),
                        where="post",
                        color="tab:green",
                        lw=lw,
                        ls=ls,
                        label=f"forecast {what}",
                    )
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_ylabel("in flight")
        ax.set_title(model, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=3, loc="upper left")
    axes[-1, 0].set_xlabel(
        f"wall-clock s from the measured start (window {w:g} s = "
        f"{plan.window_s * plan.speed / 60:g} trace min; left of 0: warm-up)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_gpus(runs: Sequence[RunData], path: Path) -> None:
    import matplotlib.pyplot as plt

    colors = {"idle": "#cccccc", "universal": "tab:cyan", "dedicated": "tab:green", "grace": "gold"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        by_t: dict[float, dict[str, int]] = {}
        for s in run.nodes:  # one sample per node per poll, all with the poll's time
            acc = by_t.setdefault(s.t, dict.fromkeys(GPU_STATES, 0))
            for k, v in s.counts().items():
                acc[k] += v
        ts = sorted(by_t)
        if ts:
            ax.stackplot(
                ts,
                [[by_t[t][k] for t in ts] for k in GPU_STATES],
                labels=GPU_STATES,
                colors=[colors[k] for k in GPU_STATES],
                step="post",
            )
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_ylabel("GPUs")
        ax.set_title(f"{run.label}: GPU worker states", fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper left", ncol=4)
    axes[-1, 0].set_xlabel("wall-clock s from the measured start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hits(runs: Sequence[RunData], path: Path) -> None:
    import matplotlib.pyplot as plt

    models = list(runs[0].plan.models)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(runs)
    x = np.arange(len(models))
    for k, run in enumerate(runs):
        rs = {r.model: r for r in run.rows()}
        hits = [rs[m].hits for m in models]
        cold = [rs[m].cold for m in models]
        pos = x + (k - (len(runs) - 1) / 2) * width
        ax.bar(
            pos,
            hits,
            width * 0.95,
            color="tab:blue" if run.label == "warmserve" else "tab:purple",
            label=f"{run.label}: prewarm hits",
        )
        ax.bar(
            pos,
            cold,
            width * 0.95,
            bottom=hits,
            color="tab:orange" if k == 0 else "tab:red",
            label=f"{run.label}: cold starts",
        )
    ax.set_xticks(x, models, fontsize=8)
    ax.set_ylabel("instances started")
    ax.set_title("instance starts in the measured period: prewarm hits vs cold starts", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(runs: Sequence[RunData], out: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Write everything under ``out``; returns summary.json's content."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    for run in runs:
        with open(out / f"requests-{run.label}.jsonl", "w") as f:
            for r in run.results:
                f.write(json.dumps(r.to_json()) + "\n")
        (out / f"samples-{run.label}.json").write_text(
            json.dumps(
                {"models": [asdict(s) for s in run.models], "nodes": [asdict(s) for s in run.nodes]}
            )
        )
    plots = {
        "ttft_cdf": out / "ttft_cdf.png",
        "demand_vs_prediction": out / "demand_vs_prediction.png",
        "gpu_states": out / "gpu_states.png",
        "prewarm_hits": out / "prewarm_hits.png",
    }
    _plot_ttft(runs, plots["ttft_cdf"])
    _plot_demand(runs, plots["demand_vs_prediction"])
    _plot_gpus(runs, plots["gpu_states"])
    _plot_hits(runs, plots["prewarm_hits"])
    summary = {
        "headline": headline(runs),
        "info": info,
        "runs": {
            run.label: {
                "interrupted": run.interrupted,
                "rows": [r.to_json() for r in run.rows()],
                "gpu_seconds": gpu_seconds(run.nodes),
            }
            for run in runs
        },
        "plots": {k: str(v) for k, v in plots.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plan = runs[0].plan
    gpu = "\n".join(
        f"| {run.label} | " + " | ".join(f"{v:.0f}" for v in gpu_seconds(run.nodes).values()) + " |"
        for run in runs
    )
    md = [
        "# warmserve up — replay report",
        "",
        f"**{headline(runs)}**",
        "",
        f"- trace: {plan.description}",
        f"- speed {plan.speed:g}x: operator window {plan.window_s:g} s "
        f"(= {plan.window_s * plan.speed / 60:g} trace minutes), seasonal day {plan.day_s:g} s; "
        f"warm-up {plan.warmup_s:g} s, measured {plan.duration_s:g} s; {plan.measured} requests "
        "in the measured period",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "## Summary (measured period)",
        "",
        _md_table(table(runs)),
        "",
        "Requests are streaming chat completions sent through the gateway; TTFT is measured at "
        "the client (answered requests). *capped* = refused at a documented cap (429 "
        "`queue_full`, 503 `hold_timeout` after `maxHoldSeconds`); *dropped* = any other failure.",
        "",
        "GPU-seconds per worker state (measured period):",
        "",
        "| system | " + " | ".join(GPU_STATES) + " |",
        "|---|" + "---|" * len(GPU_STATES),
        gpu,
        "",
        "## TTFT at the gateway",
        "",
        "![TTFT CDF](ttft_cdf.png)",
        "",
        "## Demand vs prediction per model",
        "",
        "![demand vs prediction](demand_vs_prediction.png)",
        "",
        "## GPU states over time",
        "",
        "![GPU states](gpu_states.png)",
        "",
        "## Prewarm hits vs cold starts",
        "",
        "![prewarm hits](prewarm_hits.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(md))
    return summary
