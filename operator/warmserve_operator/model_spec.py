"""A deployment as the policy sees it: its :class:`ModelSpec` from the spec and the agents'
weight stores and measured profiles.

The spec itself is an API type (:mod:`warmserve.api.crd`); what the node agents report about a
model (:class:`CatalogEntry`, with its :class:`MeasuredProfile`) and how the two combine into
the policy's model are the operator's, so they live here.  The prewarm depth of
``spec.prewarm.layers: auto`` is the policy's rule (:mod:`warmserve.policy.prewarm_depth`) on
the measured profile; the simulator applies the same rule to its engine model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from warmserve.api.crd import ModelDeploymentSpec, SpecError
from warmserve.policy.cluster import ModelSpec, PolicyInputError
from warmserve.policy.prewarm_depth import DepthChoice, DepthProfile, DepthSource, choose_depth
from warmserve.policy.tensor_parallel import heads_problem

DEFAULT_LOAD_BANDWIDTH = 2 * 1024**3  # bytes/s host->GPU, for T_c when the spec gives none


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    """What a node agent measured about a model (``ModelInfo.profile``; 0: not measured)."""

    load_bytes_per_s: float = 0.0  # per GPU
    layer_compute_s: float = 0.0  # one layer's forward of prompt_tokens on compute_tp GPUs
    prompt_tokens: int = 0
    compute_tp: int = 0
    head_s: float = 0.0
    head_start_s: float = 0.0
    engine_overhead_bytes: int = 0  # per GPU

    @property
    def usable(self) -> bool:
        """Enough for the depth rule: a load rate and a timed forward (``compute_tp`` set; its
        time may be 0, a forward below what a request's timing resolves)."""
        return self.load_bytes_per_s > 0 and self.compute_tp > 0


def _finite(x: float) -> float:
    """A reported number, 0 when it is not a finite non-negative one (an agent's report is
    data, not trusted to be well formed)."""
    x = float(x)
    return x if math.isfinite(x) and x >= 0 else 0.0


def profile_from_pb(p: object) -> MeasuredProfile:
    """A ``ModelProfile`` message (fields read by name: the generated class is the API's)."""
    return MeasuredProfile(
        load_bytes_per_s=_finite(getattr(p, "load_bytes_per_second", 0.0)),
        layer_compute_s=_finite(getattr(p, "layer_compute_seconds", 0.0)),
        prompt_tokens=int(getattr(p, "prompt_tokens", 0)),
        compute_tp=int(getattr(p, "compute_tp", 0)),
        head_s=_finite(getattr(p, "head_seconds", 0.0)),
        head_start_s=_finite(getattr(p, "head_start_seconds", 0.0)),
        engine_overhead_bytes=int(getattr(p, "engine_overhead_bytes", 0)),
    )


def merge_profiles(profiles: Iterable[MeasuredProfile]) -> MeasuredProfile | None:
    """One profile from every node's: the cautious end of each number, so the depth holds on
    every node (the slowest load, the fastest forward, the shortest head start: each of these
    asks for more resident layers) and every replica is charged the largest engine measured.
    Compute is taken from the fastest node's timing at its own ``compute_tp``."""
    ps = [p for p in profiles if p.load_bytes_per_s > 0 or p.compute_tp > 0
          or p.engine_overhead_bytes > 0]
    if not ps:
        return None
    loads = [p.load_bytes_per_s for p in ps if p.load_bytes_per_s > 0]
    timed = [p for p in ps if p.compute_tp > 0]
    fastest = min(timed, key=lambda p: (p.layer_compute_s * p.compute_tp, p.prompt_tokens),
                  default=None)
    starts = [p.head_start_s for p in ps if p.head_start_s > 0]
    return MeasuredProfile(
        load_bytes_per_s=min(loads, default=0.0),
        layer_compute_s=fastest.layer_compute_s if fastest else 0.0,
        prompt_tokens=fastest.prompt_tokens if fastest else 0,
        compute_tp=fastest.compute_tp if fastest else 0,
        head_s=fastest.head_s if fastest else 0.0,
        head_start_s=min(starts, default=0.0),
        engine_overhead_bytes=max(p.engine_overhead_bytes for p in ps),
    )


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """What a node's weight store reports about a model."""

    name: str
    weight_bytes: int
    num_layers: int
    source: str = ""  # where the node fetched it from ("" = pre-filled or not fetched)
    disk_bytes: int = 0
    profile: MeasuredProfile | None = None  # merged over the nodes that report the model
    heads: int = 0  # attention / KV heads from config.json (0: not declared)
    kv_heads: int = 0


def tp_refusal(md: ModelDeploymentSpec, entry: CatalogEntry | None) -> str | None:
    """Why the deployment's engine cannot run its tensor-parallel size on this model (the
    heads its config declares do not split ``tp`` ways), None when it can or nobody knows yet.
    The simulated engine splits bytes, so only ``vllm`` is checked; the agent refuses any other
    split it cannot make at ``Prewarm``."""
    if md.engine != "vllm" or md.tp == 1 or entry is None or entry.heads == 0:
        return None
    why = heads_problem(md.tp, entry.heads, entry.kv_heads or entry.heads)
    return None if why is None else f"engine vllm cannot split model {md.model!r}: {why}"


def merged_catalog(nodes: Iterable[Mapping[str, CatalogEntry]]) -> dict[str, CatalogEntry]:
    """One catalog from every node's: a model's entry as the last node reports it, with the
    profiles of every node that measured it merged (:func:`merge_profiles`)."""
    nodes = list(nodes)
    out: dict[str, CatalogEntry] = {}
    for models in nodes:
        out.update(models)
    for model, entry in out.items():
        merged = merge_profiles(
            n[model].profile for n in nodes if model in n and n[model].profile is not None
        )
        out[model] = replace(entry, profile=merged)
    return out


def depth_profile(
    profile: MeasuredProfile | None, weight_bytes: int, num_layers: int, tp: int
) -> DepthProfile | None:
    """The depth rule's inputs for a ``tp``-GPU replica from a measured profile: a layer's
    shard over the measured load rate, and the timed forward scaled from the GPUs it ran on to
    ``tp`` (tensor parallelism splits a layer's work evenly).  ``None`` when not measured."""
    if profile is None or not profile.usable:
        return None
    load = weight_bytes / tp / num_layers / profile.load_bytes_per_s
    c = profile.layer_compute_s
    if profile.compute_tp != tp:
        c = c * profile.compute_tp / tp
    return DepthProfile(load, c, profile.head_s, profile.head_start_s, profile.prompt_tokens)


def resolve(
    md: ModelDeploymentSpec,
    catalog: Mapping[str, CatalogEntry],
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH,
) -> tuple[ModelSpec, DepthChoice]:
    """The policy's :class:`ModelSpec` for a deployment (spec fields, else the weight store)
    and how its prewarm depth was chosen.

    ``cold_start_s`` (T_c of Eq. 7-8) should come from offline profiling; without it we estimate
    weight bytes / ``load_bandwidth`` — a documented approximation, reported in status.
    ``spec.prewarm.layers: auto`` takes the policy's depth rule on the agents' measured profile,
    all layers until one exists; every replica is charged the measured prepared engine's bytes.
    Raises :class:`SpecError` when the weights are in no agent's cache and the spec does not
    give their size.
    """
    entry = catalog.get(md.model)
    weight = md.weight_bytes or (entry.weight_bytes if entry else None)
    layers = md.num_layers or (entry.num_layers if entry else None)
    if not weight or not layers:
        raise SpecError(
            f"model {md.model!r} is in no node agent's weight cache and spec.model.weightBytes/"
            "numLayers are not set: set spec.model.source (agents fetch it), copy the weights "
            "to the nodes, or set them"
        )
    if md.prewarm_layers and md.prewarm_layers > layers:
        raise SpecError(
            f"spec.prewarm.layers ({md.prewarm_layers}) exceeds the model's {layers} layers"
        )
    cold = md.cold_start_s if md.cold_start_s is not None else weight / load_bandwidth
    measured = entry.profile if entry else None
    try:
        depth = choose_depth(
            int(layers), md.prewarm_layers, depth_profile(measured, int(weight), int(layers), md.tp)
        )
        spec = ModelSpec(
            name=md.model,
            weight_bytes=int(weight),
            tp=md.tp,
            max_batch=md.max_batch,
            cold_start_s=float(cold),
            num_layers=int(layers),
            # the fallback stays "all layers" as before a profile existed (None, not L)
            prewarm_layers=None if depth.source == DepthSource.FALLBACK else depth.layers,
            engine_overhead_bytes=measured.engine_overhead_bytes if measured else 0,
        )
    except PolicyInputError as exc:  # pragma: no cover - ranges are checked above
        raise SpecError(str(exc)) from exc
    return spec, depth


def resolve_model(
    md: ModelDeploymentSpec,
    catalog: Mapping[str, CatalogEntry],
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH,
) -> ModelSpec:
    """:func:`resolve` without the depth's reason."""
    return resolve(md, catalog, load_bandwidth)[0]
