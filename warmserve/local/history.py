"""Seeding the operator's load history: the days of the trace before the replay, as if the
operator had watched the models then (so the predictor has its seasons from the first window).

The operator keeps each model's per-window average and peak load in a ConfigMap in its own
namespace, ``warmserve-history-<deployment UID>``, format ``warmserve.io/load-history/v1``
(docs/operator.md): base64 of little-endian float16 arrays, ``endWindow`` = index of the window
after the last one (index = floor(unix time / window)).  This module writes that documented
format; ``tests/local`` checks that the operator's own reader accepts it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

FORMAT = "warmserve.io/load-history/v1"
PREFIX = "warmserve-history-"
OWNER_LABEL = "warmserve.io/owner-uid"
_F16_MAX = float(np.finfo(np.float16).max)


def _encode(values: Sequence[float]) -> str:
    arr = np.clip(np.asarray(values, dtype=np.float64), 0.0, _F16_MAX).astype("<f2")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def history_configmap(
    namespace: str,
    uid: str,
    model: str,
    window_s: float,
    end_window: int,
    avg: Sequence[float],
    peak: Sequence[float],
) -> dict[str, Any]:
    """The ConfigMap holding ``avg``/``peak`` for the windows ending before ``end_window``."""
    if len(avg) != len(peak):
        raise ValueError("avg and peak differ in length")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{PREFIX}{uid}"[:253],
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "warmserve-operator", OWNER_LABEL: uid},
        },
        "data": {
            "format": FORMAT,
            "model": model,
            "windowSeconds": repr(float(window_s)),
            "endWindow": str(int(end_window)),
            "avg": _encode(avg),
            "peak": _encode(peak),
        },
    }
