"""Sampling the cluster's state once a second for the live view and the report.

What the operator publishes is read back through the API, as ``kubectl`` / ``warmserve status``
would: each ModelDeployment's ``status`` (forecast, observed load, demand in flight and held,
instances, prewarmed replicas, hits and misses) and each GPUNode's ``status`` (the agent's GPUs
and their worker states).  Nothing here asks the agents or the operator directly.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GROUP, VERSION = "warmserve.io", "v1alpha1"
GPU_STATES = ("idle", "universal", "dedicated", "grace")


@dataclass
class ModelSample:
    t: float  # seconds from the measured start (< 0: warm-up)
    model: str
    window_start: float | None  # unix time of the window the forecast is for
    pred_avg: float | None
    pred_peak: float | None
    obs_avg: float | None  # the last closed window
    obs_peak: float | None
    inflight: float | None
    held: float | None
    instances: int
    starting: int
    prewarmed_ready: int
    prewarmed: int
    hits: int
    misses: int


@dataclass
class NodeSample:
    t: float
    node: str
    reachable: bool
    gpus: list[str] = field(default_factory=list)  # worker state per GPU index

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(GPU_STATES, 0)
        for s in self.gpus:
            out[s] = out.get(s, 0) + 1
        return out


def _unix(iso: str | None) -> float | None:
    if not iso:
        return None
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def model_sample(t: float, md: Mapping[str, Any]) -> ModelSample:
    st = md.get("status") or {}
    load = st.get("load") or {}
    pre = st.get("prewarm") or {}
    insts = st.get("instances") or []
    reps = st.get("prewarmedReplicas") or []
    return ModelSample(
        t=t,
        model=(md.get("spec") or {}).get("model", {}).get("name", md["metadata"]["name"]),
        window_start=_unix(load.get("windowStart")),
        pred_avg=load.get("predictedAverage"),
        pred_peak=load.get("predictedPeak"),
        obs_avg=load.get("observedAverage"),
        obs_peak=load.get("observedPeak"),
        inflight=load.get("inFlight"),
        held=load.get("held"),
        instances=sum(1 for i in insts if i.get("phase") == "serving"),
        starting=sum(1 for i in insts if i.get("phase") == "starting"),
        prewarmed_ready=sum(1 for r in reps if r.get("state") == "ready"),
        prewarmed=len(reps),
        hits=int(pre.get("hits", 0)),
        misses=int(pre.get("misses", 0)),
    )


def node_sample(t: float, gn: Mapping[str, Any]) -> NodeSample:
    st = gn.get("status") or {}
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Reachable"), {})
    gpus = sorted(st.get("gpus") or [], key=lambda g: g.get("index", 0))
    return NodeSample(
        t,
        gn["metadata"]["name"],
        cond.get("status") == "True",
        [str(g.get("state", "idle")) for g in gpus],
    )


class Sampler:
    """Polls the API in a thread; ``models``/``nodes`` are the latest, ``history`` all of them."""

    def __init__(self, kubeconfig: Path, namespace: str, interval_s: float = 1.0) -> None:
        from kubernetes import client, config

        api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.api = client.CustomObjectsApi(api_client)
        self.ns = namespace
        self.interval_s = interval_s
        self.t0 = time.monotonic()
        self.models: dict[str, ModelSample] = {}
        self.nodes: dict[str, NodeSample] = {}
        self.model_history: list[ModelSample] = []
        self.node_history: list[NodeSample] = []
        self.errors = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.recording = False

    def set_origin(self, t0_monotonic: float) -> None:
        self.t0 = t0_monotonic

    def poll(self) -> None:
        try:
            mds = self.api.list_namespaced_custom_object(
                GROUP, VERSION, self.ns, "modeldeployments", _request_timeout=5
            )["items"]
            gns = self.api.list_cluster_custom_object(
                GROUP, VERSION, "gpunodes", _request_timeout=5
            )["items"]
        except Exception as exc:  # the API is ours and local: keep sampling, show the error
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            return
        t = time.monotonic() - self.t0  # when the answer arrived
        self.models = {s.model: s for s in (model_sample(t, md) for md in mds)}
        self.nodes = {s.node: s for s in (node_sample(t, g) for g in gns)}
        if self.recording:
            self.model_history.extend(self.models.values())
            self.node_history.extend(self.nodes.values())

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                started = time.monotonic()
                self.poll()
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

        self._thread = threading.Thread(target=loop, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        return {
            "models": [asdict(s) for s in self.model_history],
            "nodes": [asdict(s) for s in self.node_history],
        }
