"""Status documents for ModelDeployment and GPUNode (pure builders).

Conditions follow the Kubernetes convention (type/status/reason/message/lastTransitionTime), so
``kubectl wait --for=condition=Ready wsmd/chat`` works:

* ``Ready``: the deployment serves as many instances as the autoscaler wants now (a deployment
  scaled to zero at zero load is Ready with reason ``ScaledToZero``).
* ``Prewarmed``: every replica the forecast asks for is resident (``AllPlaced``), or why not.
* ``Degraded``: something needs a person — ``Unplaceable`` (no node has tensorParallel GPUs),
  ``NoCapacity``, ``ModelNotFound``, ``DuplicateModel``, ``InvalidSpec``, ``NoAgents``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmserve.api.history import OWNER_LABEL
from warmserve.policy.cluster import Replica, WorkerState
from warmserve.policy.prewarm_depth import DepthChoice

from .engine import ttft_report
from .snapshot import NodeSnapshot

# The scale subresource's selector (labelSelectorPath .status.selector): the owner the agents
# record for a deployment's instances, under the label key its load-history ConfigMap carries.
# The UID rather than the name: a label value has at most 63 characters, a name up to 253, and a
# deployment recreated under the same name owns none of the old one's instances.
SELECTOR_KEY = OWNER_LABEL


def scale_selector(uid: str) -> str:
    """``status.selector`` of the deployment with ``uid`` (a valid label selector string)."""
    return f"{SELECTOR_KEY}={uid}"


def now_iso(t: float | None = None) -> str:
    when = dt.datetime.fromtimestamp(t, dt.UTC) if t is not None else dt.datetime.now(dt.UTC)
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool | None
    reason: str
    message: str = ""


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None, new: Iterable[Condition], generation: int, now: str
) -> list[dict[str, Any]]:
    """New conditions, keeping ``lastTransitionTime`` when a condition's status did not change."""
    prev = {c.get("type"): c for c in (old or [])}
    out = []
    for c in new:
        status = "Unknown" if c.status is None else ("True" if c.status else "False")
        before = prev.get(c.type)
        ltt = before.get("lastTransitionTime") if before and before.get("status") == status else now
        out.append(
            {
                "type": c.type,
                "status": status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": ltt or now,
                "observedGeneration": generation,
            }
        )
    return out


def condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


@dataclass
class ModelView:
    """Everything the status of one deployment is built from."""

    generation: int
    window_s: float
    window_start: float | None = None
    predicted_avg: float | None = None
    predicted_peak: float | None = None
    observed_avg: float | None = None
    observed_peak: float | None = None
    history_windows: int = 0
    hits: int = 0
    misses: int = 0
    replicas: Sequence[Replica] = ()
    unplaced: int = 0
    unplaced_reason: str = ""
    weight_bytes: int | None = None
    num_layers: int | None = None
    cold_start_s: float | None = None
    depth: DepthChoice | None = None  # the prewarm depth in use and why
    engine_overhead_bytes: int = 0
    desired: int | None = None
    inflight: float | None = None  # demand now: at the instances ...
    held: float | None = None  # ... + at the gateways (None: no gateway configured)
    gateway_replicas: int | None = None
    conditions: list[Condition] = field(default_factory=list)
    ttft_objective_s: float | None = None  # spec.ttftObjectiveSeconds
    selector: str = ""  # status.selector (scale_selector); "" leaves it out


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def model_status(
    model: str,
    view: ModelView,
    snaps: Mapping[str, NodeSnapshot],
    slot_of: Mapping[tuple[str, str, tuple[int, ...]], str],
    old: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """The ``status`` of a ModelDeployment."""
    instances = []
    ttft_obs: list[tuple[float, int, float]] = []
    for node in sorted(snaps):
        for i in snaps[node].instances:
            if i.model == model:
                instances.append(
                    {
                        "id": i.instance_id,
                        "node": node,
                        "gpus": list(i.gpus),
                        "endpoint": i.endpoint,
                        "phase": i.phase.value,
                        "running": i.load,
                        "prewarmHit": i.prewarm_hit,
                    }
                )
                ttft_obs.append((i.ttft_p95_s, i.ttft_samples, i.ttft_window_s))
    replicas = []
    for r in sorted(view.replicas, key=lambda r: (r.kind != "basic", r.rank, r.node, r.gpus)):
        sid = slot_of.get((r.node, r.model, r.gpus), "")
        slot = snaps[r.node].slot(sid) if sid and r.node in snaps else None
        replicas.append(
            {
                "node": r.node,
                "gpus": list(r.gpus),
                "kind": r.kind.value,
                "rank": r.rank,
                "score": round(r.score, 4),
                "layersResident": slot.layers_resident if slot else 0,
                "layersTotal": slot.layers_total if slot else (view.num_layers or 0),
                "slotId": sid,
                "state": slot.state if slot else "requested",
            }
        )
    total = view.hits + view.misses
    load: dict[str, Any] = {"windowSeconds": view.window_s, "historyWindows": view.history_windows}
    for key, value in (
        ("predictedAverage", view.predicted_avg),
        ("predictedPeak", view.predicted_peak),
        ("observedAverage", view.observed_avg),
        ("observedPeak", view.observed_peak),
        ("inFlight", view.inflight),
        ("held", view.held),
    ):
        if value is not None:
            load[key] = _round(value)
    if view.window_start is not None:
        load["windowStart"] = now_iso(view.window_start)
    if view.gateway_replicas is not None:
        load["gatewayReplicas"] = view.gateway_replicas
    model_facts: dict[str, Any] = {}
    if view.weight_bytes:
        model_facts["weightBytes"] = int(view.weight_bytes)
    if view.num_layers:
        model_facts["numLayers"] = int(view.num_layers)
    if view.cold_start_s is not None:
        model_facts["coldStartSeconds"] = _round(view.cold_start_s)
    if view.depth is not None:
        model_facts["prewarmLayers"] = view.depth.layers
        model_facts["prewarmLayersSource"] = view.depth.source.value
        model_facts["prewarmLayersReason"] = view.depth.reason
    if view.engine_overhead_bytes:
        model_facts["engineOverheadBytes"] = int(view.engine_overhead_bytes)
    prewarm: dict[str, Any] = {"hits": view.hits, "misses": view.misses, "unplaced": view.unplaced}
    if total:
        prewarm["hitRatio"] = round(view.hits / total, 4)
    if view.unplaced_reason:
        prewarm["unplacedReason"] = view.unplaced_reason
    conditions = list(view.conditions)
    extra: dict[str, Any] = {}
    if view.ttft_objective_s is not None:
        extra["ttft"], cond = ttft_report(ttft_obs, view.ttft_objective_s)
        conditions.append(Condition(*cond))
    return {
        **extra,
        "observedGeneration": view.generation,
        "instanceCount": sum(1 for i in instances if i["phase"] != "grace"),
        **({"selector": view.selector} if view.selector else {}),
        **({"desiredInstances": view.desired} if view.desired is not None else {}),
        "prewarmedCount": sum(1 for r in replicas if r["state"] in ("ready", "loading")),
        "instances": instances,
        "prewarmedReplicas": replicas,
        "load": load,
        "prewarm": prewarm,
        "model": model_facts,
        "conditions": merge_conditions(
            (old or {}).get("conditions"), conditions, view.generation, now
        ),
    }


def node_status(
    snap: NodeSnapshot | None,
    reachable: bool,
    message: str,
    old: Mapping[str, Any] | None,
    now: str,
    last_seen: float | None,
) -> dict[str, Any]:
    """The ``status`` of a GPUNode: a mirror of the agent's last Describe answer."""
    cond = Condition(
        "Reachable", reachable, "AgentAnswered" if reachable else "AgentUnreachable", message
    )
    out: dict[str, Any] = {
        "conditions": merge_conditions((old or {}).get("conditions"), [cond], 0, now),
    }
    for c in out["conditions"]:
        c.pop("observedGeneration", None)
    if last_seen is not None:
        out["lastSeen"] = now_iso(last_seen)
    if snap is None:
        return out
    counts = {s.value: 0 for s in WorkerState}
    for g in snap.gpus:
        counts[g.state.value] += 1
    gpus = []
    for g in sorted(snap.gpus, key=lambda g: g.index):
        slots = []
        for s in snap.slots:
            if g.index not in s.gpus:
                continue
            sid = s.slot_id
            slots.append(
                {
                    "slotId": sid,
                    "model": s.model,
                    "layersResident": s.layers_resident,
                    "layersTotal": s.layers_total,
                    "bytes": s.resident_bytes_per_gpu,
                    "state": s.state,
                }
            )
        gpus.append(
            {
                "index": g.index,
                "memoryBytes": g.memory_bytes,
                "freeBytes": g.free_bytes,
                "state": g.state.value,
                "instance": g.instance_id,
                "slots": slots,
            }
        )
    out.update(
        {
            "agentId": snap.agent_id,
            "agentVersion": snap.version,
            "backend": snap.backend,
            "generation": snap.generation,
            "gpuCount": len(snap.gpus),
            "workers": counts,
            "gpus": gpus,
            "instances": [
                {
                    "id": i.instance_id,
                    "model": i.model,
                    "gpus": list(i.gpus),
                    "endpoint": i.endpoint,
                    "phase": i.phase.value,
                    "running": i.load,
                    "prewarmHit": i.prewarm_hit,
                }
                for i in snap.instances
            ],
            "models": [
                {
                    "name": m.name,
                    "weightBytes": m.weight_bytes,
                    "numLayers": m.num_layers,
                    **({"source": m.source, "diskBytes": m.disk_bytes} if m.source else {}),
                }
                for m in sorted(snap.models.values(), key=lambda m: m.name)
            ],
            "store": {
                "usedBytes": snap.store[0],
                "budgetBytes": snap.store[1],
                "evictions": snap.store[2],
            },
            "fetches": [
                {
                    "model": f.model,
                    "source": f.source,
                    "state": f.state,
                    "bytesDone": f.bytes_done,
                    "bytesTotal": f.bytes_total,
                    "bytesPerSecond": round(f.bytes_per_s, 1),
                    "etaSeconds": round(f.eta_s, 1),
                    "attempt": f.attempt,
                    "message": f.message,
                    **({"startedAt": now_iso(f.started_unix)} if f.started_unix else {}),
                }
                for f in snap.fetches
            ],
        }
    )
    return out


# Timestamps, and TTFT figures that move with every request (the TTFTObjectiveMet condition's
# status is not volatile: a flip is written at once).
_VOLATILE = frozenset({"lastTransitionTime", "lastSeen", "observedP95Seconds", "samples"})


def strip_volatile(status: Mapping[str, Any]) -> Any:
    """A status without timestamps, to decide whether anything worth a write changed."""

    def walk(x: Any) -> Any:
        if isinstance(x, Mapping):
            return {k: walk(v) for k, v in x.items() if k not in _VOLATILE}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(status)
