"""MuxServe baseline: static spatial-temporal colocation (Duan et al., ICML'24; muxserve.txt).

What the paper specifies and this module implements
---------------------------------------------------
* **Algorithm 2 (parallel candidates).**  For every model and every TP degree ``p`` it can use,
  the fewest SMs (CUDA MPS percentage) whose estimated throughput meets the model's rate; one
  candidate per ``p``.
* **Algorithm 1 (enumeration-based greedy placement).**  Enumerate device-mesh groups (how each
  node's GPUs are split into meshes), sort models by computation requirement (descending),
  put each on the mesh whose unit throughput ``F`` grows the most, and keep the mesh group with
  the largest total ``F``.  Pruning as in §3.2: meshes stay inside a node, and the workload
  bounds the mesh sizes (a group needs a mesh large enough for the biggest model and no more
  meshes than models).
* **Eq. 3 (throughput estimator).**  ``tpt(m) = min(b_m / (sum_i t_p^i + t_d^m * l_o^m), W_m)``:
  prefills of the unit's models run one after another, decodes run concurrently; the batch
  size ``b_m`` is found by search so the rate is met.
* **Unified KV cache and ADBS.**  Colocated models share one KV pool; token-block quotas are
  proportional to ``rate x KV bytes per token`` (MuxServe's public placement code,
  ``hao-ai-lab/MuxServe: muxserve/muxsched/placement.py::estimate_mesh_throughput``).

Where the paper is silent (assumptions, and why)
------------------------------------------------
* ``t_p``/``t_d`` come from our roofline (:mod:`warmserve.sim.perf`) instead of MuxServe's
  offline profiling tables: same role, and grounded in the same profile as every other system.
  Decode uses the average context ``prompt + output/2``.
* SM shares: decode MPS candidates 30-90 % in steps of 10 and prefill at 100 %, as in the public
  code (``estimate_mps`` skips > 90; ``prefill_mps=100``).  Compute throughput scales with the
  SM share; HBM bandwidth does not (MuxServe Fig. 3: decode latency barely changes between 30 %
  and 100 % of SMs), so the estimator, like MuxServe's, ignores bandwidth contention.
* The smallest TP a model may use (``base_tp``) is the smallest power of two whose weight shard
  is at most half the GPU's memory; this reproduces the public code's table (7B/13B -> 1,
  30B -> 2, 65B -> 4).
* A model that no SM share lets meet its rate keeps the share with the highest throughput
  (the public code does the same); a model that fits no mesh of a group makes that group
  infeasible (the pseudo-code would dereference ``None``).
* Ties in ``delta`` go to the smaller mesh, then the earlier one (public code); ties between
  mesh groups go to the first enumerated (``[8]`` before ``[4, 4]`` ...), i.e. the largest
  meshes, which is also the public code's enumeration order.
* The batch search follows the public code: start every model at its stand-alone batch size,
  then grow the batch of the model furthest below its rate until all are met or capped by the
  KV quota / ``max_num_seqs`` (256).

Runtime slowdown model (what the simulator applies to colocated models)
-----------------------------------------------------------------------
:func:`static_instances` hands the simulator each model's configuration factors (prefill jobs at
all SMs, decode jobs at their MPS share, relative to the model's own engine) and the simulator
multiplies them by one plus the number of colocated models busy at that moment
(:func:`warmserve.sim.sharing.dynamic_slowdown`); the batch cap is MuxServe's own
(:func:`adbs_max_num_seqs`).  The finer per-step functions below are not used by the loop:
Physics the estimator ignores but a real GPU does not: :func:`decode_engine` times a decode step
with the model's SM share of tensor throughput and an equal share of HBM bandwidth among the
unit's models that are decoding at that moment; :func:`prefill_engine` times a prefill with all
SMs (MuxServe prioritises prefill, ADBS Algorithm 3) and the same HBM split.  Prefills of one
unit are serialized (one prefill job at a time, the ``sum_i t_p^i`` term).  KV capacity of a
model is its quota of the unit pool (:attr:`MuxMember.kv_tokens`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from warmserve.policy.cluster import PolicyInputError
from warmserve.sim.hardware import GpuProfile
from warmserve.sim.perf import EngineModel, ModelArch, scaled_profile
from warmserve.sim.sharing import (
    Load,
    busy_fraction,
    phase_factors,
    sharing_slowdown,
)

if TYPE_CHECKING:
    from warmserve.sim.model import Prepared, StaticInstance

DECODE_SM_SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PREFILL_SM_SHARE = 1.0
MAX_NUM_SEQS = 256  # vLLM default max_num_seqs, also MuxServe's YamlBuilder default
TP_DEGREES = (1, 2, 4, 8)


class MuxServeError(PolicyInputError):
    """Bad input to the MuxServe planner; the message names the field."""


@dataclass(frozen=True, slots=True)
class MuxModel:
    """A model as MuxServe sees it: shapes, average rate (req/s) and average lengths."""

    name: str
    arch: ModelArch
    rate: float
    avg_prompt_tokens: float
    avg_output_tokens: float

    def __post_init__(self) -> None:
        if not self.name:
            raise MuxServeError("a MuxServe model needs a name")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise MuxServeError(f"model {self.name}: rate must be >= 0, got {self.rate!r}")
        if not self.avg_prompt_tokens >= 1:
            raise MuxServeError(f"model {self.name}: avg_prompt_tokens must be >= 1")
        if not self.avg_output_tokens >= 1:
            raise MuxServeError(f"model {self.name}: avg_output_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class MuxMember:
    """One model inside a unit.

    ``sm_share`` is the decode job's MPS fraction, ``prefill_sm_share`` the prefill job's;
    ``kv_share`` the fraction of the unit's KV pool the model's quota holds (``kv_tokens``
    tokens); ``batch`` the batch size the estimator chose (used as vLLM ``max_num_seqs``);
    ``expected_tpt`` its Eq. 3 throughput in req/s.
    """

    model: str
    tp: int
    sm_share: float
    prefill_sm_share: float
    kv_share: float
    kv_tokens: int
    batch: int
    expected_tpt: float
    rate: float

    @property
    def satisfied(self) -> bool:
        return _satisfies(self.expected_tpt, self.rate)


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


# ----------------------------------------------------------------------------- estimator


def _satisfies(tpt: float, rate: float) -> bool:
    """MuxServe's tolerance: a rate counts as met within min(0.5 req/s, 10 %)."""
    return tpt + min(0.5, 0.1 * tpt) >= rate


def _counted(tpt: float, rate: float) -> float:
    """Eq. 3's ``min(tpt, W)``, with a rate met within MuxServe's tolerance counted as met
    (the public code sets ``tpt = rate`` once ``can_satisfy``)."""
    return rate if _satisfies(tpt, rate) else min(tpt, rate)


@dataclass
class _Ctx:
    """Memoised timings for one planning run (pure: derived only from the inputs)."""

    profile: GpuProfile
    models: dict[str, MuxModel]
    cache: dict[tuple, float] = field(default_factory=dict)

    def engine(self, name: str, tp: int, compute_share: float) -> EngineModel:
        prof = scaled_profile(self.profile, compute_share, 1.0)
        return EngineModel(prof, self.models[name].arch, tp)

    def t_prefill(self, name: str, tp: int, batch: int) -> float:
        key = ("p", name, tp, batch)
        if key not in self.cache:
            m = self.models[name]
            eng = self.engine(name, tp, PREFILL_SM_SHARE)
            self.cache[key] = eng.prefill_batch_s(batch, max(1, round(m.avg_prompt_tokens)))
        return self.cache[key]

    def t_decode(self, name: str, tp: int, sm: float, batch: int) -> float:
        key = ("d", name, tp, sm, batch)
        if key not in self.cache:
            m = self.models[name]
            ctx = round(batch * (m.avg_prompt_tokens + m.avg_output_tokens / 2))
            self.cache[key] = self.engine(name, tp, sm).decode_step_s(batch, ctx)
        return self.cache[key]

    def tpt(self, name: str, tp: int, sm: float, batch: int, prefill_sum: float) -> float:
        """Eq. 3 without the rate cap: ``b / (sum t_p + t_d * l_o)``."""
        m = self.models[name]
        return batch / (prefill_sum + self.t_decode(name, tp, sm, batch) * m.avg_output_tokens)


def _weights_per_gpu(model: MuxModel, tp: int) -> float:
    return model.arch.weight_bytes / tp


def _kv_per_seq_per_gpu(model: MuxModel, tp: int) -> float:
    per_token = model.arch.kv_bytes_per_token / min(tp, model.arch.num_kv_heads)
    return per_token * (model.avg_prompt_tokens + model.avg_output_tokens)


def base_tp(model: MuxModel, profile: GpuProfile) -> int:
    """Smallest TP whose weight shard is at most half a GPU's memory (public-code table)."""
    for tp in TP_DEGREES:
        if tp <= profile.gpus_per_node and _weights_per_gpu(model, tp) <= profile.hbm_bytes / 2:
            return tp
    raise MuxServeError(
        f"model {model.name}: weights do not fit on {profile.gpus_per_node} {profile.name} GPUs"
    )


def _standalone_max_batch(ctx: _Ctx, model: MuxModel, tp: int, kv_bytes: float) -> int:
    per_seq = _kv_per_seq_per_gpu(model, tp)
    return int(min(MAX_NUM_SEQS, kv_bytes // per_seq)) if per_seq > 0 else MAX_NUM_SEQS


def _search_batch(ctx: _Ctx, name: str, tp: int, sm: float, cap: int, others: float) -> int:
    """Smallest batch in [1, cap] whose Eq. 3 throughput meets the rate (else ``cap``).

    Throughput grows with the batch here (prefill cost is per request, decode cost sub-linear),
    so a binary search is exact.
    """
    rate = ctx.models[name].rate
    lo, hi = 1, max(1, cap)
    while lo < hi:
        mid = (lo + hi) // 2
        prefill = others + ctx.t_prefill(name, tp, mid)
        if _satisfies(ctx.tpt(name, tp, sm, mid, prefill), rate):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, slots=True)
class _Candidate:
    tp: int
    sm: float
    batch: int
    tpt: float
    satisfied: bool


def parallel_candidates(ctx: _Ctx, model: MuxModel, profile: GpuProfile) -> dict[int, _Candidate]:
    """Algorithm 2: for each TP degree, the fewest SMs whose throughput meets the rate."""
    out: dict[int, _Candidate] = {}
    lowest = base_tp(model, profile)
    for tp in TP_DEGREES:
        if tp < lowest or tp > profile.gpus_per_node:
            continue
        kv = profile.usable_bytes - _weights_per_gpu(model, tp)
        cap = _standalone_max_batch(ctx, model, tp, kv)
        if cap < 1:
            continue
        best: _Candidate | None = None
        for sm in DECODE_SM_SHARES:
            b = _search_batch(ctx, model.name, tp, sm, cap, 0.0)
            tpt = ctx.tpt(model.name, tp, sm, b, ctx.t_prefill(model.name, tp, b))
            cand = _Candidate(tp, sm, b, tpt, _satisfies(tpt, model.rate))
            if cand.satisfied:
                best = cand
                break
            if best is None or tpt > best.tpt:
                best = cand
        if best is not None:
            out[tp] = best
    return out


@dataclass(frozen=True, slots=True)
class _UnitEstimate:
    throughput: float
    batches: tuple[int, ...]
    tpts: tuple[float, ...]
    kv_shares: tuple[float, ...]
    kv_tokens: tuple[int, ...]
    kv_pool_bytes_per_gpu: int


def estimate_unit(
    ctx: _Ctx, size: int, members: Sequence[tuple[str, float]]
) -> _UnitEstimate | None:
    """F(u, W_u) (Eq. 2-3) for models ``members`` = [(name, decode sm share)] on ``size`` GPUs.

    Returns ``None`` when the weights leave no KV room for one average request per model.
    """
    models = [ctx.models[n] for n, _ in members]
    weights = sum(_weights_per_gpu(m, size) for m in models)
    pool = ctx.profile.usable_bytes - weights
    per_seq = [_kv_per_seq_per_gpu(m, size) for m in models]
    if pool < sum(per_seq):
        return None
    # Quotas proportional to rate x KV bytes/token (public code), after a floor of one average
    # request per model so that a model with no expected traffic can still serve one.
    demand = [m.rate * m.arch.kv_bytes_per_token for m in models]
    total = sum(demand)
    spare = pool - sum(per_seq)
    shares = [
        (ps + spare * (d / total if total > 0 else 1.0 / len(models))) / pool
        for ps, d in zip(per_seq, demand, strict=True)
    ]
    caps = [
        max(1, min(MAX_NUM_SEQS, int(pool * s // ps)))
        for s, ps in zip(shares, per_seq, strict=True)
    ]
    batches = []
    for (name, sm), cap in zip(members, caps, strict=True):
        batches.append(_search_batch(ctx, name, size, sm, cap, 0.0))

    def evaluate(bs: list[int]) -> list[float]:
        prefill = sum(ctx.t_prefill(n, size, b) for (n, _), b in zip(members, bs, strict=True))
        return [ctx.tpt(n, size, sm, b, prefill) for (n, sm), b in zip(members, bs, strict=True)]

    best_f, best_bs, best_t = -1.0, list(batches), evaluate(batches)
    for _ in range(sum(caps) + 1):  # each iteration grows one batch: bounded by sum(caps)
        tpts = evaluate(batches)
        f = sum(_counted(t, m.rate) for t, m in zip(tpts, models, strict=True))
        if f > best_f + 1e-12:
            best_f, best_bs, best_t = f, list(batches), tpts
        lagging = [
            i
            for i, (t, m) in enumerate(zip(tpts, models, strict=True))
            if not _satisfies(t, m.rate) and batches[i] < caps[i]
        ]
        if not lagging:
            break
        worst = min(lagging, key=lambda i: (tpts[i] / models[i].rate, i))
        batches[worst] += 1
    kv_tokens = []
    for m, s in zip(models, shares, strict=True):
        per_token = m.arch.kv_bytes_per_token / min(size, m.arch.num_kv_heads)
        kv_tokens.append(int(pool * s // per_token))
    return _UnitEstimate(
        throughput=best_f,
        batches=tuple(best_bs),
        tpts=tuple(best_t),
        kv_shares=tuple(shares),
        kv_tokens=tuple(kv_tokens),
        kv_pool_bytes_per_gpu=int(pool),
    )


# ----------------------------------------------------------------------------- placement

_SPLITS_8 = (
    (8,),
    (4, 4),
    (4, 2, 2),
    (4, 2, 1, 1),
    (4, 1, 1, 1, 1),
    (2, 2, 2, 2),
    (2, 2, 2, 1, 1),
    (2, 2, 1, 1, 1, 1),
    (2, 1, 1, 1, 1, 1, 1),
    (1, 1, 1, 1, 1, 1, 1, 1),
)


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
    ctx: _Ctx,
    order: Sequence[MuxModel],
    meshes: Sequence[tuple[int, int]],
    cands: dict[str, dict[int, _Candidate]],
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
    ctx = _Ctx(profile, {m.name: m for m in models})
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


def _build(ctx: _Ctx, names: list[str], best: tuple) -> MuxPlacement:
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
                expected_tpt=_counted(est.tpts[k], ctx.models[name].rate),
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


# ----------------------------------------------------------------------------- runtime physics


def decode_engine(
    profile: GpuProfile, arch: ModelArch, member: MuxMember, active_decoders: int
) -> EngineModel:
    """Engine model of ``member``'s decode job while ``active_decoders`` colocated models of its
    unit are decoding (itself included): its SM share of compute, an equal HBM share."""
    if active_decoders < 1:
        raise MuxServeError(f"active_decoders must be >= 1, got {active_decoders}")
    prof = scaled_profile(profile, member.sm_share, 1.0 / active_decoders)
    return EngineModel(prof, arch, member.tp)


def prefill_engine(
    profile: GpuProfile, arch: ModelArch, member: MuxMember, active_decoders: int
) -> EngineModel:
    """Engine model of ``member``'s prefill job (all SMs; HBM shared with ``active_decoders``
    other models' decode jobs running beside it, 0 if none)."""
    if active_decoders < 0:
        raise MuxServeError(f"active_decoders must be >= 0, got {active_decoders}")
    prof = scaled_profile(profile, member.prefill_sm_share, 1.0 / (1 + active_decoders))
    return EngineModel(prof, arch, member.tp)


def power_law_rates(total_rate: float, alpha: float, count: int) -> list[float]:
    """Per-model rates ``total * i^-alpha / sum_j j^-alpha`` (rank 1 most popular): the
    power-law popularity of MuxServe §4.2 and WarmServe §7.1."""
    if count < 1:
        raise MuxServeError(f"count must be >= 1, got {count}")
    if total_rate < 0 or alpha < 0:
        raise MuxServeError("total_rate and alpha must be >= 0")
    weights = [(i + 1) ** -alpha for i in range(count)]
    s = sum(weights)
    return [total_rate * w / s for w in weights]


# ----------------------------------------------------------------------------- simulator glue


def average_loads(prep: Prepared) -> dict[str, Load]:
    """Average rate and lengths of each model over the simulated period (an oracle average:
    MuxServe plans from average rates "estimated from history traffic", §3.1 footnote; using
    the period itself is the most favourable estimate for the baseline)."""
    dur = prep.scenario.duration_s
    out: dict[str, Load] = {}
    for m in prep.models:
        f = prep.facts[m.idx]
        if f.requests == 0:
            out[m.spec.name] = Load(0.0, 1.0, 1.0)
            continue
        out[m.spec.name] = Load(
            f.requests / dur, max(1.0, f.mean_input), max(1.0, f.mean_output)
        )
    return out


def adbs_max_num_seqs(kv_tokens: int, load: Load) -> int:
    """The batch cap MuxServe's runtime gives a model: as many average-length requests as its
    KV quota holds, at most the engine's ``max_num_seqs`` (256).

    This is what MuxServe itself configures, not the scenario's batch: its ADBS scheduler
    (public code ``muxsched/scheduler.py::init_max_num_seqs``) sets each model's
    ``max_num_seqs`` to ``quota blocks // blocks per average sequence`` (the quota proportional
    to rate x KV bytes per token, our :attr:`MuxMember.kv_tokens`), and the engine processes run
    with the YAML's top-level ``max_num_seqs: 256`` (``arg_utils.py`` reads the per-model value
    with ``getattr`` on a dict, so the estimator's ``batch`` never reaches the engine).  ADBS
    later moves blocks between models every 8 s (``adapt_max_num_seqs``); we keep the initial
    quota (docs/simulator.md, "Baselines").
    """
    if kv_tokens < 1:
        raise MuxServeError(f"kv_tokens must be >= 1, got {kv_tokens}")
    per_seq = max(1, math.ceil(load.prompt_tokens + load.output_tokens))
    return max(1, min(MAX_NUM_SEQS, kv_tokens // per_seq))


def static_instances(prep: Prepared, *, own_batch: bool = False) -> list[StaticInstance]:
    """MuxServe's always-on instances for a simulator run: one per model, on its unit's GPUs,
    with the unit's KV quota, a batch cap and a sharing slowdown (:mod:`warmserve.sim.sharing`).

    Batch cap: MuxServe's own (:func:`adbs_max_num_seqs`, up to 256) capped at the scenario's
    batch (the paper's 32) by default, issue 12's fair comparison; ``own_batch=True`` keeps
    MuxServe's own (the ``muxserve-adbs`` variant, what WarmServe §7.1 ran)."""
    from warmserve.sim.model import StaticInstance

    sc = prep.scenario
    profile = replace(prep.profile, gpus_per_node=sc.gpus_per_node)
    loads = average_loads(prep)
    runtimes = {m.spec.name: m for m in prep.models if m.placeable}
    models = [
        MuxModel(
            name,
            rt.engine.arch,
            loads[name].rate,
            loads[name].prompt_tokens,
            loads[name].output_tokens,
        )
        for name, rt in runtimes.items()
    ]
    placement = plan_muxserve(models, profile, [f"node-{n}" for n in range(sc.nodes)])
    out: list[StaticInstance] = []
    for unit in placement.units:
        busy = {}
        batch = {m.model: adbs_max_num_seqs(m.kv_tokens, loads[m.model]) for m in unit.members}
        if not own_batch:
            batch = {k: min(v, runtimes[k].spec.max_batch) for k, v in batch.items()}
        for mem in unit.members:
            rt = runtimes[mem.model]
            eng = EngineModel(scaled_profile(profile, mem.sm_share, 1.0), rt.engine.arch, mem.tp)
            busy[mem.model] = (eng, busy_fraction(eng, loads[mem.model], batch[mem.model]))
        for mem in unit.members:
            rt = runtimes[mem.model]
            eng, _ = busy[mem.model]
            others = [u for name, (_, u) in busy.items() if name != mem.model]
            slow = sharing_slowdown(rt.engine, eng, loads[mem.model], batch[mem.model], others)
            pre = EngineModel(
                scaled_profile(profile, mem.prefill_sm_share, 1.0), rt.engine.arch, mem.tp
            )
            pre_f, dec_f = phase_factors(rt.engine, pre, eng, loads[mem.model], batch[mem.model])
            out.append(
                StaticInstance(
                    model=mem.model,
                    node=unit.node,
                    gpus=unit.gpus,
                    slowdown=slow,
                    kv_cap_tokens=mem.kv_tokens,
                    max_batch=batch[mem.model],
                    config_slowdown=dec_f,
                    prefill_config_slowdown=pre_f,
                )
            )
    return out
