#!/usr/bin/env python3
"""Generate the Grafana dashboard the Helm chart ships (helm/warmserve/dashboards/warmserve.json).

The panels are defined once here (title, unit, PromQL); the JSON is what Grafana imports
(schemaVersion 39, a ``datasource`` variable of type prometheus, a ``model`` variable).
tests/dashboards/test_dashboard.py runs every panel's query against a real Prometheus scraping a
local operator, agents and gateway, so no panel is dead; hack/check-generated.sh fails when the
committed JSON differs from this script's output.

usage: python hack/gen-dashboard.py [--check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "helm" / "warmserve" / "dashboards" / "warmserve.json"
M = '{model=~"$model"}'
G = '{gen_ai_request_model=~"$model"}'  # the GenAI metrics' model label

# (title, description, kind, unit, [(legend, expr)], width) in display order, 24 columns a row.
PANELS: list[tuple[str, str, str, str, list[tuple[str, str]], int]] = [
    (
        "Demand vs prediction",
        "Requests in flight now per model (running and queued at instances, plus held at the "
        "gateways) against the window's predicted average and peak (Eq. 2-4).",
        "timeseries",
        "short",
        [
            ("{{model}} demand", f"sum by (model) (warmserve_operator_inflight{M})"),
            (
                "{{model}} predicted avg",
                'sum by (model) (warmserve_operator_predicted_load{model=~"$model", stat="avg"})',
            ),
            (
                "{{model}} predicted peak",
                'sum by (model) (warmserve_operator_predicted_load{model=~"$model", stat="peak"})',
            ),
            (
                "{{model}} observed avg (last window)",
                'sum by (model) (warmserve_operator_observed_load{model=~"$model", stat="avg"})',
            ),
        ],
        16,
    ),
    (
        "Prewarm hit ratio",
        "Instance starts that found the model prewarmed, over the selected range (all models "
        "selected) and per model since the operator started.",
        "stat",
        "percentunit",
        [
            (
                "selected range",
                'sum(increase(warmserve_operator_instance_starts_total{model=~"$model", '
                'start="hit"}[$__range])) / clamp_min(sum(increase('
                "warmserve_operator_instance_starts_total"
                f"{M}[$__range])), 1)",
            ),
            ("{{model}}", f"max by (model) (warmserve_operator_prewarm_hit_ratio{M})"),
        ],
        8,
    ),
    (
        "Instance starts by kind",
        "Starts on a prewarmed GPU group (hit) versus cold starts, per interval.",
        "barchart-ts",
        "short",
        [
            (
                "{{start}}",
                "sum by (start) (increase(warmserve_operator_instance_starts_total"
                f"{M}[$__rate_interval]))",
            )
        ],
        8,
    ),
    (
        "Activation time (p50/p95) by kind",
        "Time from the operator's start decision to an answering endpoint, as agents report.",
        "timeseries",
        "s",
        [
            (
                "p50 {{start}}",
                "histogram_quantile(0.5, sum by (le, start) "
                "(rate(warmserve_operator_activation_seconds_bucket[$__rate_interval])))",
            ),
            (
                "p95 {{start}}",
                "histogram_quantile(0.95, sum by (le, start) "
                "(rate(warmserve_operator_activation_seconds_bucket[$__rate_interval])))",
            ),
        ],
        8,
    ),
    (
        "Instances and prewarmed replicas",
        "Serving instances and resident prewarm replicas per model.",
        "timeseries",
        "short",
        [
            ("{{model}} instances", f"sum by (model) (warmserve_operator_instances{M})"),
            (
                "{{model}} prewarmed",
                f"sum by (model) (warmserve_operator_prewarm_replicas{M})",
            ),
        ],
        8,
    ),
    (
        "Gateway time to first token",
        "Time from a request's arrival at the gateway to its first byte to the client "
        "(includes time held while an instance starts).",
        "timeseries",
        "s",
        [
            (
                f"p{q}",
                f"histogram_quantile(0.{q}, sum by (le) "
                f"(rate(warmserve_gateway_ttft_seconds_bucket{M}[$__rate_interval])))",
            )
            for q in (50, 95, 99)
        ],
        12,
    ),
    (
        "Held requests",
        "Requests waiting at the gateways for an instance with room (summed over replicas).",
        "timeseries",
        "short",
        [("{{model}}", f"sum by (model) (warmserve_gateway_held_requests{M})")],
        12,
    ),
    (
        "GPU worker states",
        "GPUs per worker state (Figure 5): idle, universal (prewarm slots), dedicated, grace.",
        "timeseries-stacked",
        "short",
        [("{{state}}", "sum by (state) (warmserve_agent_worker_state)")],
        12,
    ),
    (
        "Load bandwidth",
        "Host-to-GPU copy bandwidth of each prewarm slot's load, and model downloads into the "
        "nodes' weight stores.",
        "timeseries",
        "Bps",
        [
            (
                "{{model}} slot load",
                f"max by (model) (warmserve_agent_load_bandwidth_bytes_per_second{M})",
            ),
            (
                "{{node}} download",
                "sum by (node) (rate(warmserve_agent_fetch_bytes_total[$__rate_interval]))",
            ),
        ],
        12,
    ),
    (
        "Weight store",
        "Disk used by each node's weight store against its budget (0 = no budget), and cold "
        "models evicted to make room.",
        "timeseries",
        "bytes",
        [
            ("{{node}} used", 'sum by (node) (warmserve_agent_store_bytes{kind="used"})'),
            ("{{node}} budget", 'sum by (node) (warmserve_agent_store_bytes{kind="budget"})'),
        ],
        16,
    ),
    (
        "Weight store evictions",
        "Cold models evicted from the nodes' weight stores to make room for a fetch.",
        "timeseries",
        "short",
        [("{{node}}", "sum by (node) (warmserve_agent_store_evictions_total)")],
        8,
    ),
    (
        "Tokens per second by model",
        "Prompt (input) and completion (output) tokens of the answers, as the engines report "
        "them in their usage, summed over the gateways.",
        "timeseries",
        "short",
        [
            (
                "{{model}} {{type}}",
                f"sum by (model, type) (rate(warmserve_gateway_tokens_total{M}[$__rate_interval]))",
            )
        ],
        12,
    ),
    (
        "Tokens per second by API key",
        "Tokens per API key id (the name of its Secret data key, never the key) and type, for "
        "billing and quotas; (anonymous): the gateway runs without API keys.",
        "timeseries",
        "short",
        [
            (
                "{{key}} {{type}}",
                "label_replace(sum by (key, type) (rate(warmserve_gateway_tokens_total"
                f'{M}[$__rate_interval])), "key", "(anonymous)", "key", "_anonymous")',
            )
        ],
        12,
    ),
    (
        "Input vs output tokens",
        "All selected models' prompt and completion tokens per second, stacked.",
        "timeseries-stacked",
        "short",
        [
            (
                "{{type}}",
                f"sum by (type) (rate(warmserve_gateway_tokens_total{M}[$__rate_interval]))",
            )
        ],
        6,
    ),
    (
        "Tokens per request (p50/p95)",
        "Input and output tokens per answer (gen_ai.client.token.usage).",
        "timeseries",
        "short",
        [
            (
                f"p{q} {{{{gen_ai_token_type}}}}",
                f"histogram_quantile(0.{q}, sum by (le, gen_ai_token_type) "
                f"(rate(gen_ai_client_token_usage_bucket{G}[$__rate_interval])))",
            )
            for q in (50, 95)
        ],
        6,
    ),
    (
        "Time per output token (p50/p95)",
        "A stream's time from its first to its last byte per output token after the first "
        "(gen_ai.server.time_per_output_token): the decode speed users see.",
        "timeseries",
        "s",
        [
            (
                f"p{q}",
                f"histogram_quantile(0.{q}, sum by (le) "
                f"(rate(gen_ai_server_time_per_output_token_seconds_bucket{G}"
                "[$__rate_interval])))",
            )
            for q in (50, 95)
        ],
        6,
    ),
    (
        "Request duration (p50/p95)",
        "Arrival at the gateway to the last byte of the engine's answer, holding included "
        "(gen_ai.server.request.duration).",
        "timeseries",
        "s",
        [
            (
                f"p{q}",
                f"histogram_quantile(0.{q}, sum by (le) "
                f"(rate(gen_ai_server_request_duration_seconds_bucket{G}[$__rate_interval])))",
            )
            for q in (50, 95)
        ],
        6,
    ),
]


def _panel(pid: int, x: int, y: int, spec: tuple) -> dict:
    title, desc, kind, unit, targets, width = spec
    ds = {"type": "prometheus", "uid": "${datasource}"}
    grafana_type = {"timeseries-stacked": "timeseries", "barchart-ts": "timeseries"}.get(kind, kind)
    custom: dict = {}
    if kind == "timeseries-stacked":
        custom = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
    elif kind == "barchart-ts":
        custom = {"drawStyle": "bars", "fillOpacity": 80, "stacking": {"mode": "normal"}}
    panel = {
        "id": pid,
        "type": grafana_type,
        "title": title,
        "description": desc,
        "datasource": ds,
        "gridPos": {"x": x, "y": y, "w": width, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": ds,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
            }
            for i, (legend, expr) in enumerate(targets)
        ],
    }
    if grafana_type == "stat":
        panel["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"]},
            "textMode": "value_and_name",
        }
    return panel


def dashboard() -> dict:
    panels, x, y = [], 0, 0
    for i, spec in enumerate(PANELS, start=1):
        width = spec[5]
        if x + width > 24:
            x, y = 0, y + 8
        panels.append(_panel(i, x, y, spec))
        x += width
    return {
        "uid": "warmserve-overview",
        "title": "warmserve",
        "description": "Predictive prewarming at a glance: demand vs prediction, prewarm hits, "
        "starts, gateway TTFT and held requests, GPU worker states, load bandwidth, tokens per "
        "model and API key. Generated by hack/gen-dashboard.py.",
        "tags": ["warmserve", "llm-serving"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model",
                    "label": "Model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": "label_values(warmserve_operator_predicted_load, model)",
                        "refId": "model",
                    },
                    "definition": "label_values(warmserve_operator_predicted_load, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python hack/gen-dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
