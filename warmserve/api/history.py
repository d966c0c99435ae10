"""The load-history ConfigMap: how a model's load history (:mod:`warmserve.control.history`) is
stored in the cluster, format ``warmserve.io/load-history/v1``.

The operator writes and reads it; ``warmserve up`` seeds it with the days of a trace before the
replay, with the same encoder, so the seed is exactly what the operator would have stored.

Where and why: one ConfigMap per ModelDeployment, ``warmserve-history-<deployment UID>`` in
the *operator's own namespace* (the chart's release namespace), with the two series as base64
of little-endian float16 arrays.  Least privilege: the operator may write ConfigMaps only there
(a namespaced Role), never in the namespaces its users own; the UID names it uniquely across
namespaces.  No ownerReference can cross namespaces, so the teardown deletes it with the
deployment and the loop removes any whose UID no deployment has.

* Compact: 8 days of 5-minute windows are 2 x 2,304 values x 2 bytes = 9 KiB (12 KiB as base64),
  far below the 1 MiB object limit; float16 keeps ~3 significant digits, plenty for "requests in
  flight", and saturates at 65,504 (documented; a model that hot needs a larger float).
* Not the ModelDeployment itself: writing an annotation every window would bump the object's
  resourceVersion, wake every watcher and (for kopf) look like a change to handle; status is
  for what a person reads, and is rewritten wholesale.  A separate object is written once a
  window by one writer (the leader), and it is deleted with the deployment.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from warmserve.control.history import HistoryError, LoadHistory

FORMAT = "warmserve.io/load-history/v1"
F16_MAX = float(np.finfo(np.float16).max)
HISTORY_PREFIX = "warmserve-history-"
OWNER_LABEL = "warmserve.io/owner-uid"


def configmap_name(uid: str) -> str:
    """Name of the history ConfigMap of the deployment with this UID (DNS-1123)."""
    return f"{HISTORY_PREFIX}{uid}"[:253]


def _encode(values: np.ndarray) -> str:
    arr = np.clip(values.astype(np.float64), 0.0, F16_MAX).astype("<f2")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def _decode(text: str, key: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise HistoryError(f"history key {key!r} is not base64: {exc}") from exc
    if len(raw) % 2:
        raise HistoryError(f"history key {key!r} has an odd byte count ({len(raw)})")
    return np.frombuffer(raw, dtype="<f2").astype(np.float64)


def to_data(history: LoadHistory, model: str) -> dict[str, str]:
    """The ConfigMap data of ``history``."""
    return {
        "format": FORMAT,
        "model": model,
        "windowSeconds": repr(float(history.window_s)),
        "endWindow": str(int(history.end)),
        "avg": _encode(history.avg),
        "peak": _encode(history.peak),
    }


def from_data(data: dict[str, Any], window_s: float) -> LoadHistory:
    """Read ConfigMap data; a different window length starts a fresh history."""
    if data.get("format") != FORMAT:
        raise HistoryError(f"history format {data.get('format')!r} is not {FORMAT!r}")
    try:
        stored_w = float(data["windowSeconds"])
        end = int(data["endWindow"])
    except (KeyError, ValueError) as exc:
        raise HistoryError(f"history is missing windowSeconds/endWindow: {exc}") from exc
    if abs(stored_w - window_s) > 1e-9:
        return LoadHistory(window_s=window_s)
    avg = _decode(str(data.get("avg", "")), "avg")
    peak = _decode(str(data.get("peak", "")), "peak")
    if avg.shape != peak.shape:
        raise HistoryError("history avg and peak differ in length")
    return LoadHistory(window_s=window_s, end=end, avg=avg.copy(), peak=peak.copy())
