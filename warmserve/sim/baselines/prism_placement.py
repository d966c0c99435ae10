"""Prism's KV-pressure-ratio placement (Algorithm 1, §6.2; TP entries, Appendix A.1.2) and the
lowest-KVPR choice of GPUs for an activation (§6.2).

What the paper specifies and what we assumed where it is silent (memory feasibility, TP entries
on one node): :mod:`warmserve.sim.baselines.prism`'s docstring.  Pure and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from warmserve.policy.cluster import PolicyInputError


class PrismError(PolicyInputError):
    """Bad input to a Prism function; the message names the field."""


@dataclass(frozen=True, slots=True)
class PrismModel:
    """A model for Prism's global scheduler.

    ``weight_bytes`` is the whole model (split over ``tp`` GPUs); ``rate`` in req/s; ``slo_s``
    the TTFT SLO.  ``current`` optionally names the GPUs (global indices) it occupies now, for
    the migration threshold.
    """

    name: str
    weight_bytes: int
    rate: float
    slo_s: float
    tp: int = 1
    current: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise PrismError("a Prism model needs a name")
        if self.weight_bytes <= 0:
            raise PrismError(f"model {self.name}: weight_bytes must be > 0")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise PrismError(f"model {self.name}: rate must be >= 0, got {self.rate!r}")
        if not self.slo_s > 0:
            raise PrismError(f"model {self.name}: slo_s must be > 0, got {self.slo_s!r}")
        if self.tp < 1:
            raise PrismError(f"model {self.name}: tp must be >= 1, got {self.tp}")
        if self.current and len(self.current) != self.tp:
            raise PrismError(f"model {self.name}: current must name tp={self.tp} GPUs")

    @property
    def w_req_rate(self) -> float:
        """SLO-weighted request rate ``r/s`` (memory demand per unit time)."""
        return self.rate / self.slo_s


@dataclass(frozen=True, slots=True)
class PrismGpu:
    """State of one GPU after placement: models on it, their weighted rate, KV left."""

    index: int
    node: int
    models: tuple[str, ...]
    w_req_rate: float
    shared_kv: float

    @property
    def kvpr(self) -> float:
        return _kvpr(self.w_req_rate, self.shared_kv)


@dataclass(frozen=True, slots=True)
class PrismPlacement:
    """Model -> GPUs (global indices ``node * gpus_per_node + local``), per-GPU state, and
    models that fit nowhere (with the reason)."""

    assignment: Mapping[str, tuple[int, ...]]
    gpus: tuple[PrismGpu, ...]
    unplaced: Mapping[str, str]
    migrated: tuple[str, ...]

    @property
    def max_kvpr(self) -> float:
        return max((g.kvpr for g in self.gpus if g.models), default=0.0)


def _kvpr(w: float, kv: float) -> float:
    if kv <= 0:
        return math.inf
    return w / kv


def kvpr_placement(
    models: Sequence[PrismModel],
    num_gpus: int,
    gpu_capacity_bytes: float,
    *,
    gpus_per_node: int = 8,
    tau: float = 0.0,
    min_kv_bytes: float = 0.0,
) -> PrismPlacement:
    """Prism Algorithm 1 with TP decomposition and a memory-feasibility guard (see module doc).

    ``gpu_capacity_bytes`` is ``C``, the memory a GPU offers to weights + KV.  Deterministic:
    ties go to the lower GPU index.
    """
    if num_gpus < 1:
        raise PrismError(f"num_gpus must be >= 1, got {num_gpus}")
    if gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise PrismError(f"num_gpus {num_gpus} must be a multiple of gpus_per_node {gpus_per_node}")
    if gpu_capacity_bytes <= 0:
        raise PrismError("gpu_capacity_bytes must be > 0")
    if tau < 0 or min_kv_bytes < 0:
        raise PrismError("tau and min_kv_bytes must be >= 0")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise PrismError(f"duplicate model names in {names}")
    w = [0.0] * num_gpus
    kv = [float(gpu_capacity_bytes)] * num_gpus
    held: list[list[str]] = [[] for _ in range(num_gpus)]
    assignment: dict[str, tuple[int, ...]] = {}
    unplaced: dict[str, str] = {}
    migrated: list[str] = []
    order = sorted(models, key=lambda m: (-m.w_req_rate, m.name))
    for m in order:
        if m.tp > gpus_per_node:
            unplaced[m.name] = f"tp {m.tp} exceeds {gpus_per_node} GPUs per node"
            continue
        part_w = m.w_req_rate / m.tp
        part_bytes = m.weight_bytes / m.tp
        fits = [g for g in range(num_gpus) if kv[g] - part_bytes >= min_kv_bytes]
        best = _best_group(fits, w, kv, m.tp, gpus_per_node)
        if best is None:
            unplaced[m.name] = (
                f"no node has {m.tp} GPU(s) with {part_bytes / 2**30:.1f} GiB free for weights"
            )
            continue
        chosen = best
        cur = tuple(sorted(m.current))
        if cur and all(g in fits for g in cur) and _same_node(cur, gpus_per_node):
            cur_r = max(_kvpr(w[g], kv[g]) for g in cur)
            best_r = max(_kvpr(w[g], kv[g]) for g in best)
            if not cur_r - best_r > tau:
                chosen = cur
        if cur and chosen != cur:
            migrated.append(m.name)
        for g in chosen:
            w[g] += part_w
            kv[g] -= part_bytes
            held[g].append(m.name)
        assignment[m.name] = chosen
    gpus = tuple(
        PrismGpu(g, g // gpus_per_node, tuple(held[g]), w[g], kv[g]) for g in range(num_gpus)
    )
    return PrismPlacement(assignment, gpus, unplaced, tuple(migrated))


def _same_node(gpus: Sequence[int], per_node: int) -> bool:
    return len({g // per_node for g in gpus}) == 1


def _best_group(
    fits: Sequence[int], w: Sequence[float], kv: Sequence[float], tp: int, per_node: int
) -> tuple[int, ...] | None:
    """Lowest-KVPR GPU (tp=1), or the node whose ``tp`` lowest-KVPR fitting GPUs are best."""
    by_node: dict[int, list[int]] = {}
    for g in fits:
        by_node.setdefault(g // per_node, []).append(g)
    best: tuple[float, float, tuple[int, ...]] | None = None
    for node in sorted(by_node):
        ranked = sorted(by_node[node], key=lambda g: (_kvpr(w[g], kv[g]), g))
        if len(ranked) < tp:
            continue
        group = tuple(sorted(ranked[:tp]))
        worst = max(_kvpr(w[g], kv[g]) for g in group)
        total = sum(_kvpr(w[g], kv[g]) for g in group)
        key = (worst, total, group)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def choose_activation_gpus(
    placement_gpus: Sequence[PrismGpu],
    model: PrismModel,
    *,
    gpus_per_node: int = 8,
    min_kv_bytes: float = 0.0,
) -> tuple[int, ...] | None:
    """GPUs for reactivating ``model``: the lowest-KVPR GPU(s) whose free memory holds its
    weights (one node for TP).  ``None``: nothing fits, evict first (:func:`idle_evictions`)."""
    part = model.weight_bytes / model.tp
    w = [g.w_req_rate for g in placement_gpus]
    kv = [g.shared_kv for g in placement_gpus]
    fits = [g.index for g in placement_gpus if g.shared_kv - part >= min_kv_bytes]
    return _best_group(fits, w, kv, model.tp, gpus_per_node)
