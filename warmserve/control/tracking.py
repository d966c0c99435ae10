"""What the controller remembers between calls (:class:`ModelTracking`, mixed into
:class:`~.controller.Controller`): the managed models, the window clock, each model's load
history and forecast (the predictor's input and output, Eq. 2-4), grace clocks and lost
instances.  The rules are the controller's (its module docstring: window clock, forecasts,
grace clocks, re-plan triggers); this module only keeps the state they read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from warmserve.policy.autoscaler import ScaleMemory
from warmserve.policy.cluster import InstancePhase, LoadForecast, ModelSpec
from warmserve.policy.load import WindowLoadTracker
from warmserve.policy.predictor import forecast

from .config import ControlConfig
from .demand import observed_demand
from .history import LoadHistory
from .observation import Observation


@dataclass(frozen=True)
class ModelEntry:
    """A managed model: its policy spec, instance bounds, whether it is prewarmed, and its
    tenant (the operator: the deployment's namespace; fair shares go to tenants first)."""

    spec: ModelSpec
    min_instances: int = 0
    max_instances: int | None = None
    prewarm: bool = True
    namespace: str = ""


@dataclass
class ModelState:
    entry: ModelEntry
    tracker: WindowLoadTracker
    history: LoadHistory
    forecast: LoadForecast | None = None
    last_window: tuple[float, float, float] | None = None  # (start, avg, peak)
    memory: ScaleMemory | None = None
    closed: list[int] = field(default_factory=list)  # windows closed since take_closed()
    boundary: float | None = None  # end of the tracker's current window (None: recompute)

    @property
    def spec(self) -> ModelSpec:
        return self.entry.spec


class ModelTracking:
    """Per-model memory of the control loop; :class:`~.controller.Controller` sets the fields
    in its constructor."""

    cfg: ControlConfig
    windows_per_day: int
    models: dict[str, ModelState]
    window_index: int | None
    grace_seen: dict[str, float]
    known_instances: set[str]
    ended: set[str]
    replan_reasons: set[str]
    stale: set[str]
    observed: tuple[Observation | None, dict[str, float]]  # the last observe()'s obs, demand

    # ------------------------------------------------------------------ models and history

    def set_models(self, entries: Mapping[str, ModelEntry], now: float) -> None:
        """The managed models now; a new model starts measuring at ``now``."""
        for name in list(self.models):
            if name not in entries:
                del self.models[name]
                self.replan_reasons.add("model removed")
        for name, entry in entries.items():
            st = self.models.get(name)
            if st is None:
                self.models[name] = ModelState(
                    entry,
                    WindowLoadTracker(self.cfg.window_s, start_s=now),
                    LoadHistory(self.cfg.window_s),
                )
                self._refresh_forecast(name, now)
                self.replan_reasons.add("model added")
            elif st.entry != entry:
                st.entry = entry
                self._refresh_forecast(name, now)
                self.replan_reasons.add("model changed")

    def seed_history(self, model: str, history: LoadHistory, now: float) -> None:
        """Replace ``model``'s history (persisted by the executor) and forecast from it."""
        if abs(history.window_s - self.cfg.window_s) > 1e-9:
            history = LoadHistory(self.cfg.window_s)
        self.models[model].history = history
        self._refresh_forecast(model, now)
        self.replan_reasons.add("history loaded")

    def history(self, model: str) -> LoadHistory:
        return self.models[model].history

    def take_closed(self) -> dict[str, list[int]]:
        """Windows closed since the last call, per model (what an executor must persist)."""
        out = {m: st.closed for m, st in self.models.items() if st.closed}
        for st in self.models.values():
            st.closed = []
        return out

    def forecast_of(self, model: str) -> LoadForecast | None:
        if model in self.stale:
            return None  # not computed yet (the next decision computes it)
        st = self.models.get(model)
        return st.forecast if st else None

    def last_window(self, model: str) -> tuple[float, float, float] | None:
        st = self.models.get(model)
        return st.last_window if st else None

    def _refresh_forecast(self, model: str, now: float) -> None:
        """Mark ``model``'s forecast stale; :meth:`_forecasts` computes it once, when needed
        (a forecast can cost tens of milliseconds: 1,000 models must not pay it twice)."""
        self.stale.add(model)

    def _forecasts(self, now: float) -> None:
        until = math.floor(now / self.cfg.window_s + 1e-9)
        for model in sorted(self.stale):
            st = self.models.get(model)
            if st is None:
                continue
            if not (self.cfg.prewarm and st.entry.prewarm):
                st.forecast = None
                continue
            avg, peak = st.history.series(until, self.windows_per_day)
            st.forecast = forecast(avg, peak, self.windows_per_day, self.cfg.predictor)
        self.stale.clear()

    # ------------------------------------------------------------------ observe

    def measure(self, model: str, t: float, value: float) -> None:
        """``model``'s demand is ``value`` from ``t`` on (closing windows it crossed)."""
        st = self.models.get(model)
        if st is None:
            return
        boundary = st.boundary
        if boundary is not None and boundary > t:  # the common case: same window (per request)
            st.tracker.update(t, value)
            return
        w = self.cfg.window_s
        if boundary is None:  # the end of the tracker's window (kept: asked per request)
            boundary = (math.floor(st.tracker.window_start / w + 1e-9) + 1) * w
        if boundary <= t:
            st.boundary = None
        else:
            st.boundary = boundary
        while boundary <= t:
            closed = st.tracker.close(boundary)
            index = math.floor(closed.start_s / w + 1e-9)
            st.history.record(index, closed.avg, closed.peak)
            st.last_window = (closed.start_s, closed.avg, closed.peak)
            st.closed.append(index)
            boundary += w
        st.tracker.update(t, value)

    def observe(self, obs: Observation) -> dict[str, float]:
        """Measure every managed model's demand, advance the window clock, note grace clocks
        and lost instances.  Returns the demand measured."""
        loads = observed_demand(obs, self.models)
        self.observed = (obs, dict(loads))  # decide(obs) reads the same demand
        for model, load in loads.items():
            self.measure(model, obs.now, load)
        index = math.floor(obs.now / self.cfg.window_s + 1e-9)
        if self.window_index is None or index > self.window_index:
            self.window_index = index
            for model in self.models:
                self._refresh_forecast(model, obs.now)
            self.replan_reasons.add("window")
        current = {i.id for i in obs.instances if not i.foreign}
        lost = self.known_instances - current - self.ended
        if lost:
            self.replan_reasons.add("instance lost")
        self.known_instances = current
        self.ended &= current
        for i in obs.instances:
            if i.phase == InstancePhase.GRACE:
                first = self.grace_seen.setdefault(i.id, obs.now)
                if i.grace_started_s is not None:
                    self.grace_seen[i.id] = min(i.grace_started_s, first)
        live = {i.id for i in obs.instances if i.phase == InstancePhase.GRACE}
        for iid in list(self.grace_seen):
            if iid not in live:
                del self.grace_seen[iid]
        return loads

    def request_replan(self, reason: str) -> None:
        self.replan_reasons.add(reason)
