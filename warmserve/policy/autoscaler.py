"""Reactive autoscaler with hysteresis and grace periods (WarmServe §2.1, §4.1, §5).

WarmServe's prewarming sits next to an ordinary load-driven autoscaler: the autoscaler decides
*how many* instances a model needs right now; the placement module decides *where* a new one
starts (:func:`warmserve.policy.start_choice.choose_start`), and scale-down puts instances into a
*grace period* during which they get no new requests, finish what they run, and lend their free
KV memory to prewarming (Eq. 1, :mod:`warmserve.policy.proactive`).

Instances needed, with hysteresis
---------------------------------
With load L (requests in flight), max batch B and thresholds d < u (``scale_down_utilization``,
``scale_up_utilization``):

    n_up(L)   = ceil(L / (B·u))     fewest instances keeping utilisation <= u
    n_down(L) = ceil(L / (B·d))     fewest instances keeping utilisation <= d
    desired(L, n) = clamp(max(n_up(L), min(n, n_down(L))), min_instances, max_instances)

so we scale up only when utilisation would exceed u, and down only to the count at which
utilisation stays at or below d.  Since n_up <= n_down, the current count n is kept whenever
n_up(L) <= n <= n_down(L): the band.  No flapping: if every load of a sequence lies in
[L_lo, L_hi] with L_hi·d <= L_lo·u, the desired count changes monotonically (only up or only
down) — after scaling up at L_a to ceil(L_a/(B·u)), a later L_b gives
n_down(L_b) = ceil(L_b/(B·d)) >= ceil(L_a/(B·u)) because L_b/d >= L_lo/d >= L_hi/u >= L_a/u, so it
never scales back down; symmetrically after a scale-down.  ``tests/policy/test_autoscaler.py``
checks this as a property.  On top, a scale-down waits until the load has stayed low (desired
below current) for ``scale_down_delay_s``; scale-ups are immediate (a missed burst costs TTFT).

Grace period
------------
A drained instance enters the grace phase: no new requests; it ends when its last request
finishes or after ``max_grace_s`` (then remaining requests are cut off / migrated by the
caller).  :func:`decide` drains the instances with the fewest running requests first (they free
their GPUs soonest and lend the most KV memory), ties by name, node and GPUs.

Grace instances are not revived on a scale-up: the paper gives them no new requests, and their
free KV memory may already hold other models' prewarmed weights; a scale-up starts a new instance
where :func:`~warmserve.policy.start_choice.choose_start` says.

Everything is pure and deterministic; time is passed in explicitly (``now_s``) and the only
memory between calls is the small :class:`ScaleMemory` the caller keeps per model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from warmserve.policy.cluster import (
    PAGE_BYTES,
    Instance,
    InstancePhase,
    ModelSpec,
    PolicyInputError,
)
from warmserve.policy.proactive import lendable_bytes, reservation_target

__all__ = [
    "AutoscalerConfig",
    "ScaleDecision",
    "ScaleMemory",
    "decide",
    "desired_instances",
    "fair_demand_counts",
    "grace_done",
    "lendable_for",
    "lendable_per_gpu",
    "reservation_for",
]


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """Thresholds of the autoscaler.

    ``scale_up_utilization`` (u) and ``scale_down_utilization`` (d) are fractions of B; d < u is
    the hysteresis band.  ``scale_down_delay_s``: the load must stay low this long before a
    drain.  ``max_grace_s``: the longest a grace period lasts.  ``min_instances`` /
    ``max_instances``: default bounds per model (``None``: unbounded).
    """

    scale_up_utilization: float = 1.0
    scale_down_utilization: float = 0.5
    scale_down_delay_s: float = 60.0
    max_grace_s: float = 300.0
    min_instances: int = 0
    max_instances: int | None = None

    def __post_init__(self) -> None:
        u, d = self.scale_up_utilization, self.scale_down_utilization
        if not (0 < d < u <= 1.0) or not (math.isfinite(u) and math.isfinite(d)):
            raise PolicyInputError(
                "need 0 < scale_down_utilization < scale_up_utilization <= 1, "
                f"got down={d} up={u}"
            )
        if self.scale_down_delay_s < 0 or self.max_grace_s < 0:
            raise PolicyInputError("scale_down_delay_s and max_grace_s must be >= 0")
        if self.min_instances < 0:
            raise PolicyInputError(f"min_instances must be >= 0, got {self.min_instances}")
        if self.max_instances is not None and self.max_instances < self.min_instances:
            raise PolicyInputError("max_instances must be >= min_instances")


def _ceil_ratio(load: float, capacity: float) -> int:
    return math.ceil(round(load / capacity, 9))


def desired_instances(
    load: float,
    max_batch: int,
    current: int,
    config: AutoscalerConfig,
    min_instances: int | None = None,
    max_instances: int | None = None,
) -> int:
    """Instances ``load`` needs given ``current`` ones, with the hysteresis band (module doc).

    ``min_instances``/``max_instances`` override the config's bounds when given.
    """
    if max_batch < 1:
        raise PolicyInputError(f"max_batch must be >= 1, got {max_batch}")
    if not math.isfinite(load) or load < 0:
        raise PolicyInputError(f"load must be finite and >= 0, got {load}")
    if current < 0:
        raise PolicyInputError(f"current instances must be >= 0, got {current}")
    lo = config.min_instances if min_instances is None else min_instances
    hi = config.max_instances if max_instances is None else max_instances
    if lo < 0 or (hi is not None and hi < lo):
        raise PolicyInputError(f"need 0 <= min_instances <= max_instances, got {lo}, {hi}")
    n_up = _ceil_ratio(load, max_batch * config.scale_up_utilization)
    n_down = _ceil_ratio(load, max_batch * config.scale_down_utilization)
    n = max(n_up, min(current, n_down))
    n = max(n, lo)
    return n if hi is None else min(n, hi)


def fair_demand_counts(
    load: float, max_batch: int, current: int, config: AutoscalerConfig,
    min_instances: int | None = None, max_instances: int | None = None,
) -> tuple[int, int, int]:
    """What the fair share reads of one model, in one pass: ``(want, need, weight)`` =
    :func:`desired_instances` with ``current``, the same with no current instance (no
    hysteresis band), and the instances the load alone asks for (no bounds either)."""
    want = desired_instances(load, max_batch, current, config, min_instances, max_instances)
    # with current = 0 the band keeps nothing: desired_instances reduces to n_up and the bounds
    weight = _ceil_ratio(load, max_batch * config.scale_up_utilization)
    lo = config.min_instances if min_instances is None else min_instances
    hi = config.max_instances if max_instances is None else max_instances
    need = max(weight, lo)
    return want, (need if hi is None else min(need, hi)), weight


@dataclass(frozen=True, slots=True)
class ScaleMemory:
    """What the autoscaler remembers about one model between calls.

    ``low_since_s``: when the desired count first dropped below the current one (``None``: it
    is not below now).
    """

    low_since_s: float | None = None


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One model's decision: start ``scale_up`` instances, drain ``drain`` into grace.

    ``desired`` is the count to run now (still ``current`` while a scale-down waits out its
    delay); ``memory`` must be passed to the next call; ``grace_ended`` lists grace instances to
    terminate.
    """

    model: str
    current: int
    desired: int
    scale_up: int
    drain: tuple[Instance, ...]
    memory: ScaleMemory
    reason: str = ""
    grace_ended: tuple[Instance, ...] = field(default=())


def decide(
    model: ModelSpec,
    load: float,
    instances: Sequence[Instance],
    config: AutoscalerConfig,
    now_s: float,
    memory: ScaleMemory | None = None,
    *,
    grace_started_s: dict[str, float] | None = None,
    min_instances: int | None = None,
    max_instances: int | None = None,
) -> ScaleDecision:
    """Scale decision for ``model`` at time ``now_s``.

    ``instances``: this model's instances (any phase); those in grace do not count as current.
    ``memory``: what the previous call returned (``None`` the first time).  ``grace_started_s``
    maps grace instances' names to when their grace began; those :func:`grace_done` says are over
    are returned in ``grace_ended`` (the caller terminates them).
    """
    memory = memory or ScaleMemory()
    mine = [i for i in instances if i.model == model.name]
    active = [i for i in mine if i.phase != InstancePhase.GRACE]
    grace = [i for i in mine if i.phase == InstancePhase.GRACE]
    ended = tuple(
        i
        for i in grace
        if grace_started_s is not None
        and i.name in grace_started_s
        and grace_done(i.running, grace_started_s[i.name], now_s, config)
    )
    current = len(active)
    want = desired_instances(
        load, model.max_batch, current, config, min_instances, max_instances
    )
    if want > current:
        return ScaleDecision(
            model.name, current, want, want - current, (), ScaleMemory(), "load above band", ended
        )
    if want == current:
        return ScaleDecision(model.name, current, want, 0, (), ScaleMemory(), "in band", ended)
    since = memory.low_since_s if memory.low_since_s is not None else now_s
    if now_s - since < config.scale_down_delay_s:
        return ScaleDecision(
            model.name, current, current, 0, (), ScaleMemory(since), "low, waiting delay", ended
        )
    order = sorted(active, key=lambda i: (i.running, i.name, i.node, i.gpus))
    drain = tuple(order[: current - want])
    return ScaleDecision(model.name, current, want, 0, drain, ScaleMemory(), "drain", ended)


def grace_done(running: int, started_s: float, now_s: float, config: AutoscalerConfig) -> bool:
    """A grace period ends when no request is left or ``max_grace_s`` has passed."""
    if running < 0:
        raise PolicyInputError(f"running must be >= 0, got {running}")
    return running == 0 or now_s - started_s >= config.max_grace_s


def reservation_for(instance: Instance, spec: ModelSpec) -> int:
    """Eq. 1 for a grace instance: KV bytes it keeps, max(M·R/C, K + M/C) capped at M."""
    return reservation_target(
        instance.running, spec.max_batch, instance.kv_capacity_bytes, instance.kv_used_bytes
    )


def lendable_for(instance: Instance, spec: ModelSpec) -> int:
    """KV bytes of ``instance`` (all its GPUs) that prewarming may borrow; 0 unless in grace."""
    if instance.phase != InstancePhase.GRACE:
        return 0
    return lendable_bytes(
        instance.running, spec.max_batch, instance.kv_capacity_bytes, instance.kv_used_bytes
    )


def lendable_per_gpu(instance: Instance, spec: ModelSpec) -> int:
    """:func:`lendable_for` split evenly over the instance's GPUs (what ``GPU.free_bytes`` gets).

    KV cache is sharded evenly across tensor-parallel ranks, so each GPU lends an equal share;
    rounded down to whole pages per GPU (memory moves between slots page by page).
    """
    per_gpu = lendable_for(instance, spec) // len(instance.gpus)
    return per_gpu // PAGE_BYTES * PAGE_BYTES
