"""Tables, JSON and plots of simulation results (``warmserve simulate``, ``bench/paper_eval.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, key, format)
    ("system", "system", "s"),
    ("TTFT p50", "ttft_p50_s", "t"),
    ("TTFT p95", "ttft_p95_s", "t"),
    ("TTFT p99", "ttft_p99_s", "t"),
    ("TTFT p99.9", "ttft_p999_s", "t"),
    ("delayed by start", "start_delayed_share", "pct2"),
    ("TPOT p50", "tpot_p50_s", "ms"),
    ("TPOT p99", "tpot_p99_s", "ms"),
    ("hit ratio", "hit_ratio", "pct"),
    ("warm", "warm_starts", "d"),
    ("cold", "cold_starts", "d"),
    ("GPU-h", "gpu_hours", "f2"),
    ("served", "served", "d"),
    ("dropped", "dropped", "drop"),
)


def fmt_seconds(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 1.0:
        return f"{v * 1000:.0f} ms"
    return f"{v:.2f} s"


def _cell(row: dict[str, Any], key: str, kind: str) -> str:
    v = row.get(key)
    if kind == "s":
        return str(v)
    if kind == "drop":
        reasons = row.get("drop_reasons") or {}
        detail = ", ".join(f"{k}: {n}" for k, n in reasons.items())
        return f"{v} ({detail})" if detail else str(v)
    if v is None:
        return "-"
    if kind == "t":
        return fmt_seconds(float(v))
    if kind == "ms":
        return f"{float(v) * 1000:.1f} ms"
    if kind == "pct":
        return f"{float(v) * 100:.0f}%"
    if kind == "pct2":
        return f"{float(v) * 100:.2f}%"
    if kind == "f2":
        return f"{float(v):.2f}"
    return str(v)


def table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """One row per system, fixed columns (text table, or GitHub markdown)."""
    header = [h for h, _, _ in COLUMNS]
    body = [[_cell(r, k, kind) for _, k, kind in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(header[i]), *(len(b[i]) for b in body)) for i in range(len(header))]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                 strict=True))
        )
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False, default=float) + "\n")


def plot(path: str | Path, results: Sequence[tuple[str, Any, Any]], title: str = "") -> None:
    """TTFT CDF per system (left) and the timeline of GPU worker states per system (right).

    ``results``: (system, TTFT CDF as (seconds, cumulative share) arrays, timeline list of
    (t, {state: count})).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(results)
    fig = plt.figure(figsize=(13, max(4.0, 1.6 * n + 1)))
    grid = fig.add_gridspec(n, 2, width_ratios=[1.2, 1.0])
    ax = fig.add_subplot(grid[:, 0])
    for name, (x, y), _ in results:
        if len(x):
            ax.plot(np.maximum(np.asarray(x), 1e-3), y, label=name, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "TTFT CDF")
    states = ("dedicated", "grace", "universal", "idle")
    colors = ("#d62728", "#ff7f0e", "#2ca02c", "#c7c7c7")
    for i, (name, _, timeline) in enumerate(results):
        tax = fig.add_subplot(grid[i, 1])
        if timeline:
            t = np.array([p[0] for p in timeline]) / 60.0
            ys = [np.array([p[1].get(s, 0) for p in timeline]) for s in states]
            tax.stackplot(t, *ys, labels=states, colors=colors, step="post")
        tax.set_ylabel(name, fontsize=8)
        if i == 0:
            tax.legend(fontsize=7, loc="upper right", ncol=4)
            tax.set_title("GPU worker states")
        if i == n - 1:
            tax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
