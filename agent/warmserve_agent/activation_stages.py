"""Where an activation's time goes: its stages, measured in the agent and the engine's worker.

Each :class:`ActivationStages` holds, in seconds since the agent received ``Activate``, when each
:class:`Stage` completed: the group's worker process was ready for the instance, its engine existed
(prepared at prewarm time, or built now), every layer was resident, the KV range was mapped in
full and the engine's KV cache grown over it (during the engine's start when the range was mapped
by then, else when the background mapping completes: possibly after the endpoint was up and the
first token), the endpoint accepted connections, the engine produced its
first token.  A stage reached before ``Activate`` (the weights of a full prewarm) is 0; one not
reached yet is None (a partial prewarm's weights and the first token come after ``Activate``
answered: ``Describe`` shows them later).  They go out as ``InstanceInfo.stages`` and as the
histogram ``warmserve_agent_activation_stage_seconds{stage,start}`` (:class:`StageHistograms`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum

from warmserve_agent.engines.spec import EngineStats

STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Stage(StrEnum):
    PROCESS_TAKEN = "process_taken"
    ENGINE_READY = "engine_ready"
    WEIGHTS_RESIDENT = "weights_resident"
    KV_MAPPED = "kv_mapped"
    ENDPOINT_UP = "endpoint_up"
    FIRST_TOKEN = "first_token"


class StartKind(StrEnum):
    """The ``start`` label: a prewarm hit whose engine was prepared, a hit that built its
    engine, a cold start (nothing resident)."""

    HIT_PREPARED = "hit_prepared"
    HIT = "hit"
    COLD = "cold"


@dataclass
class ActivationStages:
    """One activation's stages (see module docstring); ``engine_call_s``: when the agent called
    the engine's ``start`` (the engine reports its own stages from there)."""

    process_taken: float | None = None
    engine_ready: float | None = None
    weights_resident: float | None = None
    kv_mapped: float | None = None
    endpoint_up: float | None = None
    first_token: float | None = None
    engine_prepared: bool = False
    engine_call_s: float = 0.0
    kv_in_background: bool = False  # the engine started before its KV range was all mapped
    observed: set[Stage] = field(default_factory=set)  # counted in the histograms already

    def known(self) -> dict[Stage, float]:
        """The stages reached."""
        return {s: v for s in Stage if (v := getattr(self, s.value)) is not None}

    def from_engine(self, stats: EngineStats) -> list[Stage]:
        """Take the engine's own stages (relative to its ``start``); returns those new here.
        The engine's KV stage counts only when its start got the whole KV range; with the range
        still mapping in the background the agent notes it when the pager completes it
        (``Activator``), which may come after the endpoint is up."""
        st = stats.stages
        new: list[Stage] = []
        base = self.engine_call_s
        for stage, value in (
            (Stage.ENGINE_READY, st.engine_ready_s),
            (Stage.KV_MAPPED, None if self.kv_in_background else st.kv_mapped_s),
            (Stage.ENDPOINT_UP, st.endpoint_up_s),
            (Stage.FIRST_TOKEN, st.first_token_s),
        ):
            if value is not None and getattr(self, stage.value) is None:
                setattr(self, stage.value, base + value)
                new.append(stage)
        self.engine_prepared = self.engine_prepared or st.prepared
        return new


class StageHistograms:
    """Cumulative histograms of stage seconds by (stage, start kind), for Prometheus."""

    def __init__(self, buckets: tuple[float, ...] = STAGE_BUCKETS) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._data: dict[tuple[Stage, StartKind], tuple[list[int], float]] = {}

    def observe(self, stage: Stage, start: StartKind, seconds: float) -> None:
        with self._lock:
            counts, total = self._data.get((stage, start), ([0] * (len(self.buckets) + 1), 0.0))
            for i, b in enumerate(self.buckets):
                if seconds <= b:
                    counts[i] += 1
            counts[-1] += 1  # +Inf
            self._data[(stage, start)] = (counts, total + seconds)

    def snapshot(self) -> dict[tuple[Stage, StartKind], tuple[list[int], float]]:
        with self._lock:
            return {k: (list(c), s) for k, (c, s) in self._data.items()}
