"""Prism baseline: KV-pressure-ratio placement, idle eviction, fast activation (prism.txt).

What the paper specifies and this module implements
---------------------------------------------------
* **Global placement, Algorithm 1 (§6.2).**  Sort models by SLO-weighted rate ``r/s``
  (descending); put each on the GPU with the lowest KV pressure ratio
  ``KVPR = sum(w_req_rate) / shared_kv`` (``w_req_rate = r/s``, ``shared_kv`` = memory left for
  KV), unless it already sits on a GPU whose KVPR is within the migration threshold ``tau`` of the
  best; then update the GPU's ``w_req_rate`` and ``shared_kv -= weights``.
  :func:`kvpr_placement`.
* **TP models (Appendix A.1.2).**  A TP model becomes ``tp`` entries with ``1/tp`` of its weight
  and rate; an entry never joins a GPU that already holds another entry of the same model (next
  lowest KVPR instead).
* **Eviction (§6.2).**  A model idle longer than an empirical threshold is evicted, only when
  GPU memory is needed, larger SLOs first.  :func:`idle_evictions`.
* **Activation (§6.2, §5.2).**  An evicted model that receives a request is reactivated on the
  GPU(s) with the lowest KVPR (:func:`choose_activation_gpus`); activation takes an engine from
  the pre-initialised pool (no engine init, no process start) and loads the weights with
  parallel chunked loading (:func:`activation_s`).

Where the paper is silent (assumptions, and why)
------------------------------------------------
* **Memory feasibility.**  Algorithm 1 never checks that ``shared_kv`` stays positive.  Real
  Prism maps weights into physical GPU memory, so we only consider GPUs where the weights fit
  with ``min_kv_bytes`` left for KV; a model that fits nowhere is returned in ``unplaced`` (the
  simulator starts it by activation after evicting idle models).  Without this the placement
  could over-commit memory.
* **TP entries on one node.**  A TP group needs NVLink, so all entries of one model go to GPUs of
  the same node: we pick the node whose ``tp`` lowest-KVPR GPUs (memory permitting) have the
  lowest sum of KVPR after placement -- A.1.2's "distinct GPUs" rule plus locality.
* **Idle threshold.**  "Empirical, from the idle-interval distribution": we default to a fixed
  ``idle_timeout_s`` the caller chooses and offer :func:`idle_threshold_s`, the ``quantile`` of a
  model's inter-arrival gaps (floored at 10 s, the shortest idle interval Prism's §3.1 counts).
* **Activation speed.**  §5.2/Figure 9 report, on H100 from pageable host memory, 0.7 s for an
  8B model, 1.3 s for a 14B model and 1.5 s for a 70B model at TP=8.  Those are ~23 GB/s for one
  GPU (16.1 GB / 0.7 s, 29.6 GB / 1.3 s) and ~94 GB/s aggregate for the node (141 GB / 1.5 s).
  ``mode="measured"`` (default) uses ``min(23 GB/s, 94 GB/s / tp)`` per GPU.  ``mode="links"``
  instead assumes Prism's chunked loading saturates every PCIe link of the node and forwards over
  NVLink: per target GPU ``min(gpus_per_node * host_to_gpu_bw / tp,
  host_to_gpu_bw + gpu_to_gpu_bw)`` -- an upper bound with pinned host memory as in WarmServe's
  testbed; this mode adds the profile's ``activation_s`` (binding an engine to weights), which
  the measured totals already contain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from warmserve.sim.baselines.prism_placement import (
    PrismError,
    PrismGpu,
    PrismModel,
    choose_activation_gpus,
    kvpr_placement,
)
from warmserve.sim.perf import EngineModel
from warmserve.sim.sharing import busy_fraction, sharing_slowdown

if TYPE_CHECKING:
    from warmserve.sim.model import Prepared, StaticInstance


# Prism §5.2 / Figure 9 (H100, pageable host memory); see the module docstring.
PRISM_SINGLE_GPU_LOAD_BW = 23e9
PRISM_NODE_LOAD_BW = 94e9
MIN_IDLE_S = 10.0  # Prism §3.1 counts idle intervals longer than 10 s


# ----------------------------------------------------------------------------- eviction


@dataclass(frozen=True, slots=True)
class ResidentModel:
    """A model resident on GPUs, as the eviction rule sees it."""

    name: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    slo_s: float
    last_request_s: float
    inflight: int = 0


def idle_threshold_s(gaps_s: Sequence[float], quantile: float = 0.9) -> float:
    """Empirical idle threshold: the ``quantile`` of observed inter-arrival gaps, at least 10 s.

    Assumption (Prism says only "empirical, from the idle interval distribution"): a gap longer
    than most gaps marks the model idle.
    """
    if not 0 < quantile <= 1:
        raise PrismError(f"quantile must be in (0, 1], got {quantile}")
    clean = sorted(float(g) for g in gaps_s if g >= 0)
    if not clean:
        return MIN_IDLE_S
    k = min(len(clean) - 1, max(0, math.ceil(quantile * len(clean)) - 1))
    return max(MIN_IDLE_S, clean[k])


def idle_evictions(
    resident: Sequence[ResidentModel],
    now_s: float,
    idle_timeout_s: float,
    needed_bytes: Mapping[int, float],
) -> list[str]:
    """Models to evict so each GPU ``g`` frees ``needed_bytes[g]``; only idle models qualify.

    A model qualifies when it has no request in flight and has been idle longer than
    ``idle_timeout_s``.  Prism evicts only under memory pressure, larger SLOs first; among equal
    SLOs we evict the longest-idle first (assumption).  Returns ``[]`` when no GPU needs memory;
    evicts nothing on a GPU whose need the idle models cannot cover (partial evictions would
    free memory without enabling the start).
    """
    if idle_timeout_s < 0:
        raise PrismError(f"idle_timeout_s must be >= 0, got {idle_timeout_s}")
    need = {g: b for g, b in needed_bytes.items() if b > 0}
    if not need:
        return []
    idle = [r for r in resident if r.inflight == 0 and now_s - r.last_request_s > idle_timeout_s]
    idle.sort(key=lambda r: (-r.slo_s, r.last_request_s, r.name))
    coverable = {g for g in need if sum(r.bytes_per_gpu for r in idle if g in r.gpus) >= need[g]}
    if coverable != set(need):
        return []
    left = dict(need)
    out: list[str] = []
    for r in idle:
        if not any(left.get(g, 0) > 0 for g in r.gpus):
            continue
        out.append(r.name)
        for g in r.gpus:
            if g in left:
                left[g] -= r.bytes_per_gpu
        if all(v <= 0 for v in left.values()):
            break
    return out


# ----------------------------------------------------------------------------- activation


def plan_activation(
    gpus: Sequence[PrismGpu],
    residents: Sequence[ResidentModel],
    model: PrismModel,
    now_s: float,
    idle_timeout_s: float,
    *,
    gpus_per_node: int = 8,
    min_kv_bytes: float = 0.0,
    exclude: Sequence[int] = (),
) -> tuple[tuple[int, ...], list[str]] | None:
    """Where to activate ``model`` now and which idle residents to evict first (Prism §6.2).

    ``gpus`` is the live per-GPU state in global index order (``gpus[i].index == i``).  First
    the lowest-KVPR GPU(s) whose free memory holds the weights (:func:`choose_activation_gpus`);
    failing that, the same choice as if every idle resident (:func:`idle_evictions`' rule) were
    gone, then exactly the evictions that free the chosen GPUs.  GPUs in ``exclude`` (e.g. those
    already holding this model) are never chosen.  ``None``: no room even after evictions.
    """
    for i, g in enumerate(gpus):
        if g.index != i:
            raise PrismError(f"gpus must be in global index order, got index {g.index} at {i}")
    banned = set(exclude)

    def masked(state: Sequence[PrismGpu]) -> list[PrismGpu]:
        return [
            PrismGpu(g.index, g.node, g.models, g.w_req_rate, -math.inf) if g.index in banned
            else g
            for g in state
        ]

    kw = {"gpus_per_node": gpus_per_node, "min_kv_bytes": min_kv_bytes}
    direct = choose_activation_gpus(masked(gpus), model, **kw)
    if direct is not None:
        return direct, []
    idle = [
        r for r in residents if r.inflight == 0 and now_s - r.last_request_s > idle_timeout_s
    ]
    if not idle:
        return None
    freed = {g.index: 0.0 for g in gpus}
    for r in idle:
        for g in r.gpus:
            freed[g] += r.bytes_per_gpu
    hypo = [
        PrismGpu(g.index, g.node, g.models, g.w_req_rate, g.shared_kv + freed[g.index])
        for g in gpus
    ]
    group = choose_activation_gpus(masked(hypo), model, **kw)
    if group is None:
        return None
    part = model.weight_bytes / model.tp
    need = {g: part + min_kv_bytes - gpus[g].shared_kv for g in group}
    evict = idle_evictions(residents, now_s, idle_timeout_s, need)
    if not evict and any(v > 0 for v in need.values()):
        return None
    return group, evict


def activation_s(engine: EngineModel, mode: str = "measured") -> float:
    """Seconds to activate an evicted model on a pooled engine (Prism §5.2), see module doc."""
    p = engine.profile
    per_gpu_bytes = engine.weight_bytes_per_gpu
    if mode == "measured":  # Figure 9 totals already include binding the pooled engine
        return per_gpu_bytes / min(PRISM_SINGLE_GPU_LOAD_BW, PRISM_NODE_LOAD_BW / engine.tp)
    if mode == "links":
        bw = min(p.gpus_per_node * p.host_to_gpu_bw / engine.tp, p.host_to_gpu_bw + p.gpu_to_gpu_bw)
        return p.startup.activation_s + per_gpu_bytes / bw
    raise PrismError(f"activation mode must be 'measured' or 'links', got {mode!r}")


# ----------------------------------------------------------------------------- simulator glue

DEFAULT_SLO_S = 1.0  # the scenario carries no per-model SLOs: equal SLOs, so r/s orders by rate
# Prism's paper states no batch limit; its engine (SGLang + kvcached) admits requests while KV
# pages are free, and WarmServe runs every system on vLLM (§7.1), whose default max_num_seqs is
# 256.  So a Prism instance is bounded by 256 running requests and, in practice, by its KV room.
MAX_NUM_SEQS = 256


def static_instances(
    prep: Prepared, *, slo_s: float = DEFAULT_SLO_S, max_batch: int | None = None
) -> list[StaticInstance]:
    """Prism's initial placement as always-on instances for a simulator run.

    ``max_batch``: the batch cap of every instance; ``None`` (the default, for a fair
    comparison) gives each model the scenario's batch, the paper's 32 for every system;
    :data:`MAX_NUM_SEQS` is Prism's own engine default (the ``prism-256`` variant).

    Placement: :func:`kvpr_placement` from average rates (oracle period averages, see
    ``muxserve.average_loads``) with every model at its scenario TP, at least one average
    request's KV left per GPU.  Each instance's KV capacity is its share of the GPU's leftover
    memory in proportion to its ``r/s`` (kvcached shares the pool on demand; the static share is
    its demand-weighted expectation), a batch cap (above), and the dynamic
    sharing slowdown for time-shared GPUs (:mod:`warmserve.sim.sharing`).  This is the
    layout at t = 0; the event loop then evicts and activates (:func:`plan_activation` with
    :func:`runtime_facts`; docs/simulator.md, "Prism").
    """
    from warmserve.sim.baselines.muxserve import average_loads
    from warmserve.sim.model import StaticInstance

    sc = prep.scenario
    loads = average_loads(prep)
    runtimes = {m.spec.name: m for m in prep.models if m.placeable}
    per_gpu = prep.profile.usable_bytes
    models = [
        PrismModel(name, rt.spec.weight_bytes, loads[name].rate, slo_s, tp=rt.spec.tp)
        for name, rt in runtimes.items()
    ]
    min_kv = max(
        rt.engine.kv_bytes_per_token_per_gpu
        * (loads[name].prompt_tokens + loads[name].output_tokens)
        for name, rt in runtimes.items()
    )
    placement = kvpr_placement(
        models,
        sc.nodes * sc.gpus_per_node,
        per_gpu,
        gpus_per_node=sc.gpus_per_node,
        min_kv_bytes=min_kv,
    )
    by_name = {m.name: m for m in models}
    cap = {name: max_batch or rt.spec.max_batch for name, rt in runtimes.items()}
    busy = {
        name: busy_fraction(runtimes[name].engine, loads[name], cap[name])
        for name in placement.assignment
    }
    out: list[StaticInstance] = []
    for name, gpus in sorted(placement.assignment.items()):
        rt = runtimes[name]
        share = min(
            by_name[name].w_req_rate / placement.gpus[g].w_req_rate
            if placement.gpus[g].w_req_rate > 0
            else 1.0 / len(placement.gpus[g].models)
            for g in gpus
        )
        free = min(placement.gpus[g].shared_kv for g in gpus) * share
        kv_tokens = int(free // rt.engine.kv_bytes_per_token_per_gpu)
        others = {o for g in gpus for o in placement.gpus[g].models if o != name}
        slow = sharing_slowdown(
            rt.engine, rt.engine, loads[name], cap[name], [busy[o] for o in sorted(others)]
        )
        node = gpus[0] // sc.gpus_per_node
        out.append(
            StaticInstance(
                model=name,
                node=f"node-{node}",
                gpus=tuple(g % sc.gpus_per_node for g in gpus),
                slowdown=slow,
                kv_cap_tokens=max(0, kv_tokens),
                max_batch=cap[name],
                config_slowdown=1.0,  # same engine, time-shared: only the neighbours slow it
            )
        )
    return out


@dataclass(frozen=True)
class PrismFacts:
    """What the event loop needs to run Prism's eviction and activation (§6.2) for one run.

    ``rates``: each model's average rate (the same oracle average the initial placement uses);
    ``idle_timeout_s``: each model's empirical idle threshold (:func:`idle_threshold_s` of its
    inter-arrival gaps); ``activation_s``: each model's activation time on a pooled engine
    (:func:`activation_s`); ``min_kv_bytes``: KV room an activation must leave on each GPU (one
    average request of the largest model, as the initial placement); ``usable_bytes``: memory
    per GPU for weights + KV; ``max_batch``: the batch cap of an activated instance (one for
    all models, or per model).
    """

    rates: Mapping[str, float]
    idle_timeout_s: Mapping[str, float]
    activation_s: Mapping[str, float]
    min_kv_bytes: float
    usable_bytes: float
    slo_s: float = DEFAULT_SLO_S
    max_batch: int | Mapping[str, int] = MAX_NUM_SEQS

    def batch_of(self, model: str) -> int:
        return self.max_batch if isinstance(self.max_batch, int) else self.max_batch[model]


def runtime_facts(
    prep: Prepared, *, slo_s: float = DEFAULT_SLO_S, max_batch: int | None = None
) -> PrismFacts:
    """:class:`PrismFacts` for a simulator run (see :func:`static_instances` for the averages
    and ``max_batch``)."""
    import numpy as np

    from warmserve.sim.baselines.muxserve import average_loads

    loads = average_loads(prep)
    runtimes = {m.spec.name: m for m in prep.models if m.placeable}
    idle: dict[str, float] = {}
    for m in prep.models:
        arr = np.sort(prep.model_period(m.idx)[0])
        idle[m.spec.name] = idle_threshold_s(np.diff(arr).tolist()) if arr.size > 1 else MIN_IDLE_S
    min_kv = max(
        (
            rt.engine.kv_bytes_per_token_per_gpu
            * (loads[name].prompt_tokens + loads[name].output_tokens)
            for name, rt in runtimes.items()
        ),
        default=0.0,
    )
    return PrismFacts(
        rates={name: loads[name].rate for name in runtimes},
        idle_timeout_s=idle,
        activation_s={name: activation_s(rt.engine) for name, rt in runtimes.items()},
        min_kv_bytes=min_kv,
        usable_bytes=float(prep.profile.usable_bytes),
        slo_s=slo_s,
        max_batch=max_batch or {name: rt.spec.max_batch for name, rt in runtimes.items()},
    )
