"""The control loop's rules (:class:`ControlConfig`): window length, autoscaler thresholds,
predictor, and which WarmServe mechanisms run.  Shared by every executor: the operator builds it
from its flags, the simulator from a scenario's ``policy`` section."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.overshoot import DEFAULT_OVERSHOOT_HEADROOM, DEFAULT_OVERSHOOT_SPARES
from warmserve.policy.predictor import Predictor, season_length


@dataclass(frozen=True)
class ControlConfig:
    """The loop's rules: window length, autoscaler thresholds, predictor, and which WarmServe
    mechanisms run (``prewarm``: Algorithm 1 at all; ``proactive``: grace GPUs lend Eq. 1
    memory; ``evict_aware``: §5.2 nesting, else first-fit — the §7.5 ablations; ``reclaim``:
    a starving model may drain instances other models can spare,
    :mod:`warmserve.policy.reclaim`)."""

    window_s: float = 300.0
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    predictor: Predictor | str | None = None
    # The predictor's seasonal day (86400 s; shorter only for a time-compressed replay, see
    # ``season_length``): its period is day_s / window_s windows.
    day_s: float = 86400.0
    prewarm: bool = True
    proactive: bool = True
    evict_aware: bool = True
    reclaim: bool = True
    # Extra burst replicas per model beyond Eq. 6, re-placed after each start that uses a
    # replica (warmserve.policy.scoring, docs/policy.md "Spare replicas").  0 (the default): the
    # paper's Eq. 6; the operator (--spare-replicas) and the simulator (policy.spare_replicas)
    # pass the same value through.
    spare_replicas: int = 0
    # Extra burst replicas for a model whose demand has passed its forecast peak in this or the
    # previous window (warmserve.policy.overshoot, docs/policy.md "Overshoot spares"); 0: off.
    overshoot_spares: int = DEFAULT_OVERSHOOT_SPARES
    # ... also for a model whose forecast peak leaves less than this share of a batch of room in
    # the instances Eq. 6 sizes for (warmserve.policy.overshoot.near_batch_boundary); 0: never.
    overshoot_headroom: float = DEFAULT_OVERSHOOT_HEADROOM

    def __post_init__(self) -> None:
        if self.spare_replicas < 0:
            raise PolicyInputError(f"spare_replicas must be >= 0, got {self.spare_replicas}")
        if not (math.isfinite(self.overshoot_headroom) and 0 <= self.overshoot_headroom <= 1):
            raise PolicyInputError(
                f"overshoot_headroom must be in [0, 1], got {self.overshoot_headroom}"
            )
        if self.overshoot_spares < 0:
            raise PolicyInputError(
                f"overshoot_spares must be >= 0, got {self.overshoot_spares}"
            )
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PolicyInputError(f"window must be > 0 seconds, got {self.window_s}")
        season_length(self.window_s, self.day_s)  # raises unless the window divides a day
