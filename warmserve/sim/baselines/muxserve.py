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

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from warmserve.sim.baselines.muxserve_estimator import (
    MAX_NUM_SEQS,
    MuxMember,
    MuxModel,
    MuxServeError,
)
from warmserve.sim.baselines.muxserve_placement import plan_muxserve
from warmserve.sim.hardware import GpuProfile
from warmserve.sim.model_arch import ModelArch
from warmserve.sim.perf import EngineModel, scaled_profile
from warmserve.sim.sharing import (
    Load,
    busy_fraction,
    phase_factors,
    sharing_slowdown,
)

if TYPE_CHECKING:
    from warmserve.sim.model import Prepared, StaticInstance


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
    batch (the paper's 32) by default, for a fair comparison; ``own_batch=True`` keeps
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
