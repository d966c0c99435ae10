"""Fairness between models: a max-min fair share of the cluster's GPUs (issue 16).

Without it the autoscaler starts instances model by model until the GPUs run out, so one
deployment with ``minInstances: 1000`` (or a load spike far beyond the cluster) takes every GPU
and starves the rest.  When the instances every model wants do not fit, each model gets at most
its *fair share*, computed by progressive filling in whole instances:

    repeat: among the models that want more than they have been given and whose next instance
            (``tp`` GPUs) still fits in the GPUs left, give one instance to the one holding the
            fewest GPUs so far (ties: fewer instances, then name)

This is max-min fairness in GPUs (no model can get more without taking from one that holds no
more than it), it never gives a model more than it wants, and it uses the GPUs as fully as whole
instances allow.  When everything fits, every model gets what it wants.  The caps bound the
autoscaler's bounds (``min_instances`` too: a floor is honoured only up to the fair share), so a
model above its share drains down to it after the usual scale-down delay and the GPUs go to the
others.  Documented in ``docs/policy.md`` ("Fairness").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from warmserve.policy.cluster import PolicyInputError

__all__ = ["FairDemand", "fair_caps"]


@dataclass(frozen=True, slots=True)
class FairDemand:
    """What one model asks for: ``want`` instances of ``tp`` GPUs each."""

    tp: int
    want: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.want < 0:
            raise PolicyInputError(f"need tp >= 1 and want >= 0, got {self.tp}, {self.want}")


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
        m = min(open_, key=lambda m: (given[m] * demands[m].tp, given[m], m))
        given[m] += 1
        left -= demands[m].tp
