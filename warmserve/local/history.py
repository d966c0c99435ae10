"""Seeding the operator's load history: the days of the trace before the replay, as if the
operator had watched the models then (so the predictor has its seasons from the first window).

The operator keeps each model's per-window average and peak load in a ConfigMap in its own
namespace, ``warmserve-history-<deployment UID>``, format ``warmserve.io/load-history/v1``
(docs/operator.md).  The data is written with the format's one encoder
(:func:`warmserve.api.history.to_data`, the operator's too), so the seed is exactly what the
operator would have stored; ``tests/local`` reads it back with the format's reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from warmserve.api.history import OWNER_LABEL, configmap_name, to_data
from warmserve.control.history import LoadHistory


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
    history = LoadHistory(
        window_s=float(window_s),
        end=int(end_window),
        avg=np.asarray(avg, dtype=np.float64),
        peak=np.asarray(peak, dtype=np.float64),
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(uid),
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "warmserve-operator", OWNER_LABEL: uid[:63]},
        },
        "data": to_data(history, model),
    }
