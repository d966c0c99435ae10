"""The controller: one loop's memory and decisions, for every executor (operator, simulator).

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
  explicit :meth:`request_replan`, (f) a model's demand passing its forecast peak, or a start
  using a replica of a model that has a spare (:mod:`.spares`: the spare behind it).
* **Eviction.** A replica the plan no longer wants is evicted only when the plan places a new
  replica on one of its GPUs; otherwise it stays resident at the lowest priority (burst,
  score 0): any start or later placement there takes it first, and until then a start of its
  model can still hit it.  (Measured against evicting at once: ``docs/policy.md``.)
* **Replica priorities**: the kind, rank and score it gave each replica when it planned it.

**Incremental** (for a 1,024-GPU cluster): between two decisions few models and nodes change, so the
controller keeps, per executor, what it may reuse — the snapshot's nodes, instances and replicas
(:class:`~.snapshot.SnapshotMemo`), Algorithm 1's per-model match
(:class:`~warmserve.policy.replica_match.MatchMemo`), each model's fair-share demand and its last
autoscaler answer when that read no clock — each reused only for inputs equal to the ones it was
computed from, so every decision is the one a full rebuild makes (property-tested).

**Fairness**: the autoscaler's bounds are capped by each model's demand-weighted max-min share
of the GPUs (:mod:`warmserve.policy.fairness`) whenever what the models want does not fit; the
GPUs are divided between tenants (``ModelEntry.namespace``) first, then between a tenant's models.

**Reclaim** (beyond the paper, docs/policy.md): a model with requests held at the gateway
whose start found no GPU group may take one from instances other models can spare
(:mod:`warmserve.policy.reclaim`): they are drained (grace) and the model starts there once they
are done.

Decision order per call: the autoscaler for each model (sorted): its starts where
:func:`~warmserve.policy.start_choice.choose_start` says (each applied to the snapshot before the
next), its drains, its grace ends; then, when a re-plan is due, Algorithm 1 on the snapshot
*after* the starts: evictions (of replicas whose GPUs a new replica needs) before loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from warmserve.policy.autoscaler import (
    ScaleDecision,
    fair_demand_counts,
)
from warmserve.policy.autoscaler import decide as autoscale
from warmserve.policy.cluster import (
    ClusterState,
    Instance,
    InstancePhase,
    ReplicaKind,
)
from warmserve.policy.evict_aware_placement import PrewarmPlan, plan_prewarm
from warmserve.policy.fairness import FairDemand, fair_caps
from warmserve.policy.predictor import season_length
from warmserve.policy.reclaim import plan_reclaim
from warmserve.policy.replica_match import MatchMemo
from warmserve.policy.start_choice import NoCapacity, choose_start

from .config import ControlConfig
from .decisions import Decision, Decisions, Drain, EndGrace, Evict, Prewarm, Start
from .demand import observed_demand
from .free_growth import FreeGrowth
from .observation import InstanceObs, Observation
from .snapshot import (
    ReplicaKey,
    ReplicaMeta,
    SnapshotMemo,
    apply_start,
    build_state,
    instance_key,
)
from .spares import SpareTracking
from .tracking import ModelEntry, ModelState, ModelTracking

SURPLUS: ReplicaMeta = (ReplicaKind.BURST, 0, 0.0)  # a replica kept though no longer wanted

__all__ = ["ControlConfig", "Controller", "ModelEntry"]


class Controller(ModelTracking, SpareTracking):
    """See the module docstring.  Deterministic; time comes from the observations."""

    def __init__(self, config: ControlConfig) -> None:
        self.cfg = config
        self.windows_per_day = season_length(config.window_s, config.day_s)
        self.models: dict[str, ModelState] = {}
        self.window_index: int | None = None
        self.meta: dict[ReplicaKey, ReplicaMeta] = {}
        self.grace_seen: dict[str, float] = {}
        self.free_growth = FreeGrowth()  # re-plan trigger (c)
        self.known_instances: set[str] = set()
        self.ended: set[str] = set()  # instances this controller ended or drained away
        self.replan_reasons: set[str] = {"start"}
        self.stale: set[str] = set()  # models whose forecast must be recomputed
        self.last_plan: PrewarmPlan | None = None
        # model -> the last window in which its demand passed its forecast peak (overshoot)
        self.overshoot: dict[str, int] = {}
        self.last_plan_state: ClusterState | None = None  # the snapshot it was planned on
        self.plans = 0
        # the last observation observe() measured, and its demand per model
        self.observed: tuple[Observation | None, dict[str, float]] = (None, {})
        # model -> (inputs, answer) of its last autoscaler call that read no clock
        self._scale_memo: dict[str, tuple[tuple[object, ...], ScaleDecision]] = {}
        self.snapshot_memo = SnapshotMemo()  # reuse between polls (pure: same snapshot)
        self.match_memo = MatchMemo()  # Algorithm 1's per-model match between plans (pure)
        # model -> ((load, active instances, entry), (want, need)) of its last fair-share call
        self._fair_memo: dict[str, tuple[tuple[float, int, ModelEntry],
                                         tuple[FairDemand, FairDemand]]] = {}

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
        self._note_overshoot()
        seen, loads = self.observed
        if seen is not obs or loads.keys() != self.models.keys():
            loads = observed_demand(obs, self.models)  # not the observation observe() measured
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
            d = self._autoscale(
                st, loads.get(model, 0.0), mine.get(model, []), obs.now, grace_by_key,
                min(entry.min_instances, hi), hi,
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
                    if self._spare_of(model):
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

    def _autoscale(
        self, st: ModelState, load: float, insts: list[Instance], now: float,
        grace_by_key: dict[str, float], lo: int, hi: int,
    ) -> ScaleDecision:
        """:func:`warmserve.policy.autoscaler.decide` for one model, its last answer reused
        when it provably repeats: with no instance in grace and a decision that
        did not scale down, the answer reads neither the clock nor the memory, only the spec,
        the load, the count of instances and the bounds."""
        spec = st.entry.spec
        key: tuple[object, ...] | None = None
        if all(i.phase != InstancePhase.GRACE for i in insts):
            key = (spec, self.cfg.autoscaler, load, len(insts), lo, hi)
            hit = self._scale_memo.get(spec.name)
            if hit is not None and hit[0] == key:
                return hit[1]
        d = autoscale(spec, load, insts, self.cfg.autoscaler, now, st.memory,
                      grace_started_s=grace_by_key, min_instances=lo, max_instances=hi)
        if key is not None and d.memory.low_since_s is None and not d.drain:
            # "load above band" or "in band": the two branches that read no clock or memory
            # (waiting out the delay remembers when; a drain names instances)
            self._scale_memo[spec.name] = (key, d)
        return d

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
        hysteresis band merely keeps: a band instance running at a quarter of its
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
            # weight (demand-weighted shares): the instances the load alone asks for
            want, need, weight = fair_demand_counts(
                load, e.spec.max_batch, current, self.cfg.autoscaler, e.min_instances,
                e.max_instances,
            )
            wants[model] = FairDemand(e.spec.tp, want, weight, e.namespace)
            needs[model] = FairDemand(e.spec.tp, need, weight, e.namespace)
            memo[model] = (key, (wants[model], needs[model]))
        if sum(d.want * d.tp for d in wants.values()) <= capacity:
            return {m: d.want for m, d in wants.items()}
        return fair_caps(needs, capacity)

    def _note_free(self, state: ClusterState) -> None:
        if self.free_growth.grew(state):
            self.replan_reasons.add("free memory grew")

    def _plan(
        self, state: ClusterState, slot_of: Mapping[ReplicaKey, str]
    ) -> tuple[PrewarmPlan, list[Decision]]:
        plan = plan_prewarm(
            state, evict_aware=self.cfg.evict_aware, spare_replicas=self.spares(),
            memo=self.match_memo,
        )
        self.plans += 1
        self.last_plan = plan
        self.last_plan_state = state
        self.replan_reasons = set()
        self.free_growth.reset(state)
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
