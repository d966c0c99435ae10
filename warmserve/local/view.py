"""The live terminal view of ``warmserve up`` (``rich``), or periodic log lines without a TTY.

Per model: demand now (in flight + held, what the operator measures) against the forecast for
this window (average / peak) and the last window's observed average; serving and starting
instances; prewarmed replicas (ready / wanted); prewarm hits and cold starts with the hit ratio;
the gateway TTFT p50 / p99 of the requests answered so far; requests held at the gateways; and
requests ok / capped / dropped.  Per node: one cell per GPU, coloured by its worker state (idle,
universal = prewarmed, dedicated = serving, grace = draining).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from .observe import Sampler
from .replay import Replayer
from .summary import fmt_ratio, fmt_s, rows

_STATE_STYLE = {
    "idle": ("·", "grey50"),
    "universal": ("U", "cyan"),
    "dedicated": ("D", "green"),
    "grace": ("G", "yellow"),
}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


class View:
    """Renders the sampler and the replayer; ``footer`` lines are printed below the tables."""

    def __init__(
        self,
        title: str,
        sampler: Sampler,
        replayer: Replayer,
        footer: list[str],
        *,
        tty: bool | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.title = title
        self.sampler = sampler
        self.replayer = replayer
        self.footer = footer
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.log = log
        self._live: Any = None
        self._last_line = 0.0

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        rp = self.replayer
        plan = rp.plan
        t = rp.now()
        phase = "warm-up" if t < 0 else ("replay" if t < plan.duration_s else "draining")
        trace_min = t * plan.speed / 60
        head = Text.assemble(
            (self.title, "bold"),
            f"  {phase} t={t:+.0f}s/{plan.duration_s:.0f}s (trace +{trace_min:.0f} min)  "
            f"window {plan.window_s:g}s  sent {rp.sent}  open {rp.inflight}",
        )
        mt = Table(expand=False, pad_edge=False, box=None, header_style="bold")
        for col in (
            "MODEL",
            "DEMAND",
            "PRED avg/peak",
            "LAST WIN",
            "INST",
            "PREWARMED",
            "HITS/COLD",
            "HIT%",
            "TTFT p50/p99",
            "HELD",
            "OK/CAP/DROP",
        ):
            mt.add_column(col, justify="left" if col == "MODEL" else "right")
        stats = {r.model: r for r in rows(plan.models, rp.results, [], measured_only=False)}
        for m in plan.models:
            s = self.sampler.models.get(m)
            r = stats[m]
            if s is None:
                mt.add_row(m, *["-"] * 10)
                continue
            demand = (s.inflight or 0) + (s.held or 0)
            n = s.hits + s.misses
            mt.add_row(
                m,
                _f(demand),
                f"{_f(s.pred_avg)}/{_f(s.pred_peak)}",
                _f(s.obs_avg),
                f"{s.instances}" + (f"+{s.starting}" if s.starting else ""),
                f"{s.prewarmed_ready}/{s.prewarmed}",
                f"{s.hits}/{s.misses}",
                fmt_ratio(s.hits / n if n else None),
                f"{fmt_s(r.p50)}/{fmt_s(r.p99)}",
                _f(s.held),
                f"{r.ok}/{r.capped}/{r.dropped}",
            )
        nt = Table(expand=False, pad_edge=False, box=None, header_style="bold")
        for col in ("NODE", "GPUS (· idle  U universal  D dedicated  G grace)", "idle/U/D/G"):
            nt.add_column(col)
        for name in sorted(self.sampler.nodes):
            ns = self.sampler.nodes[name]
            cells = Text()
            for st in ns.gpus:
                ch, style = _STATE_STYLE.get(st, ("?", "red"))
                cells.append(ch + " ", style=style)
            c = ns.counts()
            nt.add_row(
                name + ("" if ns.reachable else " (unreachable)"),
                cells,
                f"{c['idle']}/{c['universal']}/{c['dedicated']}/{c['grace']}",
            )
        parts: list[Any] = [head, mt, nt]
        if self.sampler.last_error and self.sampler.errors:
            parts.append(Text(f"API: {self.sampler.last_error}", style="red"))
        parts += [Text(line, style="dim") for line in self.footer]
        return Group(*parts)

    def line(self) -> str:
        rp = self.replayer
        tot = rows(rp.plan.models, rp.results, [], measured_only=False)[-1]
        inst = sum(s.instances for s in self.sampler.models.values())
        hits = sum(s.hits for s in self.sampler.models.values())
        cold = sum(s.misses for s in self.sampler.models.values())
        return (
            f"t={rp.now():+.0f}s sent={rp.sent} ok={tot.ok} capped={tot.capped} "
            f"dropped={tot.dropped} open={rp.inflight} instances={inst} hits={hits} "
            f"cold={cold} ttft_p50={fmt_s(tot.p50)} ttft_p99={fmt_s(tot.p99)}"
        )

    def __enter__(self) -> View:
        if self.tty:
            from rich.live import Live

            self._live = Live(self.render(), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def tick(self) -> None:
        """Call often: refreshes the table, or logs a line every 10 s without a TTY."""
        if self._live is not None:
            self._live.update(self.render())
        elif time.monotonic() - self._last_line >= 10:
            self._last_line = time.monotonic()
            self.log(self.line())

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(None, None, None)
            self._live = None
        else:
            self.log(self.line())
