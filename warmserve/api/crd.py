"""ModelDeployment and GPUNode custom resources as typed values.

The API server already validates specs against the CRD's OpenAPI schema (ranges, enums, CEL
rules), so what reaches a component is well formed.  We still parse defensively here: an
object stored before a schema change, or a test that bypasses the API server, must yield a
clear ``SpecError`` naming the field, never a ``KeyError`` deep in a component.

This parser checks what the schema states, nothing a component knows better: ``spec.engine.args``
is a list of at most :data:`MAX_ENGINE_ARGS` strings of at most :data:`MAX_ENGINE_ARG_CHARS`
characters each; whether vLLM takes them, and whether a tenant may set them, is the operator's
admission, which reports a refusal as the ``InvalidSpec``
reason of the deployment's Ready condition, and the agent's own check before an instance starts.

Model identity: the policy core keys models by name, and agents name models by their directory
in the node's weight cache.  We therefore use ``spec.model.name`` as the policy key and require
it to be unique across ModelDeployments cluster-wide (two deployments of the same weights would
otherwise fight over the same slots); the older deployment wins (:func:`dedupe_models`, which the
operator and the gateway both apply), the newer one is reported with a ``Degraded`` condition
(reason ``DuplicateModel``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from warmserve.modelref import SourceURIError, parse_source

GROUP = "warmserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MD_PLURAL = "modeldeployments"
MD_KIND = "ModelDeployment"
NODE_PLURAL = "gpunodes"
NODE_KIND = "GPUNode"

# spec.gateway.maxQueue's ceiling: a gateway replica's default --max-held (the CRD's maximum
# too), so one deployment cannot claim more held slots than a replica has; the gateway also
# clamps it to its own --max-held and per-namespace cap.
MAX_QUEUE_LIMIT = 10_000
# spec.engine.name's enum: the node agent's engine registry (checked equal by a test), here so
# that no reader of the CRD needs the agent.
ENGINE_NAMES = ("simulated", "vllm")
# spec.prewarm.layers: an integer in [1, MAX_LAYERS], or this (the default): the operator picks
# the depth from the model's measured profile (docs/operator.md, docs/policy.md "Prewarm depth").
PREWARM_LAYERS_AUTO = "auto"
MAX_LAYERS = 1024
# spec.engine.args: the schema's maxItems and items.maxLength.
MAX_ENGINE_ARGS = 64
MAX_ENGINE_ARG_CHARS = 1024


class SpecError(ValueError):
    """A custom resource a component cannot act on; the message names the field."""


def _get(obj: Mapping[str, Any], path: str, default: Any = None) -> Any:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _int(obj: Mapping[str, Any], path: str, default: int | None, lo: int, hi: int) -> int | None:
    value = _get(obj, path, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"spec.{path} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"spec.{path} must be in [{lo}, {hi}], got {value}")
    return value


def _num(
    obj: Mapping[str, Any], path: str, default: float | None, lo: float, hi: float
) -> float | None:
    value = _get(obj, path, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(f"spec.{path} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"spec.{path} must be in [{lo}, {hi}], got {value}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ModelDeploymentSpec:
    """A parsed ``ModelDeployment`` (defaults as in the CRD)."""

    namespace: str
    name: str
    uid: str
    generation: int
    created: str
    model: str
    weight_bytes: int | None
    num_layers: int | None
    cold_start_s: float | None
    tp: int
    max_batch: int
    ttft_s: float
    min_instances: int
    max_instances: int
    prewarm: bool
    prewarm_layers: int | None  # None: "auto" (the default), the operator's profiled depth
    engine_args: tuple[str, ...]
    deleting: bool = False
    source: str = ""  # spec.model.source: where agents fetch the weights ("" = pre-filled)
    # spec.gateway: how the gateway holds requests while no instance has room (docs/gateway.md)
    max_queue: int = 100
    max_hold_s: float = 120.0
    engine: str = ""  # spec.engine.name; "" = the agent's default engine

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_engine_spec(spec: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(engine name or "" for the agent's default, engine args) of a ModelDeployment spec, as
    the schema states them (module docstring: the arguments' meaning is the operator's to
    judge)."""
    eng = spec.get("engine") or {}
    if not isinstance(eng, Mapping):
        raise SpecError("spec.engine must be an object")
    name = eng.get("name") or ""
    if not isinstance(name, str) or (name and name not in ENGINE_NAMES):
        raise SpecError(
            f"spec.engine.name {name!r} is not an engine; choose from {list(ENGINE_NAMES)}"
        )
    args = eng.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError("spec.engine.args must be a list of strings")
    if len(args) > MAX_ENGINE_ARGS:
        raise SpecError(f"spec.engine.args has {len(args)} items, at most {MAX_ENGINE_ARGS}")
    for i, a in enumerate(args):
        if len(a) > MAX_ENGINE_ARG_CHARS:
            raise SpecError(
                f"spec.engine.args[{i}] is {len(a)} characters long, at most "
                f"{MAX_ENGINE_ARG_CHARS}"
            )
    return name, tuple(args)


def parse_prewarm_layers(spec: Mapping[str, Any]) -> int | None:
    """``spec.prewarm.layers``: an integer in [1, :data:`MAX_LAYERS`], or ``None`` for
    :data:`PREWARM_LAYERS_AUTO` (also when absent)."""
    value = _get(spec, "prewarm.layers", PREWARM_LAYERS_AUTO)
    if value == PREWARM_LAYERS_AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LAYERS:
        raise SpecError(
            f"spec.prewarm.layers must be an integer in [1, {MAX_LAYERS}] or "
            f"{PREWARM_LAYERS_AUTO!r}, got {value!r}"
        )
    return value


def parse_model_deployment(body: Mapping[str, Any]) -> ModelDeploymentSpec:
    """Parse a ModelDeployment object (as the API returns it) or raise :class:`SpecError`."""
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is missing")
    model = _get(spec, "model.name")
    if not isinstance(model, str) or not model:
        raise SpecError("spec.model.name is required")
    min_i = _int(spec, "minInstances", 0, 0, 1000)
    max_i = _int(spec, "maxInstances", 8, 0, 1000)
    assert min_i is not None and max_i is not None
    if min_i > max_i:
        raise SpecError(f"spec.minInstances ({min_i}) must be <= spec.maxInstances ({max_i})")
    engine, args = parse_engine_spec(spec)
    source = _get(spec, "model.source", "") or ""
    if source:
        try:
            parse_source(source)
        except SourceURIError as exc:
            raise SpecError(f"spec.model.source: {exc}") from None
    enabled = _get(spec, "prewarm.enabled", True)
    if not isinstance(enabled, bool):
        raise SpecError("spec.prewarm.enabled must be a boolean")
    out = ModelDeploymentSpec(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        created=str(meta.get("creationTimestamp") or ""),
        model=model,
        weight_bytes=_int(spec, "model.weightBytes", None, 1, 2**62),
        num_layers=_int(spec, "model.numLayers", None, 1, MAX_LAYERS),
        cold_start_s=_num(spec, "model.coldStartSeconds", None, 0.0, 3600.0),
        tp=_int(spec, "tensorParallel", 1, 1, 64) or 1,
        max_batch=_int(spec, "maxBatchSize", 32, 1, 4096) or 32,
        ttft_s=_num(spec, "ttftObjectiveSeconds", 1.0, 1e-6, 600.0) or 1.0,
        min_instances=min_i,
        max_instances=max_i,
        prewarm=enabled,
        prewarm_layers=parse_prewarm_layers(spec),
        engine_args=args,
        deleting=bool(meta.get("deletionTimestamp")),
        source=source,
        max_queue=_int(spec, "gateway.maxQueue", 100, 0, MAX_QUEUE_LIMIT) or 0,
        max_hold_s=_num(spec, "gateway.maxHoldSeconds", 120.0, 0.001, 3600.0) or 120.0,
        engine=engine,
    )
    if out.num_layers and out.prewarm_layers and out.prewarm_layers > out.num_layers:
        raise SpecError("spec.prewarm.layers must be <= spec.model.numLayers")
    return out


def dedupe_models(
    mds: Iterable[ModelDeploymentSpec],
) -> tuple[dict[str, ModelDeploymentSpec], list[ModelDeploymentSpec]]:
    """Map model name -> owning deployment; the oldest (then by namespace/name) wins.

    Returns (owners, duplicates).  Deployments being deleted are left out entirely.
    """
    owners: dict[str, ModelDeploymentSpec] = {}
    dups: list[ModelDeploymentSpec] = []
    for md in sorted((m for m in mds if not m.deleting), key=lambda m: (m.created, m.key)):
        if md.model in owners:
            dups.append(md)
        else:
            owners[md.model] = md
    return owners, dups


@dataclass(frozen=True, slots=True)
class GPUNodeSpec:
    name: str
    address: str
    cordoned: bool = False


def parse_gpu_node(body: Mapping[str, Any]) -> GPUNodeSpec:
    name = _get(body, "metadata.name")
    addr = _get(body, "spec.agentAddress")
    if not name:
        raise SpecError("metadata.name is required")
    if not isinstance(addr, str) or ":" not in addr:
        raise SpecError(f"GPUNode {name}: spec.agentAddress must be host:port, got {addr!r}")
    return GPUNodeSpec(
        name=str(name), address=addr, cordoned=bool(_get(body, "spec.cordoned", False))
    )
