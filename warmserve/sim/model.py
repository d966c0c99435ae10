"""Plain data of a simulator run, shared by the event loop, the baselines and the runner.

A low module (it imports only the scenario, hardware and workload readers), so that
baselines can build static layouts and the runner can compose a run without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from warmserve.policy.cluster import ModelSpec
from warmserve.sim import workload as wl
from warmserve.sim.hardware import GpuProfile
from warmserve.sim.scenario import Scenario

DROP_QUEUE_TIMEOUT = "queue-timeout"
DROP_NO_CAPACITY = "no-capacity"
DROP_UNFINISHED = "unfinished-at-end"
DROP_GRACE_CUTOFF = "grace-cutoff"  # still running when its instance's grace period ran out


@dataclass
class SimModel:
    """Static facts about one served model in a run (built by :mod:`warmserve.sim.runner`).

    """

    idx: int
    spec: ModelSpec
    engine: Any  # warmserve.sim.perf.EngineModel
    kv_bytes_per_token: float
    kv_cap_tokens: int  # per instance, on GPUs holding only this model
    per_layer_load_s: float  # one layer's share per GPU over the host link
    avg_history: list[float]
    peak_history: list[float]
    placeable: bool = True
    load_setup_s: float = 0.0  # fixed cost before a load from scratch copies its first layer
    stock_slowdown: float = 1.0  # stock vLLM's loader vs the weight path (start-up profile)
    timer: Any = None  # warmserve.sim.perf.StepTimer of ``engine`` (built on first use)

    def step_timer(self) -> Any:
        if self.timer is None:
            from warmserve.sim.perf import StepTimer

            self.timer = StepTimer(self.engine)
        return self.timer


@dataclass
class StaticInstance:
    """An instance created before the run (dedicated, MuxServe, Prism): ready at t = 0."""

    model: str
    node: str
    gpus: tuple[int, ...]
    slowdown: float = 1.0
    kv_cap_tokens: int | None = None  # None: the model's own (not shared) capacity
    max_batch: int | None = None  # None: the model's max_batch (MuxServe picks its own)
    # Set for instances that share GPUs (MuxServe, Prism): the simulator then times each
    # prefill and decode step with ``sharing.dynamic_slowdown(config_slowdown, busy neighbours
    # now)`` instead of the constant ``slowdown`` (kept as the average-load estimate).
    config_slowdown: float | None = None
    # The same factor for prefills when the shared configuration runs them differently
    # (MuxServe: prefill jobs get all SMs, decode jobs their MPS share); None: config_slowdown.
    prefill_config_slowdown: float | None = None


@dataclass
class StartRecord:
    t: float
    model: str
    hit: bool
    latency_s: float


@dataclass
class SimOutput:
    """Raw results of one run (turned into a row by :mod:`warmserve.sim.result_rows`).

    ``stats``: one :class:`warmserve.sim.stats.ModelStats` per model (online metrics).  The
    per-request arrays (``first_token``, ``finish``, ``assigned``, ``drop``, indexed by request
    in arrival order) exist only for runs made with ``record=True`` (tests, small runs).
    """

    system: str
    stats: list[Any]
    starts: list[StartRecord]
    gpu_seconds: float
    universal_gpu_seconds: float
    timeline: list[tuple[float, dict[str, int]]]
    end_s: float
    requests: int = 0
    plans: int = 0
    unplaced: int = 0
    lent_evictions: int = 0
    lent_placements: int = 0
    events: int = 0
    start_failures: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)
    first_token: np.ndarray | None = None
    finish: np.ndarray | None = None
    assigned: np.ndarray | None = None
    drop: list[str | None] | None = None


@dataclass(frozen=True)
class PeriodFacts:
    """One model's simulated period seen whole (an oracle: baselines that plan from average
    rates use it, the most favourable estimate for them)."""

    requests: int
    mean_input: float
    mean_output: float
    peak_inflight: float  # the largest per-window peak in flight at nominal speeds


@dataclass
class Prepared:
    """Everything shared by the systems of one scenario run.

    ``stream`` generates the requests on demand; every system replays the same ones.
    """

    scenario: Scenario
    profile: GpuProfile
    models: list[SimModel]
    stream: wl.RequestStream
    start_minute: int
    shares: np.ndarray
    facts: list[PeriodFacts]
    initial: dict[str, int]
    prep_s: float
    startup: Any = None  # warmserve.sim.startup.StartupProfile
    _requests: wl.Requests | None = None

    @property
    def requests(self) -> wl.Requests:
        """All of the period's requests in one array set (materialised on first use: tests,
        plots and small runs; simulation runs stream them)."""
        if self._requests is None:
            self._requests = self.stream.materialize()
        return self._requests

    @property
    def n_requests(self) -> int:
        return sum(f.requests for f in self.facts)

    @property
    def peak_inflight(self) -> list[float]:
        return [f.peak_inflight for f in self.facts]

    def model_period(self, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival, input, output) of one model's whole period."""
        return self.stream.model_requests(idx, 0.0, self.scenario.duration_s)
