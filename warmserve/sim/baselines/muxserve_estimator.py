"""MuxServe's throughput estimator (Eq. 2-3) and parallel candidates (Algorithm 2).

Duan et al., ICML'24 (muxserve.txt).  What the paper specifies, and what we assumed where it is
silent, is in :mod:`warmserve.sim.baselines.muxserve`'s docstring; this module holds the model
and member types, the memoised timing context of one planning run, the batch search and
``F(u, W_u)`` of a unit.  Pure and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from warmserve.policy.cluster import PolicyInputError
from warmserve.sim.hardware import GpuProfile
from warmserve.sim.model_arch import ModelArch
from warmserve.sim.perf import EngineModel, scaled_profile

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
        return satisfies(self.expected_tpt, self.rate)


def satisfies(tpt: float, rate: float) -> bool:
    """MuxServe's tolerance: a rate counts as met within min(0.5 req/s, 10 %)."""
    return tpt + min(0.5, 0.1 * tpt) >= rate


def counted(tpt: float, rate: float) -> float:
    """Eq. 3's ``min(tpt, W)``, with a rate met within MuxServe's tolerance counted as met
    (the public code sets ``tpt = rate`` once ``can_satisfy``)."""
    return rate if satisfies(tpt, rate) else min(tpt, rate)


@dataclass
class PlanContext:
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


def _standalone_max_batch(ctx: PlanContext, model: MuxModel, tp: int, kv_bytes: float) -> int:
    per_seq = _kv_per_seq_per_gpu(model, tp)
    return int(min(MAX_NUM_SEQS, kv_bytes // per_seq)) if per_seq > 0 else MAX_NUM_SEQS


def _search_batch(ctx: PlanContext, name: str, tp: int, sm: float, cap: int, others: float) -> int:
    """Smallest batch in [1, cap] whose Eq. 3 throughput meets the rate (else ``cap``).

    Throughput grows with the batch here (prefill cost is per request, decode cost sub-linear),
    so a binary search is exact.
    """
    rate = ctx.models[name].rate
    lo, hi = 1, max(1, cap)
    while lo < hi:
        mid = (lo + hi) // 2
        prefill = others + ctx.t_prefill(name, tp, mid)
        if satisfies(ctx.tpt(name, tp, sm, mid, prefill), rate):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, slots=True)
class Candidate:
    tp: int
    sm: float
    batch: int
    tpt: float
    satisfied: bool


def parallel_candidates(
    ctx: PlanContext, model: MuxModel, profile: GpuProfile
) -> dict[int, Candidate]:
    """Algorithm 2: for each TP degree, the fewest SMs whose throughput meets the rate."""
    out: dict[int, Candidate] = {}
    lowest = base_tp(model, profile)
    for tp in TP_DEGREES:
        if tp < lowest or tp > profile.gpus_per_node:
            continue
        kv = profile.usable_bytes - _weights_per_gpu(model, tp)
        cap = _standalone_max_batch(ctx, model, tp, kv)
        if cap < 1:
            continue
        best: Candidate | None = None
        for sm in DECODE_SM_SHARES:
            b = _search_batch(ctx, model.name, tp, sm, cap, 0.0)
            tpt = ctx.tpt(model.name, tp, sm, b, ctx.t_prefill(model.name, tp, b))
            cand = Candidate(tp, sm, b, tpt, satisfies(tpt, model.rate))
            if cand.satisfied:
                best = cand
                break
            if best is None or tpt > best.tpt:
                best = cand
        if best is not None:
            out[tp] = best
    return out


@dataclass(frozen=True, slots=True)
class UnitEstimate:
    throughput: float
    batches: tuple[int, ...]
    tpts: tuple[float, ...]
    kv_shares: tuple[float, ...]
    kv_tokens: tuple[int, ...]
    kv_pool_bytes_per_gpu: int


def estimate_unit(
    ctx: PlanContext, size: int, members: Sequence[tuple[str, float]]
) -> UnitEstimate | None:
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
        f = sum(counted(t, m.rate) for t, m in zip(tpts, models, strict=True))
        if f > best_f + 1e-12:
            best_f, best_bs, best_t = f, list(batches), tpts
        lagging = [
            i
            for i, (t, m) in enumerate(zip(tpts, models, strict=True))
            if not satisfies(t, m.rate) and batches[i] < caps[i]
        ]
        if not lagging:
            break
        worst = min(lagging, key=lambda i: (tpts[i] / models[i].rate, i))
        batches[worst] += 1
    kv_tokens = []
    for m, s in zip(models, shares, strict=True):
        per_token = m.arch.kv_bytes_per_token / min(size, m.arch.num_kv_heads)
        kv_tokens.append(int(pool * s // per_token))
    return UnitEstimate(
        throughput=best_f,
        batches=tuple(best_bs),
        tpts=tuple(best_t),
        kv_shares=tuple(shares),
        kv_tokens=tuple(kv_tokens),
        kv_pool_bytes_per_gpu=int(pool),
    )
