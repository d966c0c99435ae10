"""Fairness between models: a demand-weighted max-min share of the cluster's GPUs (issue 16).

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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from warmserve.policy.cluster import PolicyInputError

__all__ = ["FairDemand", "fair_caps"]


@dataclass(frozen=True, slots=True)
class FairDemand:
    """What one model asks for: ``want`` instances of ``tp`` GPUs each (its floor included);
    ``need``: the instances its load alone needs (the weight of its share, see the module)."""

    tp: int
    want: int
    need: int = 0

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
    while True:
        open_ = [m for m, d in demands.items() if given[m] < d.want and d.tp <= left]
        if not open_:
            return given
        m = min(open_, key=lambda m: (given[m] * demands[m].tp / demands[m].weight, given[m], m))
        given[m] += 1
        left -= demands[m].tp
