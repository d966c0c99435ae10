"""A real Prometheus for the dashboard test, the dashboard's queries as Prometheus runs them,
and a PNG of the dashboard drawn from those queries with matplotlib.

Prometheus is the server built from the Go module proxy by ``hack/testbin/build.sh prometheus``
(cached like the control plane).  Grafana template macros are replaced the way Grafana would
for a dashboard showing the test's time range: ``$model`` (all) -> ``.*``, ``$__rate_interval``
-> four scrape intervals, ``$__range`` -> the range shown.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "helm" / "warmserve" / "dashboards" / "warmserve.json"
SCRAPE_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def promql(expr: str, range_s: float) -> str:
    """A panel's expression as Grafana sends it for the model variable's "All"."""
    return (
        expr.replace("$model", ".*")
        .replace("$__rate_interval", f"{int(4 * SCRAPE_S)}s")
        .replace("$__range", f"{int(range_s)}s")
    )


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]

    def get(self, path: str, **params: Any) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=30) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def targets_up(self) -> dict[str, str]:
        data = self.get("/api/v1/targets")
        return {t["labels"]["job"]: t["health"] for t in data["activeTargets"]}

    def range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step=step)[
            "result"
        ]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_prometheus(binary: Path, tmp: Path, targets: dict[str, str]) -> Prometheus:
    """Prometheus scraping ``targets`` (job -> host:port) every second."""
    cfg = {
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [addr]}]}
            for job, addr in targets.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = open(tmp / "prometheus.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            str(binary),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return prom
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError((tmp / "prometheus.log").read_text()[-3000:]) from None
        time.sleep(0.3)
    prom.stop()
    raise RuntimeError("Prometheus did not become ready in 60 s")


def finite_points(series: list[dict]) -> int:
    return sum(1 for s in series for _, v in s.get("values", []) if math.isfinite(float(v)))


def render_png(prom: Prometheus, start: float, end: float, out: Path) -> None:
    """Draw every panel of the dashboard from its queries over [start, end] (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels()
    rows = max(p["gridPos"]["y"] for p in ps) // 8 + 1
    fig = plt.figure(figsize=(18, 3.4 * rows))
    fig.suptitle(
        "warmserve (Grafana dashboard, drawn from its queries on a real Prometheus)",
        fontsize=13,
        fontweight="bold",
    )
    grid = fig.add_gridspec(rows, 24, hspace=0.6, wspace=0.8, top=1 - 0.5 / rows)
    units = {"Bps": 1 / 1024**2, "bytes": 1 / 1024**2}
    ylabels = {"Bps": "MiB/s", "bytes": "MiB", "s": "seconds", "percentunit": "ratio"}
    for p in ps:
        g = p["gridPos"]
        ax = fig.add_subplot(grid[g["y"] // 8, g["x"] : g["x"] + g["w"]])
        unit = p["fieldConfig"]["defaults"]["unit"]
        ax.set_title(p["title"], fontsize=10, loc="left")
        ax.set_ylabel(ylabels.get(unit, ""), fontsize=8)
        drawn = 0
        ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
        for t in p["targets"]:
            for s in prom.range(promql(t["expr"], end - start), start, end):
                xs = [float(x) - start for x, v in s["values"] if math.isfinite(float(v))]
                ys = [
                    float(v) * units.get(unit, 1.0)
                    for _, v in s["values"]
                    if math.isfinite(float(v))
                ]
                if not xs:
                    continue
                label = t["legendFormat"]
                for k, v in s["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                if p["type"] == "stat":
                    ax.bar(label[:28], ys[-1], color=plt.get_cmap("tab20")(2 * drawn))
                    ax.text(drawn, ys[-1], f"{ys[-1]:.0%}", ha="center", va="bottom", fontsize=8)
                else:
                    short = label if len(label) <= 40 else "…" + label[-39:]  # keep the end
                    ax.plot(xs, ys, label=short, linewidth=1.4)
                drawn += 1
        if p["type"] == "stat":
            ax.set_ylim(0, 1.15)
            ax.tick_params(axis="x", labelsize=7)
        else:
            ax.set_xlabel("seconds", fontsize=8)
            if drawn:
                ax.legend(fontsize=6, loc="upper left", ncol=2 if drawn > 6 else 1, framealpha=0.6)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight")
    plt.close(fig)
