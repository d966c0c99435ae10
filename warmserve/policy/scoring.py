"""Prewarm replica counts and scores (WarmServe §5.2, Eq. 5-8).

Given a model with K active instances, max batch B and predicted average and peak load
L_A, L_P (requests in flight):

    N_basic = max(ceil(L_A / B) - K, 0)                                   (Eq. 5)
    N_burst = max(ceil(L_P / B) - N_basic - K, 0)                          (Eq. 6)
    S_basic(i) = exp(-i / (N_basic + N_burst)) * T_c                       (Eq. 7)
    S_burst(i) = exp(-(N_basic + i) / (N_basic + N_burst)) * T_c * (L_P - L_A) / L_A   (Eq. 8)

with i the zero-based rank within the category.

Deviations, and why:
- **L_A = 0** (Eq. 8 divides by it).  With no average load, any predicted peak is pure burst,
  so the burstiness factor (L_P - L_A)/L_A is unbounded.  We cap the factor at
  ``MAX_BURSTINESS`` (and use the cap whenever L_A is below one request in flight, i.e. the
  factor is computed as (L_P - L_A) / max(L_A, 1/MAX_BURSTINESS) and then clipped).  A model
  with L_A = L_P = 0 gets no replicas at all (Eq. 5-6 give 0), so the case only arises when a
  peak is predicted with no average, and then its burst replicas rank by T_c and the cap.
- **L_P < L_A** (possible from independent predictors): the factor is clipped at 0, so such
  replicas exist (Eq. 6 may still ask for them) but score 0 and place last.
- **ceil on float noise**: L/B is rounded to 9 decimals before ``ceil`` so that a forecast of
  64.00000000001 with B = 32 asks for 2 instances, not 3.
- Basic replicas always rank above burst ones regardless of score (the paper's rule); callers
  use :func:`priority_key` to sort, which encodes it.
- **Spare burst replicas** (docs/policy.md; ``spare``: ``ControlConfig.spare_replicas`` for every
  model, default 0, and :mod:`warmserve.policy.overshoot`'s per-model spares, default on): Eq. 6 is
  extended to ``N_burst = max(ceil(L_P / B) - N_basic - K, 0) + spare`` for every model with a
  predicted peak or an active instance.  Eq. 6 asks for nothing beyond ``ceil(L_P / B)``
  instances, so every start past the predicted peak was a miss, and so was a peak just above
  a batch when ``L_P`` sat just below one (measured on the paper testbed, alpha 2, RPS 25: 7 of
  11 misses, all with the model's demand above its forecast peak — 193 in flight against a
  forecast of 118 — or ``L_P`` at 25-31 for ``B`` = 32).  A spare keeps one start beyond the
  current instances warm however far the load climbs (the control loop re-plans when a start
  uses a replica, so the next one is prewarmed behind it).  A spare scores 0 (the score of a
  replica nobody asked for: it covers a start the forecast says will not come), so it ranks
  below every replica Eq. 5-6 ask for, of any model, and is the first to go when memory is
  short or a start wants its GPUs: with Eq. 8's next rank instead, a 7B spare outranked the
  70B's burst replicas and took the memory they needed (measured at alpha 0.5, RPS 20: 70B
  misses 4 -> 6, its P99 31 s -> 42 s).  With the budget depth every model's replica fits
  beside the others on one GPU (§4's one-for-many prewarming), so spares cost idle memory,
  not GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from warmserve.policy.cluster import (
    ClusterState,
    LoadForecast,
    ModelSpec,
    PolicyInputError,
    ReplicaKind,
)

MAX_BURSTINESS = 10.0


@dataclass(frozen=True, slots=True, order=False)
class ReplicaRequest:
    """A replica the scorer asks for, before placement gives it a node and GPUs."""

    model: str
    kind: ReplicaKind
    rank: int
    score: float


def instances_for(load: float, max_batch: int) -> int:
    """ceil(load / B), robust to float noise; the instances that serve ``load`` requests."""
    if max_batch < 1:
        raise PolicyInputError(f"max_batch must be >= 1, got {max_batch}")
    if load < 0 or not math.isfinite(load):
        raise PolicyInputError(f"load must be finite and >= 0, got {load}")
    return math.ceil(round(load / max_batch, 9))


def replica_counts(
    forecast: LoadForecast, max_batch: int, active: int, spare: int = 0
) -> tuple[int, int]:
    """(N_basic, N_burst) of Eq. 5-6, with ``spare`` extra burst replicas (module docstring)
    when the model has a predicted peak or an active instance."""
    if active < 0:
        raise PolicyInputError(f"active instances must be >= 0, got {active}")
    if spare < 0:
        raise PolicyInputError(f"spare replicas must be >= 0, got {spare}")
    n_basic = max(instances_for(forecast.avg, max_batch) - active, 0)
    n_burst = max(instances_for(forecast.peak, max_batch) - n_basic - active, 0)
    if forecast.peak > 0 or active > 0:
        n_burst += spare
    return n_basic, n_burst


def burstiness(forecast: LoadForecast) -> float:
    """(L_P - L_A) / L_A of Eq. 8, defined for L_A = 0 and clipped to [0, MAX_BURSTINESS]."""
    denom = max(forecast.avg, 1.0 / MAX_BURSTINESS)
    return min(max((forecast.peak - forecast.avg) / denom, 0.0), MAX_BURSTINESS)


def basic_score(rank: int, n_basic: int, n_burst: int, cold_start_s: float) -> float:
    """Eq. 7."""
    total = n_basic + n_burst
    if not 0 <= rank < max(n_basic, 1) or total <= 0:
        raise PolicyInputError(f"basic rank {rank} out of range for N_basic={n_basic}")
    return math.exp(-rank / total) * cold_start_s


def burst_score(
    rank: int, n_basic: int, n_burst: int, cold_start_s: float, forecast: LoadForecast
) -> float:
    """Eq. 8 (with the L_A = 0 rule in the module docstring)."""
    total = n_basic + n_burst
    if not 0 <= rank < max(n_burst, 1) or total <= 0:
        raise PolicyInputError(f"burst rank {rank} out of range for N_burst={n_burst}")
    return math.exp(-(n_basic + rank) / total) * cold_start_s * burstiness(forecast)


def model_replicas(
    spec: ModelSpec, forecast: LoadForecast, active: int, spare: int = 0
) -> list[ReplicaRequest]:
    """All replicas one model asks for this window, basic first, each rank with its score.

    The ``spare`` replicas come last, with score 0 (module docstring); the others' scores are
    Eq. 7-8's for the Eq. 5-6 counts, whatever ``spare`` is."""
    return list(_model_replicas(spec, forecast, active, spare))


@lru_cache(maxsize=4096)
def _model_replicas(
    spec: ModelSpec, forecast: LoadForecast, active: int, spare: int
) -> tuple[ReplicaRequest, ...]:
    """:func:`model_replicas`, memoised (a pure function of immutable values: every plan asks
    it for every model, and most models' forecast and instances did not change since the last
    plan)."""
    n_basic, n_burst = replica_counts(forecast, spec.max_batch, active)
    _, with_spares = replica_counts(forecast, spec.max_batch, active, spare)
    out = [
        ReplicaRequest(
            spec.name, ReplicaKind.BASIC, i, basic_score(i, n_basic, n_burst, spec.cold_start_s)
        )
        for i in range(n_basic)
    ]
    out += [
        ReplicaRequest(
            spec.name,
            ReplicaKind.BURST,
            i,
            burst_score(i, n_basic, n_burst, spec.cold_start_s, forecast),
        )
        for i in range(n_burst)
    ]
    out += [
        ReplicaRequest(spec.name, ReplicaKind.BURST, i, 0.0)
        for i in range(n_burst, with_spares)
    ]
    return tuple(out)


def priority_key(req: ReplicaRequest) -> tuple[int, float, str, int]:
    """Sort key for placement order: basic before burst, then score descending.

    Ties break by model name and rank so the order (and thus the plan) is deterministic.
    """
    return (0 if req.kind == ReplicaKind.BASIC else 1, -req.score, req.model, req.rank)


def replica_requests(state: ClusterState, spare: int = 0) -> list[ReplicaRequest]:
    """Every model's replica requests for the snapshot's forecasts, in placement order.

    Models without a forecast ask for nothing.
    """
    reqs: list[ReplicaRequest] = []
    for name in sorted(state.forecasts):
        active = state.active_instances(name)
        reqs += model_replicas(state.models[name], state.forecasts[name], active, spare)
    return sorted(reqs, key=priority_key)


def sort_requests(reqs: Iterable[ReplicaRequest]) -> list[ReplicaRequest]:
    return sorted(reqs, key=priority_key)
