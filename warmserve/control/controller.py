"""The controller: one loop's memory and decisions, for every executor (issue 11).

An executor (the operator, the simulator, a test script) calls, in any rhythm it likes:

* :meth:`Controller.set_models` when the set of managed models or their specs change;
* :meth:`Controller.observe` with what it sees (and :meth:`Controller.measure` for demand
  changes between observations, if it sees them — the simulator does, exactly);
* :meth:`Controller.decide`, and carries out the returned :class:`~.decisions.Decisions`.

What the controller owns, so no executor re-decides it:

* **Window clock.** Windows are ``[k·W, (k+1)·W)`` of the executor's clock; a model's window
  closes at the boundary (even when noticed later), its average and peak demand go to the
  model's :class:`~.history.LoadHistory`, and every model is forecast anew for the next window.
* **Forecasts** (:func:`warmserve.policy.predictor.forecast`), per model with prewarming on.
* **Grace clocks.** When each grace instance began its grace (the executor's report, else the
  controller's first sight of it in grace); :func:`warmserve.policy.autoscaler.decide` ends a
  grace period when its last request finished or after ``max_grace_s``.
* **Re-plan triggers** (one rule, ``docs/policy.md``): Algorithm 1 runs at the first decision
  after (a) a window boundary, (b) a change of the managed models or their specs, (c) free
  memory growing by more than 1 MiB on some GPU since the last plan (an instance ended, a grace
  instance lent KV memory), (d) an instance vanishing without an ``EndGrace`` (lost), (e) an
  explicit :meth:`request_replan`.
* **Eviction.** A replica the plan no longer wants is evicted only when the plan places a new
  replica on one of its GPUs; otherwise it stays resident at the lowest priority (burst,
  score 0): any start or later placement there takes it first, and until then a start of its
  model can still hit it.  (Measured against evicting at once: ``docs/policy.md``.)
* **Replica priorities**: the kind, rank and score it gave each replica when it planned it.

**Fairness**: the autoscaler's bounds are capped by each model's demand-weighted max-min share
of the GPUs (:mod:`warmserve.policy.fairness`) whenever what the models want does not fit.

**Reclaim** (issue 12): a model with requests held at the gateway whose start found no GPU group
may take one from instances other models can spare (:mod:`warmserve.policy.reclaim`): they are
drained (grace) and the model starts there once they are done.

Decision order per call: the autoscaler for each model (sorted): its starts where
:func:`~warmserve.policy.start_choice.choose_start` says (each applied to the snapshot before the
next), its drains, its grace ends; then, when a re-plan is due, Algorithm 1 on the snapshot
*after* the starts: evictions (of replicas whose GPUs a new replica needs) before loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from warmserve.policy.autoscaler import (
    AutoscalerConfig,
    ScaleDecision,
    ScaleMemory,
    desired_instances,
)
from warmserve.policy.autoscaler import decide as autoscale
from warmserve.policy.cluster import (
    ClusterState,
    Instance,
    InstancePhase,
    LoadForecast,
    ModelSpec,
    PolicyInputError,
    ReplicaKind,
    WorkerState,
)
from warmserve.policy.evict_aware_placement import PrewarmPlan, plan_prewarm
from warmserve.policy.fairness import FairDemand, fair_caps
from warmserve.policy.load import WindowLoadTracker
from warmserve.policy.predictor import Predictor, forecast, season_length
from warmserve.policy.reclaim import plan_reclaim
from warmserve.policy.start_choice import NoCapacity, choose_start

from .decisions import Decision, Decisions, Drain, EndGrace, Evict, Prewarm, Start
from .demand import observed_demand
from .history import LoadHistory
from .observation import InstanceObs, Observation
from .snapshot import (
    ReplicaKey,
    ReplicaMeta,
    SnapshotMemo,
    apply_start,
    build_state,
    instance_key,
)

FREE_GROWTH_BYTES = 2**20  # free memory must grow by more than this to trigger a re-plan
SURPLUS: ReplicaMeta = (ReplicaKind.BURST, 0, 0.0)  # a replica kept though no longer wanted


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

    def __post_init__(self) -> None:
        if self.spare_replicas < 0:
            raise PolicyInputError(f"spare_replicas must be >= 0, got {self.spare_replicas}")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PolicyInputError(f"window must be > 0 seconds, got {self.window_s}")
        season_length(self.window_s, self.day_s)  # raises unless the window divides a day


@dataclass(frozen=True)
class ModelEntry:
    """A managed model: its policy spec, instance bounds and whether it is prewarmed."""

    spec: ModelSpec
    min_instances: int = 0
    max_instances: int | None = None
    prewarm: bool = True


@dataclass
class _ModelState:
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


class Controller:
    """See the module docstring.  Deterministic; time comes from the observations."""

    def __init__(self, config: ControlConfig) -> None:
        self.cfg = config
        self.windows_per_day = season_length(config.window_s, config.day_s)
        self.models: dict[str, _ModelState] = {}
        self.window_index: int | None = None
        self.meta: dict[ReplicaKey, ReplicaMeta] = {}
        self.grace_seen: dict[str, float] = {}
        self.last_free: dict[tuple[str, int], int] = {}
        self.known_instances: set[str] = set()
        self.ended: set[str] = set()  # instances this controller ended or drained away
        self.replan_reasons: set[str] = {"start"}
        self.stale: set[str] = set()  # models whose forecast must be recomputed
        self.last_plan: PrewarmPlan | None = None
        self.last_plan_state: ClusterState | None = None  # the snapshot it was planned on
        self.plans = 0
        self.snapshot_memo = SnapshotMemo()  # reuse between polls (pure: same snapshot)
        # model -> ((load, active instances, entry), (want, need)) of its last fair-share call
        self._fair_memo: dict[str, tuple[tuple[float, int, ModelEntry],
                                         tuple[FairDemand, FairDemand]]] = {}

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
                self.models[name] = _ModelState(
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
        w = self.cfg.window_s
        boundary = st.boundary
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

    # ------------------------------------------------------------------ decide

    def snapshot(self, obs: Observation) -> ClusterState:
        """The policy's view of ``obs`` for the managed models (:mod:`.snapshot`)."""
        self._forecasts(obs.now)
        specs = {m: st.entry.spec for m, st in self.models.items()}
        forecasts = {m: st.forecast for m, st in self.models.items() if st.forecast is not None}
        return build_state(
            obs, specs, forecasts, meta=self.meta, proactive=self.cfg.proactive,
            memo=self.snapshot_memo,
        )

    def decide(self, obs: Observation, only: Iterable[str] | None = None) -> Decisions:
        """Decisions for ``obs`` (call :meth:`observe` with it first).

        ``only``: autoscale these models only and never plan (an executor's fast path for a
        request that found no room; the next full call plans if due).
        """
        state = self.snapshot(obs)
        self._note_free(state)
        loads = observed_demand(obs, self.models)
        slot_of = {(s.model, s.node, s.gpus): s.id for s in obs.slots if not s.foreign and s.id}
        by_key = {instance_key(i.node, i.gpus): i for i in obs.instances if not i.foreign}
        grace_by_key = {
            k: self.grace_seen[i.id] for k, i in by_key.items() if i.id in self.grace_seen
        }
        items: list[Decision] = []
        scale: dict[str, ScaleDecision] = {}
        no_capacity: dict[str, str] = {}
        caps = self._fair_caps(state, obs, loads)
        models = sorted(self.models if only is None else set(only) & set(self.models))
        # each model's instances, once (a model's own starts come after its autoscale call)
        mine: dict[str, list[Instance]] = {}
        for i in state.instances:
            mine.setdefault(i.model, []).append(i)
        for model in models:
            st = self.models[model]
            entry = st.entry
            cap = caps[model]
            hi = cap if entry.max_instances is None else min(entry.max_instances, cap)
            d = autoscale(
                entry.spec,
                loads.get(model, 0.0),
                mine.get(model, []),
                self.cfg.autoscaler,
                obs.now,
                st.memory,
                grace_started_s=grace_by_key,
                min_instances=min(entry.min_instances, hi),
                max_instances=hi,
            )
            st.memory = d.memory
            scale[model] = d
            for _ in range(d.scale_up):
                choice = choose_start(state, model)
                if isinstance(choice, NoCapacity):
                    no_capacity[model] = choice.reason
                    break
                hit_slot = slot_of.get((model, choice.node, choice.gpus), "") if choice.hit else ""
                evicts = tuple(
                    sid
                    for r in choice.evicts
                    if (sid := slot_of.get((r.model, r.node, r.gpus))) is not None
                )
                items.append(
                    Start(
                        model, choice.node, choice.gpus, bool(hit_slot), hit_slot, evicts, d.reason
                    )
                )
                for r in choice.evicts:
                    self.meta.pop((r.model, r.node, r.gpus), None)
                if choice.replica is not None:
                    self.meta.pop((model, choice.node, choice.gpus), None)
                    if self.cfg.spare_replicas:
                        # the spare behind this start (docs/policy.md "Spare replicas")
                        self.replan_reasons.add("replica used")
                state = apply_start(state, choice, "")
            drained: set[str] = set()
            for inst in d.drain:
                seen = by_key.get(inst.name)
                if seen is None or seen.phase != InstancePhase.SERVING:
                    continue  # starting (or only planned): drained once it serves, if still low
                items.append(Drain(model, inst.node, inst.gpus, seen.id, d.reason))
                drained.add(inst.name)
            if drained:
                # the rest of this decision (reclaim, Algorithm 1) sees them in grace, as the
                # next snapshot will: reclaim must not drain them a second time
                state = _in_grace(state, drained)
            for inst in d.grace_ended:
                seen = by_key.get(inst.name)
                if seen is None:
                    continue
                why = "idle" if inst.running == 0 else "grace period over"
                # With prewarming off (the model's or the loop's) an ended instance leaves no
                # weights behind: a resident copy would be a prewarm replica by another name,
                # and the next start there a "prewarm hit" of a model that has none (the
                # simulator's reactive baseline frees the GPU likewise, on_stop "none").
                keep = self.cfg.prewarm and entry.prewarm
                items.append(
                    EndGrace(model, inst.node, inst.gpus, seen.id, why, evict_weights=not keep)
                )
                self.ended.add(seen.id)
        if self.cfg.reclaim and no_capacity and only is None:
            # full decisions only (each poll), not the fast path an executor may take per
            # request: how often reclaim is tried must not depend on the executor's rhythm
            state, drains = self._reclaim(state, obs, loads, caps, no_capacity, by_key)
            items += drains
        plan = None
        if only is None and self.cfg.prewarm and self.replan_reasons:
            plan, plan_items = self._plan(state, slot_of)
            items += plan_items
        return Decisions(tuple(items), scale, plan, no_capacity)

    def _reclaim(
        self,
        state: ClusterState,
        obs: Observation,
        loads: Mapping[str, float],
        caps: Mapping[str, int],
        no_capacity: Mapping[str, str],
        by_key: Mapping[str, InstanceObs],
    ) -> tuple[ClusterState, list[Decision]]:
        """Drains that free a GPU group for each model with held requests and no group
        (:mod:`warmserve.policy.reclaim`); the snapshot returned shows them in grace."""
        items: list[Decision] = []
        mins = {m: st.entry.min_instances for m, st in self.models.items()}
        for model in sorted(no_capacity):
            if obs.held.get(model, 0) <= 0:
                continue
            r = plan_reclaim(state, model, loads, self.cfg.autoscaler, caps=caps,
                             min_instances=mins)
            if r is None:
                continue
            for v in r.victims:
                seen = by_key.get(v.name)
                if seen is not None:
                    items.append(Drain(v.model, v.node, v.gpus, seen.id, f"reclaimed for {model}"))
            state = _in_grace(state, {v.name for v in r.victims})
        return state, items

    def _fair_caps(
        self, state: ClusterState, obs: Observation, loads: Mapping[str, float]
    ) -> dict[str, int]:
        """Each model's fair share in instances (:mod:`warmserve.policy.fairness`) of the GPUs
        not held by instances of models the controller does not manage.

        A model's demand is what the autoscaler wants for it (hysteresis included).  When those
        do not all fit, the shares are computed from what each model *needs* — the instances
        that keep its utilisation at the scale-up threshold, without the instances the
        hysteresis band merely keeps (issue 12): a band instance running at a quarter of its
        batch must not count as demand while another model queues requests for lack of GPUs.
        Each share is weighted by the instances the model's load alone asks for (a
        ``minInstances`` floor is wanted but weighs nothing; :mod:`warmserve.policy.fairness`).
        """
        foreign = sum(len(i.gpus) for i in obs.instances if i.foreign)
        capacity = max(sum(len(n.gpus) for n in state.nodes) - foreign, 0)
        wants: dict[str, FairDemand] = {}
        needs: dict[str, FairDemand] = {}
        active: dict[str, int] = {}
        for i in state.instances:
            if i.phase != InstancePhase.GRACE:
                active[i.model] = active.get(i.model, 0) + 1
        memo = self._fair_memo
        for model, st in self.models.items():
            e = st.entry
            current = active.get(model, 0)
            load = loads.get(model, 0.0)
            key = (load, current, e)
            hit = memo.get(model)
            if hit is not None and hit[0] == key:  # pure in key: most models did not change
                wants[model], needs[model] = hit[1]
                continue
            args = (e.spec.max_batch, self.cfg.autoscaler, e.min_instances, e.max_instances)
            want = desired_instances(load, args[0], current, *args[1:])
            # weight (demand-weighted shares): the instances the load alone asks for
            weight = desired_instances(load, args[0], 0, self.cfg.autoscaler, 0, None)
            wants[model] = FairDemand(e.spec.tp, want, weight)
            needs[model] = FairDemand(
                e.spec.tp, desired_instances(load, args[0], 0, *args[1:]), weight
            )
            memo[model] = (key, (wants[model], needs[model]))
        if sum(d.want * d.tp for d in wants.values()) <= capacity:
            return {m: d.want for m, d in wants.items()}
        return fair_caps(needs, capacity)

    def _free_map(self, state: ClusterState) -> dict[tuple[str, int], int]:
        return {
            (n.name, g.index): g.free_bytes
            for n in state.nodes
            for g in n.gpus
            if g.state != WorkerState.DEDICATED
        }

    def _note_free(self, state: ClusterState) -> None:
        cur = self._free_map(state)
        if any(v > self.last_free.get(k, 0) + FREE_GROWTH_BYTES for k, v in cur.items()):
            self.replan_reasons.add("free memory grew")
        else:
            self.last_free = {k: min(v, self.last_free.get(k, v)) for k, v in cur.items()}

    def _plan(
        self, state: ClusterState, slot_of: Mapping[ReplicaKey, str]
    ) -> tuple[PrewarmPlan, list[Decision]]:
        plan = plan_prewarm(
            state, evict_aware=self.cfg.evict_aware, spare_replicas=self.cfg.spare_replicas
        )
        self.plans += 1
        self.last_plan = plan
        self.last_plan_state = state
        self.replan_reasons = set()
        self.last_free = self._free_map(state)
        items: list[Decision] = []
        needed = {(r.node, g) for r in plan.place for g in r.gpus}
        for r in plan.evict:
            key = (r.model, r.node, r.gpus)
            sid = slot_of.get(key)
            if sid is None:
                continue  # a load still in flight the executor does not show yet
            if not any((r.node, g) in needed for g in r.gpus):
                # The eviction rule (docs/policy.md): a replica the plan no longer wants stays
                # until its GPUs are needed, at the lowest priority (burst, score 0), so the
                # next start or placement there takes it first; meanwhile it can still hit.
                self.meta[key] = SURPLUS
                continue
            self.meta.pop(key, None)
            items.append(Evict(r.model, r.node, r.gpus, sid, "its GPUs are needed"))
        for r in (*plan.keep, *plan.place):
            self.meta[(r.model, r.node, r.gpus)] = (r.kind, r.rank, r.score)
        for r in plan.place:
            spec = state.models[r.model]
            layers = spec.resident_layers if spec.resident_layers < spec.num_layers else 0
            items.append(
                Prewarm(r.model, r.node, r.gpus, r.kind, r.rank, r.score, layers, r.bytes_per_gpu)
            )
        return plan, items

    # ------------------------------------------------------------------ bootstrap

    def initial_starts(self, obs: Observation, counts: Mapping[str, int]) -> list[Start]:
        """Where ``counts`` instances per model would start on ``obs`` (an executor that begins
        with a serving cluster, like the simulator's warm start), one model at a time."""
        state = self.snapshot(obs)
        out: list[Start] = []
        for model in counts:  # the executor's order
            for _ in range(counts[model]):
                choice = choose_start(state, model)
                if isinstance(choice, NoCapacity):
                    break
                out.append(Start(model, choice.node, choice.gpus, False, "", (), "initial"))
                state = apply_start(state, choice, "")
        return out


def _in_grace(state: ClusterState, names: set[str]) -> ClusterState:
    """``state`` with the named instances in grace (drained by this decision)."""
    return replace(
        state,
        instances=tuple(
            replace(i, phase=InstancePhase.GRACE) if i.name in names else i
            for i in state.instances
        ),
    )
