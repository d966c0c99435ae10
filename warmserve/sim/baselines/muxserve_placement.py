"""MuxServe's enumeration-based greedy placement (Algorithm 1).

Duan et al., ICML'24 (muxserve.txt): enumerate device-mesh groups, sort models by computation
requirement, put each on the mesh whose unit throughput grows the most (the estimator,
:mod:`warmserve.sim.baselines.muxserve_estimator`), keep the group with the largest total.
Pruning, tie rules and assumptions: :mod:`warmserve.sim.baselines.muxserve`'s docstring.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from warmserve.sim.baselines.muxserve_estimator import (
    PREFILL_SM_SHARE,
    Candidate,
    MuxMember,
    MuxModel,
    MuxServeError,
    PlanContext,
    base_tp,
    counted,
    estimate_unit,
    parallel_candidates,
)
from warmserve.sim.hardware import GpuProfile


@dataclass(frozen=True, slots=True)
class MuxUnit:
    """An LLM unit: a mesh (GPUs of one node) and the models colocated on it."""

    node: str
    gpus: tuple[int, ...]
    members: tuple[MuxMember, ...]
    kv_pool_bytes_per_gpu: int
    throughput: float

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(m.model for m in self.members)

    def member(self, model: str) -> MuxMember:
        for m in self.members:
            if m.model == model:
                return m
        raise KeyError(model)


@dataclass(frozen=True, slots=True)
class MuxPlacement:
    """Result of Algorithm 1: the units (empty meshes omitted) and the estimated throughput."""

    units: tuple[MuxUnit, ...]
    total_throughput: float
    mesh_sizes: tuple[tuple[int, ...], ...]
    unplaced: tuple[str, ...] = ()

    def unit_of(self, model: str) -> MuxUnit:
        for u in self.units:
            if model in u.models:
                return u
        raise KeyError(f"model {model!r} is not placed")

    def colocated(self) -> list[tuple[str, ...]]:
        """Model groups that share GPUs (units with more than one model)."""
        return [u.models for u in self.units if len(u.members) > 1]


def node_splits(gpus_per_node: int) -> list[tuple[int, ...]]:
    """Ways to split one node into power-of-two meshes, largest meshes first."""
    if gpus_per_node < 1:
        raise MuxServeError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    out: list[tuple[int, ...]] = []

    def rec(left: int, cap: int, acc: tuple[int, ...]) -> None:
        if left == 0:
            out.append(acc)
            return
        for size in (8, 4, 2, 1):
            if size <= min(cap, left):
                rec(left - size, size, (*acc, size))

    rec(gpus_per_node, 8, ())
    return out


def mesh_groups(num_nodes: int, gpus_per_node: int) -> list[tuple[tuple[int, ...], ...]]:
    """Device-mesh groups: one split per node, nodes unordered (combinations with repetition)."""
    return list(itertools.combinations_with_replacement(node_splits(gpus_per_node), num_nodes))


def computation(model: MuxModel, profile: GpuProfile) -> float:
    """Sort key of Algorithm 1 ("computation requirement: model scale and popularity"):
    rate x minimum GPUs, the public code's ``rate * base_ngpu``."""
    return model.rate * base_tp(model, profile)


def _greedy(
    ctx: PlanContext,
    order: Sequence[MuxModel],
    meshes: Sequence[tuple[int, int]],
    cands: dict[str, dict[int, Candidate]],
) -> tuple[list[list[tuple[str, float]]], list[float]] | None:
    """Place models in ``order`` on ``meshes`` = [(node, size)]; None if one fits nowhere.

    Meshes are visited least-loaded first (compute assigned per GPU, then free memory), and a
    mesh replaces the incumbent only with a strictly larger delta or an equal delta on fewer
    GPUs -- the public code's visiting order and tie rule.  With Eq. 3's rate cap, every mesh
    that can meet a model's rate yields the same delta, so this order is what spreads models.
    """
    placed: list[list[tuple[str, float]]] = [[] for _ in meshes]
    current = [0.0 for _ in meshes]
    load = [0.0 for _ in meshes]  # rate x params per GPU already assigned
    free = [float(ctx.profile.usable_bytes * size) for _, size in meshes]
    for m in order:
        visit = sorted(range(len(meshes)), key=lambda i: (load[i], -free[i], i))
        best: tuple[float, int, int] | None = None  # (delta, size, index)
        for i in visit:
            size = meshes[i][1]
            cand = cands[m.name].get(size)
            if cand is None:
                continue
            est = estimate_unit(ctx, size, [*placed[i], (m.name, cand.sm)])
            if est is None:
                continue
            delta = est.throughput - current[i]
            if (
                best is None
                or delta > best[0] + 1e-9
                or (abs(delta - best[0]) <= 1e-9 and size < best[1])
            ):
                best = (delta, size, i)
        if best is None:
            return None
        delta, size, i = best
        placed[i].append((m.name, cands[m.name][size].sm))
        current[i] += delta
        load[i] += m.rate * m.arch.params / size
        free[i] -= m.arch.weight_bytes
    return placed, current


def plan_muxserve(
    models: Sequence[MuxModel],
    profile: GpuProfile,
    nodes: int | Sequence[str],
) -> MuxPlacement:
    """Algorithm 1: the mesh group and colocation with the highest estimated throughput.

    ``nodes`` is a node count or a list of node names (each with ``profile.gpus_per_node``
    GPUs).  Deterministic: same inputs, same placement.  Raises :class:`MuxServeError` when no
    mesh group can hold every model.
    """
    names = [f"node-{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
    if not names:
        raise MuxServeError("MuxServe needs at least one node")
    if not models:
        raise MuxServeError("MuxServe needs at least one model")
    seen = [m.name for m in models]
    if len(set(seen)) != len(seen):
        raise MuxServeError(f"duplicate model names in {seen}")
    ctx = PlanContext(profile, {m.name: m for m in models})
    cands = {m.name: parallel_candidates(ctx, m, profile) for m in models}
    for m in models:
        if not cands[m.name]:
            raise MuxServeError(f"model {m.name}: no TP degree leaves KV room on {profile.name}")
    order = sorted(models, key=lambda m: (-computation(m, profile), -base_tp(m, profile), m.name))
    need = max(min(cands[m.name]) for m in models)
    best: tuple[float, tuple, list, list] | None = None
    for group in mesh_groups(len(names), profile.gpus_per_node):
        meshes = [(n, size) for n, split in enumerate(group) for size in split]
        if max(s for _, s in meshes) < need or len(meshes) > len(models):
            continue
        result = _greedy(ctx, order, meshes, cands)
        if result is None:
            continue
        placed, current = result
        total = sum(current)
        if best is None or total > best[0] + 1e-9:
            best = (total, group, meshes, placed)
    if best is None:
        raise MuxServeError(
            f"no mesh group of {len(names)} x {profile.gpus_per_node} {profile.name} GPUs holds "
            f"all of {seen}"
        )
    return _build(ctx, names, best)


def _build(ctx: PlanContext, names: list[str], best: tuple) -> MuxPlacement:
    total, group, meshes, placed = best
    units: list[MuxUnit] = []
    next_gpu = [0 for _ in names]
    for (node, size), members in zip(meshes, placed, strict=True):
        start = next_gpu[node]
        next_gpu[node] += size  # splits are largest-first, so ranges are aligned
        if not members:
            continue
        est = estimate_unit(ctx, size, members)
        assert est is not None  # the greedy only kept feasible units
        unit_members = tuple(
            MuxMember(
                model=name,
                tp=size,
                sm_share=sm,
                prefill_sm_share=PREFILL_SM_SHARE,
                kv_share=est.kv_shares[k],
                kv_tokens=est.kv_tokens[k],
                batch=est.batches[k],
                expected_tpt=counted(est.tpts[k], ctx.models[name].rate),
                rate=ctx.models[name].rate,
            )
            for k, (name, sm) in enumerate(members)
        )
        units.append(
            MuxUnit(
                node=names[node],
                gpus=tuple(range(start, start + size)),
                members=unit_members,
                kv_pool_bytes_per_gpu=est.kv_pool_bytes_per_gpu,
                throughput=est.throughput,
            )
        )
    return MuxPlacement(units=tuple(units), total_throughput=total, mesh_sizes=tuple(group))
