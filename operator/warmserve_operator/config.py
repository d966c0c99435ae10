"""The operator loop's tunables (``warmserve operator`` flags / env), checked once at start."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from warmserve.engine_args import DEFAULT_POLICY, EngineArgPolicy
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.overshoot import DEFAULT_OVERSHOOT_HEADROOM, DEFAULT_OVERSHOOT_SPARES

from .model_spec import DEFAULT_LOAD_BANDWIDTH
from .tenancy import SourcePolicy

if TYPE_CHECKING:  # the control layer (numpy, the predictors) loads with the loop, not the flags
    from warmserve.control.controller import ControlConfig


@dataclass(frozen=True)
class OperatorConfig:
    """Tunables of the loop (``warmserve operator`` flags / env)."""

    window_s: float = 300.0
    poll_s: float = 5.0
    # Length of the seasonal day (86400 s; shorter only for a time-compressed replay, see
    # ``season_length``): the predictor's period is day_s / window_s windows.
    day_s: float = 86400.0
    predictor: str | None = None  # None: the policy core's default predictor
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH
    agent_lost_after: int = 3
    evict_aware: bool = True
    spare_replicas: int = 0  # ControlConfig.spare_replicas (docs/policy.md "Spare replicas")
    overshoot_spares: int = DEFAULT_OVERSHOOT_SPARES  # ControlConfig.overshoot_spares
    overshoot_headroom: float = DEFAULT_OVERSHOOT_HEADROOM  # ControlConfig.overshoot_headroom
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    node_status_refresh_s: float = 30.0
    # Consecutive polls this replica must hold the Lease before acting (docs/operator.md); the
    # Lease is written atomically, so one poll is enough.
    leader_settle_polls: int = 1
    # What tenants may put in spec.engine.args (--allow-engine-arg; docs/security.md)
    engine_policy: EngineArgPolicy = DEFAULT_POLICY
    # Model source prefixes each namespace may fetch from (admission; :mod:`.tenancy`).
    model_sources: SourcePolicy = field(default_factory=SourcePolicy)

    def __post_init__(self) -> None:
        from warmserve.policy.predictor import season_length

        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PolicyInputError(f"window must be > 0 seconds, got {self.window_s}")
        season_length(self.window_s, self.day_s)  # raises unless the window divides a day
        if not (math.isfinite(self.poll_s) and 0 < self.poll_s <= self.window_s):
            raise PolicyInputError(f"poll interval must be in (0, window], got {self.poll_s}")
        if self.agent_lost_after < 1:
            raise PolicyInputError("agent_lost_after must be >= 1")
        if self.load_bandwidth <= 0:
            raise PolicyInputError("load bandwidth must be > 0")
        if self.spare_replicas < 0:
            raise PolicyInputError(f"spare replicas must be >= 0, got {self.spare_replicas}")
        if self.overshoot_spares < 0:
            raise PolicyInputError(f"overshoot spares must be >= 0, got {self.overshoot_spares}")
        # The rest of the control layer's checks (overshoot_headroom, ...) run here too, so a bad
        # flag fails at start with its message, not in the first poll.
        self.control()

    def control(self) -> ControlConfig:
        from warmserve.control.controller import ControlConfig

        return ControlConfig(
            window_s=self.window_s,
            day_s=self.day_s,
            autoscaler=self.autoscaler,
            predictor=self.predictor,
            evict_aware=self.evict_aware,
            spare_replicas=self.spare_replicas,
            overshoot_spares=self.overshoot_spares,
            overshoot_headroom=self.overshoot_headroom,
        )
