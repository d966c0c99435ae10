"""A deployment as the policy sees it: its :class:`ModelSpec` from the spec and the agents'
weight stores.

The spec itself is an API type (:mod:`warmserve.api.crd`); what the node agents' stores report
about a model (:class:`CatalogEntry`) and how the two combine into the policy's model are the
operator's, so they live here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from warmserve.api.crd import ModelDeploymentSpec, SpecError
from warmserve.policy.cluster import ModelSpec, PolicyInputError

DEFAULT_LOAD_BANDWIDTH = 2 * 1024**3  # bytes/s host->GPU, for T_c when the spec gives none


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """What a node's weight store reports about a model."""

    name: str
    weight_bytes: int
    num_layers: int
    source: str = ""  # where the node fetched it from ("" = pre-filled or not fetched)
    disk_bytes: int = 0


def resolve_model(
    md: ModelDeploymentSpec,
    catalog: Mapping[str, CatalogEntry],
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH,
) -> ModelSpec:
    """The policy's :class:`ModelSpec` for a deployment: spec fields, else the weight store.

    ``cold_start_s`` (T_c of Eq. 7-8) should come from offline profiling; without it we estimate
    weight bytes / ``load_bandwidth`` — a documented approximation, reported in status.
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
    try:
        return ModelSpec(
            name=md.model,
            weight_bytes=int(weight),
            tp=md.tp,
            max_batch=md.max_batch,
            cold_start_s=float(cold),
            num_layers=int(layers),
            prewarm_layers=md.prewarm_layers,
        )
    except PolicyInputError as exc:  # pragma: no cover - ranges are checked above
        raise SpecError(str(exc)) from exc
