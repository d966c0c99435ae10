"""Read and validate a cluster snapshot (JSON) into a policy ``ClusterState``.

The snapshot is what ``warmserve plan`` takes (its messages call the file a scenario): nodes,
models with their forecasts, and the replicas and instances already in place.  I/O and
user-facing validation live here, outside the pure policy package; every error is a
:class:`~warmserve.policy.cluster.PolicyInputError` whose one-line message names the field
(``models[2].tp: ...``), so the CLI prints it and exits 2.

Schema (unknown fields are errors; ``?`` marks optional fields)::

    {
      "description"?: str,
      "nodes": [ {"name": str, "gpus": [ {"id": int >= 0, "memory": SIZE, "free"?: SIZE,
                                         "state"?: "idle"|"universal"|"dedicated"|"grace"} ]} ],
      "models": [ {"name": str, "weight": SIZE, "tp"?: int >= 1 (1), "max_batch"?: int >= 1 (32),
                   "cold_start_s": float >= 0, "avg_load": float >= 0, "peak_load": float >= 0,
                   "active_instances"?: int, "num_layers"?: int (32), "prewarm_layers"?: int} ],
      "replicas"?: [ {"model": str, "node": str, "gpus": [int], "kind"?: "basic"|"burst",
                      "rank"?: int, "score"?: float, "bytes_per_gpu"?: SIZE,
                      "layers_resident"?: int} ],
      "instances"?: [ {"model": str, "node": str, "gpus": [int], "name"?: str,
                       "phase"?: "starting"|"serving"|"grace" ("serving"), "running"?: int,
                       "kv_capacity"?: SIZE, "kv_used"?: SIZE} ]
    }

Rules:

* **SIZE**: an integer number of bytes, or a string: a number and a unit, ``B``, decimal
  ``KB MB GB TB`` (powers of 1000, as model cards quote weights: "12.55GB") or binary
  ``KiB MiB GiB TiB`` (powers of 1024, as GPUs are sold: "80GiB").  Negative sizes are errors.
* **GPU state** defaults to ``idle``.  **free** defaults to the control layer's free-bytes rule
  (:func:`warmserve.control.snapshot.gpu_free_bytes`, the one the operator and the simulator
  use): idle/universal — memory minus the listed replicas resident on that GPU; dedicated — 0 (a
  serving instance owns the GPU); grace — the grace instance's lendable KV memory per GPU
  (Eq. 1, :func:`warmserve.policy.autoscaler.lendable_per_gpu`) minus replicas already lent
  memory there.
  A dedicated GPU cannot have a non-zero ``free``.
* **active instances (K of Eq. 5-6)**: counted from ``instances`` (those not in grace).
  ``active_instances`` is optional and, when given, must equal that count — a consistency check,
  never a second source of truth.
* An instance's GPUs must be ``dedicated`` (phase starting/serving) or ``grace`` (phase grace),
  and no GPU may belong to two instances.  Replica and instance groups must have exactly ``tp``
  GPUs on one node.  A model whose ``tp`` exceeds every node's GPU count is an error.
* A resident replica's ``bytes_per_gpu`` defaults to the model's prewarm share; ``kind``/``rank``
  /``score`` are informational (the planner re-scores resident replicas).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from warmserve import units
from warmserve.control.snapshot import gpu_free_bytes
from warmserve.policy.autoscaler import lendable_per_gpu
from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    Instance,
    InstancePhase,
    LoadForecast,
    ModelSpec,
    Node,
    PolicyInputError,
    Replica,
    ReplicaKind,
    WorkerState,
)

__all__ = ["load_cluster_state", "parse_cluster_state", "parse_size"]

_TOP = {"description", "nodes", "models", "replicas", "instances"}
_NODE = {"name", "gpus"}
_GPU = {"id", "memory", "free", "state"}
_MODEL = {
    "name",
    "weight",
    "tp",
    "max_batch",
    "cold_start_s",
    "avg_load",
    "peak_load",
    "active_instances",
    "num_layers",
    "prewarm_layers",
}
_REPLICA = {"model", "node", "gpus", "kind", "rank", "score", "bytes_per_gpu", "layers_resident"}
_INSTANCE = {"model", "node", "gpus", "name", "phase", "running", "kv_capacity", "kv_used"}


def _fail(where: str, msg: str) -> PolicyInputError:
    return PolicyInputError(f"{where}: {msg}")


def parse_size(value: Any, where: str = "size") -> int:
    """Bytes from an int or a string like ``"80GiB"`` / ``"12.55GB"`` (:mod:`warmserve.units`)."""
    try:
        return units.parse_size(value, where)
    except units.SizeError as exc:
        raise PolicyInputError(str(exc)) from None


def _obj(value: Any, where: str, allowed: set[str], required: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _fail(where, f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(value))
    if missing:
        raise _fail(where, f"missing field {missing[0]!r}")
    return value


def _list(value: Any, where: str, *, nonempty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, f"expected a list, got {type(value).__name__}")
    if nonempty and not value:
        raise _fail(where, "must not be empty")
    return value


def _int(value: Any, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"expected an integer, got {value!r}")
    if value < lo:
        raise _fail(where, f"must be >= {lo}, got {value}")
    return value


def _num(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, f"expected a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _fail(where, f"must be a finite number >= 0, got {value}")
    return float(value)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"expected a non-empty string, got {value!r}")
    return value


def _enum(cls: type, value: Any, where: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        options = ", ".join(m.value for m in cls)
        raise _fail(where, f"unknown value {value!r} (one of: {options})") from None


def _dupe(names: list[str], where: str, what: str) -> None:
    for name, count in Counter(names).items():
        if count > 1:
            raise _fail(where, f"duplicate {what} {name!r}")


def _parse_models(raw: list[Any], max_gpus: int) -> tuple[dict[str, ModelSpec], dict[str, Any]]:
    models: dict[str, ModelSpec] = {}
    extra: dict[str, Any] = {}
    required = {"name", "weight", "cold_start_s", "avg_load", "peak_load"}
    _dupe([m.get("name", "") for m in raw if isinstance(m, dict)], "models", "model name")
    for i, m in enumerate(raw):
        w = f"models[{i}]"
        m = _obj(m, w, _MODEL, required)
        name = _str(m["name"], f"{w}.name")
        weight = parse_size(m["weight"], f"{w}.weight")
        if weight == 0:
            raise _fail(f"{w}.weight", "must be > 0")
        tp = _int(m.get("tp", 1), f"{w}.tp", 1)
        if tp > max_gpus:
            raise _fail(f"{w}.tp", f"{tp} GPUs exceed every node (largest has {max_gpus})")
        layers = _int(m.get("num_layers", 32), f"{w}.num_layers", 1)
        pre = m.get("prewarm_layers")
        if pre is not None:
            pre = _int(pre, f"{w}.prewarm_layers", 1)
            if pre > layers:
                raise _fail(f"{w}.prewarm_layers", f"{pre} exceeds num_layers {layers}")
        models[name] = ModelSpec(
            name=name,
            weight_bytes=weight,
            tp=tp,
            max_batch=_int(m.get("max_batch", 32), f"{w}.max_batch", 1),
            cold_start_s=_num(m["cold_start_s"], f"{w}.cold_start_s"),
            num_layers=layers,
            prewarm_layers=pre,
        )
        forecast = LoadForecast(
            _num(m["avg_load"], f"{w}.avg_load"), _num(m["peak_load"], f"{w}.peak_load")
        )
        k = m.get("active_instances")
        extra[name] = (forecast, None if k is None else _int(k, f"{w}.active_instances"))
    return models, extra


def _gpu_list(value: Any, where: str, node: Mapping[str, Any], tp: int) -> tuple[int, ...]:
    gpus = [_int(g, f"{where}[{k}]") for k, g in enumerate(_list(value, where, nonempty=True))]
    if len(set(gpus)) != len(gpus):
        raise _fail(where, f"names a GPU twice: {gpus}")
    for g in gpus:
        if g not in node:
            raise _fail(where, f"GPU {g} does not exist on this node (has {sorted(node)})")
    if len(gpus) != tp:
        raise _fail(where, f"{len(gpus)} GPUs but the model's tp is {tp}")
    return tuple(sorted(gpus))


def parse_cluster_state(data: Any) -> ClusterState:
    """Validate a decoded scenario and build the snapshot (schema in the module docstring)."""
    top = _obj(data, "scenario", _TOP, {"nodes", "models"})
    if "description" in top and not isinstance(top["description"], str):
        raise _fail("description", "expected a string")

    raw_nodes = _list(top["nodes"], "nodes", nonempty=True)
    _dupe([n.get("name", "") for n in raw_nodes if isinstance(n, dict)], "nodes", "node name")
    gpu_raw: dict[str, dict[int, tuple[int, Any, WorkerState, str]]] = {}
    for i, n in enumerate(raw_nodes):
        w = f"nodes[{i}]"
        n = _obj(n, w, _NODE, _NODE)
        name = _str(n["name"], f"{w}.name")
        gpus: dict[int, tuple[int, Any, WorkerState, str]] = {}
        for k, g in enumerate(_list(n["gpus"], f"{w}.gpus", nonempty=True)):
            gw = f"{w}.gpus[{k}]"
            g = _obj(g, gw, _GPU, {"id", "memory"})
            gid = _int(g["id"], f"{gw}.id")
            if gid in gpus:
                raise _fail(f"{gw}.id", f"duplicate GPU id {gid} on node {name!r}")
            mem = parse_size(g["memory"], f"{gw}.memory")
            if mem == 0:
                raise _fail(f"{gw}.memory", "must be > 0")
            free = None if "free" not in g else parse_size(g["free"], f"{gw}.free")
            if free is not None and free > mem:
                raise _fail(f"{gw}.free", f"{free} exceeds memory {mem}")
            state = _enum(WorkerState, g.get("state", "idle"), f"{gw}.state")
            if state == WorkerState.DEDICATED and free:
                raise _fail(f"{gw}.free", "a dedicated GPU lends nothing (use state 'grace')")
            gpus[gid] = (mem, free, state, gw)
        gpu_raw[name] = gpus

    max_gpus = max(len(g) for g in gpu_raw.values())
    models, extra = _parse_models(_list(top["models"], "models", nonempty=True), max_gpus)

    def locate(obj: Mapping[str, Any], w: str) -> tuple[str, str, tuple[int, ...]]:
        model = _str(obj["model"], f"{w}.model")
        if model not in models:
            raise _fail(f"{w}.model", f"unknown model {model!r}")
        node = _str(obj["node"], f"{w}.node")
        if node not in gpu_raw:
            raise _fail(f"{w}.node", f"unknown node {node!r}")
        return model, node, _gpu_list(obj["gpus"], f"{w}.gpus", gpu_raw[node], models[model].tp)

    instances: list[Instance] = []
    owner: dict[tuple[str, int], str] = {}
    for i, raw in enumerate(_list(top.get("instances", []), "instances")):
        w = f"instances[{i}]"
        raw = _obj(raw, w, _INSTANCE, {"model", "node", "gpus"})
        model, node, gpus = locate(raw, w)
        name = _str(raw.get("name", f"{model}-{i}"), f"{w}.name")
        phase = _enum(InstancePhase, raw.get("phase", "serving"), f"{w}.phase")
        cap = parse_size(raw.get("kv_capacity", 0), f"{w}.kv_capacity")
        used = parse_size(raw.get("kv_used", 0), f"{w}.kv_used")
        if used > cap:
            raise _fail(f"{w}.kv_used", f"{used} exceeds kv_capacity {cap}")
        want = WorkerState.GRACE if phase == InstancePhase.GRACE else WorkerState.DEDICATED
        for g in gpus:
            if (node, g) in owner:
                raise _fail(f"{w}.gpus", f"GPU {g} of {node} already serves {owner[(node, g)]!r}")
            owner[(node, g)] = name
            if gpu_raw[node][g][2] != want:
                raise _fail(
                    f"{w}.gpus",
                    f"GPU {g} of {node} is {gpu_raw[node][g][2].value}, an instance in phase "
                    f"{phase.value} needs it {want.value}",
                )
        instances.append(
            Instance(model, node, gpus, _int(raw.get("running", 0), f"{w}.running"), cap, used,
                     phase, name)
        )
    _dupe([i.name for i in instances], "instances", "instance name")

    replicas: list[Replica] = []
    for i, raw in enumerate(_list(top.get("replicas", []), "replicas")):
        w = f"replicas[{i}]"
        raw = _obj(raw, w, _REPLICA, {"model", "node", "gpus"})
        model, node, gpus = locate(raw, w)
        spec = models[model]
        lr = raw.get("layers_resident")
        replicas.append(
            Replica(
                model=model,
                kind=_enum(ReplicaKind, raw.get("kind", "basic"), f"{w}.kind"),
                rank=_int(raw.get("rank", 0), f"{w}.rank"),
                score=_num(raw.get("score", 0.0), f"{w}.score"),
                node=node,
                gpus=gpus,
                bytes_per_gpu=parse_size(
                    raw.get("bytes_per_gpu", spec.prewarm_bytes_per_gpu), f"{w}.bytes_per_gpu"
                ),
                layers_resident=None if lr is None else _int(lr, f"{w}.layers_resident", 1),
            )
        )

    for name, (_fc, k) in extra.items():
        count = sum(1 for i in instances if i.model == name and i.phase != InstancePhase.GRACE)
        if k is not None and k != count:
            raise _fail(
                f"models[{list(models).index(name)}].active_instances",
                f"says {k} but 'instances' lists {count} non-grace instances of {name!r}",
            )

    nodes = [_build_node(name, gpus, models, replicas, instances) for name, gpus in gpu_raw.items()]
    return ClusterState(
        nodes=tuple(nodes),
        models=models,
        replicas=tuple(replicas),
        instances=tuple(instances),
        forecasts={name: fc for name, (fc, _k) in extra.items()},
    )


def _build_node(
    name: str,
    gpus: Mapping[int, tuple[int, Any, WorkerState, str]],
    models: Mapping[str, ModelSpec],
    replicas: list[Replica],
    instances: list[Instance],
) -> Node:
    resident: dict[int, int] = defaultdict(int)
    for r in replicas:
        if r.node == name:
            for g in r.gpus:
                resident[g] += r.bytes_per_gpu
    lend: dict[int, int] = {}
    for inst in instances:
        if inst.node == name and inst.phase == InstancePhase.GRACE:
            for g in inst.gpus:
                lend[g] = lendable_per_gpu(inst, models[inst.model])
    out = []
    for gid, (mem, free, state, where) in sorted(gpus.items()):
        if free is None:  # the control layer's one rule (warmserve.control.snapshot)
            if state == WorkerState.GRACE and gid not in lend:
                raise _fail(f"{where}.free", "a grace GPU needs 'free' or a grace instance on it")
            if state in (WorkerState.IDLE, WorkerState.UNIVERSAL) and resident[gid] > mem:
                raise _fail(where, f"resident replicas take {resident[gid]} > memory {mem}")
            free = gpu_free_bytes(mem, state, resident[gid], lend.get(gid, 0), None)
        out.append(GPU(gid, mem, free, state))
    return Node(name, tuple(out))


def load_cluster_state(path: str | Path) -> ClusterState:
    """Read a scenario file; a missing file or invalid JSON is a one-line PolicyInputError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyInputError(f"scenario file not found: {p}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise PolicyInputError(f"cannot read scenario {p}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyInputError(
            f"{p}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_cluster_state(data)
