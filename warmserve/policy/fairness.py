"""Fairness between models: a demand-weighted max-min share of the cluster's GPUs.

Without it the autoscaler starts instances model by model until the GPUs run out, so one
deployment with ``minInstances: 1000`` (or a load spike far beyond the cluster) takes every GPU
and starves the rest.  When the instances every model wants do not fit, each model gets at most
its *fair share*, computed by progressive filling in whole instances:

    repeat: among the models that want more than they have been given and whose next instance
            (``tp`` GPUs) still fits in the GPUs left, give one instance to the one with the
            fewest GPUs *per unit of need* so far (ties: fewer instances, then name)

A model's need is the GPUs its load alone asks for (at least 1); a floor beyond that
(``minInstances``) is wanted but weighs nothing.  So shares follow load — the busiest model is
not cut to the share of an idle one (plain max-min in GPUs did that: on the paper testbed at
alpha 0.5, RPS 25 it raised WarmServe's P99 from 26 s to 121 s) — while a floor-only hog gets
GPUs only as one unit of need, and the others get theirs first.  No model gets more than it
wants; when everything fits, everyone gets what it wants.  The caps bound the autoscaler's
bounds (``min_instances`` too), so a model above its share drains to it after the usual
scale-down delay.  Documented in ``docs/policy.md`` ("Fairness").

**Tenants first.**  Each demand names its *group* — the tenant, a Kubernetes namespace in the
operator.  With several groups the filling above picks, at every step, first the group with the
fewest GPUs given so far among those with a model that can still take an instance (ties: the
group's name), then within that group the model by the rule above.  So scarce GPUs are divided
between tenants max-min fairly in GPUs — a tenant cannot buy a larger share by creating more
deployments or by flooding one with requests — and between a tenant's models by their load.
With one group (the simulator; an operator with a single namespace) every step picks that group
and the result is exactly the filling above.

:func:`cap_per_group` bounds what each group may report as demand (held requests at the
gateways), spread over the group's models in proportion.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from warmserve.policy.cluster import PolicyInputError

__all__ = ["FairDemand", "cap_per_group", "fair_caps"]


@dataclass(frozen=True, slots=True)
class FairDemand:
    """What one model asks for: ``want`` instances of ``tp`` GPUs each (its floor included);
    ``need``: the instances its load alone needs (the weight of its share, see the module)."""

    tp: int
    want: int
    need: int = 0
    group: str = ""  # the tenant (namespace); shares go to groups first (module docstring)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.want < 0 or self.need < 0:
            raise PolicyInputError(
                f"need tp >= 1, want >= 0 and need >= 0, got {self.tp}, {self.want}, {self.need}"
            )

    @property
    def weight(self) -> int:
        return max(self.need * self.tp, 1)


def fair_caps(demands: Mapping[str, FairDemand], capacity_gpus: int) -> dict[str, int]:
    """Instances each model may run on ``capacity_gpus`` GPUs (module docstring)."""
    if capacity_gpus < 0:
        raise PolicyInputError(f"capacity must be >= 0 GPUs, got {capacity_gpus}")
    if sum(d.want * d.tp for d in demands.values()) <= capacity_gpus:
        return {m: d.want for m, d in demands.items()}
    given = dict.fromkeys(demands, 0)
    left = capacity_gpus
    group_gpus = {d.group: 0 for d in demands.values()}
    several = len(group_gpus) > 1
    while True:
        open_ = [m for m, d in demands.items() if given[m] < d.want and d.tp <= left]
        if not open_:
            return given
        if several:
            g = min({demands[m].group for m in open_}, key=lambda g: (group_gpus[g], g))
            open_ = [m for m in open_ if demands[m].group == g]
        m = min(open_, key=lambda m: (given[m] * demands[m].tp / demands[m].weight, given[m], m))
        given[m] += 1
        left -= demands[m].tp
        group_gpus[demands[m].group] += demands[m].tp


def cap_per_group(
    counts: Mapping[str, int], group_of: Mapping[str, str], cap: int | None
) -> dict[str, int]:
    """``counts`` (per model) with each group's total cut to ``cap`` (``None``: no cap).

    A group over its cap keeps ``cap`` in all, split over its models in proportion to their
    counts (largest remainders, ties by name), so no model of it gets more than it had and the
    split does not depend on the order of the models.  A model without a group is a group of
    its own (name ``""`` groups every such model together).  Models with a count of 0 are left
    out.
    """
    if cap is not None and cap < 0:
        raise PolicyInputError(f"cap must be >= 0 or None, got {cap}")
    out = {m: c for m, c in counts.items() if c > 0}
    if any(c < 0 for c in counts.values()):
        raise PolicyInputError("counts must be >= 0")
    if cap is None:
        return out
    groups: dict[str, list[str]] = {}
    for m in out:
        groups.setdefault(group_of.get(m, ""), []).append(m)
    for members in groups.values():
        total = sum(out[m] for m in members)
        if total <= cap:
            continue
        share = {m: out[m] * cap // total for m in members}
        rest = cap - sum(share.values())
        order = sorted(members, key=lambda m: (-(out[m] * cap % total), m))
        for m in order[:rest]:
            share[m] += 1
        for m in members:
            if share[m]:
                out[m] = share[m]
            else:
                del out[m]
    return out
