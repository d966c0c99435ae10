"""Tiny scenarios for the simulator tests (minutes of simulated time, a few thousand requests)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

BASE: dict[str, Any] = {
    "name": "tiny",
    "cluster": {"nodes": 1, "gpus_per_node": 8, "profile": "h800"},
    "models": [
        {"name": "a", "arch": "llama2-7b", "tp": 1, "trace_day": 3},
        {"name": "b", "arch": "llama2-13b", "tp": 2, "trace_day": 4},
    ],
    "workload": {
        "arrivals": "azure_lmm_2025_multimodal_1week_per_minute.csv.gz",
        "lengths": "azure_conv_2023_1h.csv.gz",
        "total_rps": 4,
        "alpha": 1.0,
        "duration_s": 600,
        "history_days": 1,
    },
    "policy": {"window_s": 300, "scale_down_delay_s": 20, "drain_s": 600},
    "seed": 7,
}


def make_doc(**changes: Any) -> dict[str, Any]:
    """A copy of BASE with dotted-path overrides, e.g. ``make_doc(**{"workload.total_rps": 9})``."""
    doc = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = doc
        *head, last = path.split(".")
        for key in head:
            node = node[key]
        node[last] = value
    return doc


@pytest.fixture
def tiny_doc() -> dict[str, Any]:
    return make_doc()
