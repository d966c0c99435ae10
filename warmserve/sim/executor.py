"""The simulator as an executor of the control layer's decisions.

The same :class:`warmserve.control.Controller` the operator runs decides here; this module only

* reports the simulated cluster as an :class:`~warmserve.control.observation.Observation`
  (replicas as slots, instances with their requests in flight, the gateway's queue as held
  requests), and
* carries decisions out with the simulator's physics: a ``Start`` pays the start-up stages and
  loads the missing layers over the host link (streaming for WarmServe), a ``Drain`` puts an
  instance into its grace period, an ``EndGrace`` stops it (requests still running are cut
  off), a ``Prewarm`` loads a replica (into a grace instance's lent KV memory when it lands on
  a grace GPU), an ``Evict`` removes one.

When it decides (the operator's equivalents in brackets): every ``scale_interval_s`` [poll],
at each window boundary [poll at the boundary], when a request finds no room [the gateway's
held-demand wake-up; autoscaling of that model only], and when a grace instance's last request
finishes [the agent's KV-page event].

A request finding no room wakes the controller only when it could start something
(:meth:`ControlExecutor.wake`): when the autoscaler's count rule
(:func:`~warmserve.policy.autoscaler.desired_instances`, the rule the controller applies) asks
for more instances than the model has, and not again while nothing that could give it GPUs has
changed since the last such call started nothing (no instance took or freed a GPU, the model's
instance count and desired count are the same); the next poll asks anyway.  Under saturation
this was a full snapshot per arriving request (82 % of the run).  It changes *when* the
controller is asked, not what it decides: a test keeps the results within a few percent of
asking at every waiting request.  After a decision that drained or ended an instance it
decides again at once [the agent's instance event wakes the loop], so a freed GPU is re-planned
without waiting for the next tick.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from warmserve.control import decisions as dec
from warmserve.control.controller import Controller
from warmserve.control.observation import GpuObs, InstanceObs, Observation, SlotObs
from warmserve.policy.autoscaler import desired_instances
from warmserve.policy.evict_aware_placement import plan_prewarm
from warmserve.sim.cluster import GRACE, PHASE, SERVING, STARTING, STOPPED, SimInstance, SimReplica
from warmserve.sim.model import SimModel, StartRecord

if TYPE_CHECKING:
    from warmserve.sim.hooks import SimAccess as Simulation

log = logging.getLogger("warmserve.sim")

MAX_ROUNDS = 3  # decide again after drains/ends, at most this many times in one instant


def instance_obs(inst: SimInstance) -> InstanceObs:
    """A simulated instance as the controller sees an agent's: requests assigned to it are
    both its in-flight load and its running requests (the engine queues nothing else).

    The previous report of the instance is returned again while its facts are equal (most
    instances change between two polls only in a few of them): the same value, and the
    snapshot memo then finds it by identity."""
    bpt = inst.kv_bytes_per_token
    kv_cap = int(inst.kv_cap_tokens * bpt)
    used = min(int(inst.kv_tokens_now() * bpt), kv_cap)
    phase = PHASE[inst.phase]
    grace = inst.grace_since if inst.phase == GRACE else None
    n = inst.n_assigned
    o = inst.last_obs
    if (
        o is not None
        and o.phase is phase
        and o.in_flight == n
        and o.kv_used_bytes == used
        and o.kv_capacity_bytes == kv_cap
        and o.grace_started_s == grace
    ):
        return o
    o = InstanceObs(
        inst.name,
        inst.model,
        inst.node,
        inst.gpus,
        phase,
        in_flight=n,
        running=n,
        kv_capacity_bytes=kv_cap,
        kv_used_bytes=used,
        grace_started_s=grace,
    )
    inst.last_obs = o
    return o


class ControlExecutor:
    """Observe the simulated cluster, ask the controller, carry its decisions out."""

    def __init__(self, sim: Simulation, controller: Controller) -> None:
        self.sim = sim
        self.ctl = controller
        self.unplaced = 0
        self._gpus: tuple[GpuObs, ...] | None = None
        self._slot_obs: dict[str, tuple[SimReplica, int, SlotObs]] = {}  # sid -> last SlotObs
        # how often each WarmServe mechanism acted (docs/evaluation.md: "exercised")
        self.counts = {"prewarms": 0, "evict_aware_choices": 0, "reclaim_drains": 0,
                       "kept_replica_hits": 0}
        # model -> ((GPU generation, instances, desired), failure kind or None): the last
        # wake-up that started nothing, and why
        self.idle_wake: dict[str, tuple[tuple[int, int, int], str | None]] = {}

    # ------------------------------------------------------------------ observe

    def observation(self, t: float) -> Observation:
        sim = self.sim
        cl = sim.cl
        if self._gpus is None:  # the GPUs never change during a run
            self._gpus = tuple(
                GpuObs(n, g, cl.hbm_bytes) for n in cl.node_names for g in range(cl.gpus_per_node)
            )
        gpus = self._gpus
        # a replica's facts never change but for its layers while it loads: its SlotObs is
        # reused while they stay the same (the snapshot memo then hits on it as well)
        known = self._slot_obs
        fresh: dict[str, tuple[SimReplica, int, SlotObs]] = {}
        slots_list = []
        for r in cl.replicas:
            layers = r.layers_at(t)
            hit = known.get(r.sid)
            if hit is None or hit[0] is not r or hit[1] != layers:
                so = SlotObs(
                    r.sid, r.model, r.node, r.gpus, r.bytes_per_gpu, layers, priority=r.priority
                )
                hit = (r, layers, so)
            fresh[r.sid] = hit
            slots_list.append(hit[2])
        self._slot_obs = fresh
        slots = tuple(slots_list)
        insts = tuple(instance_obs(i) for i in sim.instances if i.phase != STOPPED)
        held = {m.spec.name: len(sim.queue[m.idx]) for m in sim.models if sim.queue[m.idx]}
        return Observation(t, gpus, slots, insts, held)

    # ------------------------------------------------------------------ decide + act

    def step(self, t: float, only: str | None = None) -> dec.Decisions | None:
        """Decide at ``t`` (``only``: autoscale that model only) and act; repeat after drains
        and grace ends (a bounded number of rounds).  Returns the last decisions."""
        out = None
        for _ in range(MAX_ROUNDS):
            obs = self.observation(t)
            self.ctl.observe(obs)
            out = self.ctl.decide(obs, only=None if only is None else (only,))
            if out.plan is not None:
                self.unplaced += len(out.plan.unplaced)
                self._count_evict_aware(out.plan)
            changed = self.execute(out, t)
            if not changed or only is not None:
                break
        return out

    def _count_evict_aware(self, plan: object) -> None:
        """Evict-aware placement acted when first fit would have placed the same replicas
        elsewhere (reported with the §7.5 ablation; one extra plan per plan, simulator only)."""
        state = self.ctl.last_plan_state
        if not self.ctl.cfg.evict_aware or state is None:
            return
        if not plan.place and not plan.unplaced:  # type: ignore[attr-defined]
            # nothing was left to place (either way places or refuses every request the
            # match left, and the match does not depend on the mode): first fit places none
            return
        ff = plan_prewarm(state, evict_aware=False, spare_replicas=self.ctl.spares(),
                          memo=self.ctl.match_memo)
        ours = {(r.model, r.node, r.gpus) for r in plan.place}  # type: ignore[attr-defined]
        if ours != {(r.model, r.node, r.gpus) for r in ff.place}:
            self.counts["evict_aware_choices"] += 1

    def wake(self, t: float, m: SimModel) -> None:
        """A request of ``m`` found no room: autoscale ``m`` now if that can start something
        (module docstring)."""
        name = m.spec.name
        st = self.ctl.models.get(name)
        if st is None:
            return
        sim = self.sim
        current = sum(1 for i in sim.by_model[m.idx] if i.phase in (STARTING, SERVING))
        e = st.entry
        want = desired_instances(
            float(sim.inflight[m.idx]), e.spec.max_batch, current, self.ctl.cfg.autoscaler,
            e.min_instances, e.max_instances,
        )
        if want <= current:
            return  # the autoscaler would start nothing
        last = self.idle_wake.get(name)
        if last is not None and last[0] == (sim.cl.generation, current, want):
            if last[1] is not None:  # the same failed start as last time
                sim.start_failures += 1
                sim.failure_kinds[last[1]] += 1
            return
        out = self.step(t, only=name)
        if out is not None and not any(isinstance(d, dec.Start) for d in out.items):
            kind = sim.failure_kind(m.spec.tp) if name in out.no_capacity else None
            self.idle_wake[name] = ((sim.cl.generation, current, want), kind)
        else:
            self.idle_wake.pop(name, None)

    def bootstrap(self, t: float, counts: dict[str, int]) -> None:
        """Instances serving when the simulated period begins, all weights resident."""
        obs = self.observation(t)
        self.ctl.observe(obs)
        for d in self.ctl.initial_starts(obs, counts):
            self._start(d, t, prewarmed=True)

    def execute(self, out: dec.Decisions, t: float) -> bool:
        """Carry ``out`` out; True when an instance was drained or ended (decide again)."""
        changed = False
        started = False
        for d in out.items:
            if isinstance(d, dec.Start):
                self._start(d, t)
                started = True
            elif isinstance(d, dec.Drain):
                self._drain(d, t)
                changed = True
            elif isinstance(d, dec.EndGrace):
                self._end(d, t)
                changed = True
            elif isinstance(d, dec.Evict):
                rep = self.sim.cl.replica(d.slot_id)
                if rep is not None:
                    self.sim.account(t)
                    self.sim.cl.remove_replica(rep, t)
            elif isinstance(d, dec.Prewarm):
                self._prewarm(d, t)
        for model, reason in out.no_capacity.items():
            sim = self.sim
            sim.start_failures += 1
            sim.failure_kinds[sim.failure_kind(sim.specs[model].tp)] += 1
            log.debug("event=start_failed model=%s reason=%r t=%.3f", model, reason, t)
        if started:
            self.sim.sample(t)
        return changed

    # ------------------------------------------------------------------ the physics of each

    def _find(self, instance_id: str) -> SimInstance | None:
        return next((i for i in self.sim.instances if i.name == instance_id), None)

    def _start(self, d: dec.Start, t: float, prewarmed: bool = False) -> None:
        sim = self.sim
        m = sim.by_name[d.model]
        sys = sim.sys
        sim.account(t)
        resident = 0
        # A load from scratch pays the start-up profile's fixed set-up before its first layer
        # arrives; a replica has paid it (or is paying it: the rest of it is waited for).
        copy_from = t + m.load_setup_s
        if d.slot_id:
            rep = sim.cl.replica(d.slot_id)
            if rep is not None:
                resident = rep.layers_at(t)
                copy_from = max(t, rep.t_begin)
                sim.cl.remove_replica(rep, t)
                if rep.kept and not prewarmed:
                    self.counts["kept_replica_hits"] += 1
        for sid in d.evicts:
            rep = sim.cl.replica(sid)
            if rep is not None:
                sim.cl.remove_replica(rep, t)
        layers = m.spec.num_layers
        if prewarmed:
            ready = full = t
            latency = 0.0
        else:
            stages = m.engine.startup_s(
                pooled_process=sys.pooled_process,
                engine_ready=sys.engine_ready,
                comm_group_ready=(d.hit and sys.comm_group_on_hit) or m.spec.tp == 1,
            )
            link = max(sim.cl.link_free[(d.node, g)] for g in d.gpus)
            missing = layers - resident
            per_layer = m.per_layer_load_s * (m.stock_slowdown if sys.stock_loader else 1.0)
            if sys.stream_layers:
                # WarmServe's worker copies the missing layers from the moment of the start,
                # overlapping the remaining stages; serving may begin once the first
                # prewarm_layers are resident.
                load_start = max(copy_from, link) if missing else t
                need = max(m.spec.resident_layers - resident, 0)
                ready = max(t + stages, load_start + need * per_layer)
                full = load_start + missing * per_layer
            else:
                # Stock vLLM: process, import, device, engine ... and all weights, in sequence.
                setup = copy_from - t if missing else 0.0
                ready = max(t + stages + setup, link) + missing * per_layer
                full = ready
            for g in d.gpus:
                sim.cl.link_free[(d.node, g)] = max(full, t)
            latency = ready - t
        inst = sim.new_instance(m, d.node, d.gpus, t, ready, full, d.hit)
        if not prewarmed:
            sim.starts.append(StartRecord(t, d.model, d.hit, latency))
        log.debug(
            "event=start model=%s node=%s gpus=%s hit=%s ready_in=%.3f",
            d.model,
            d.node,
            d.gpus,
            d.hit,
            ready - t,
        )
        sim.schedule_ready(inst, ready if ready > t else t)

    def _drain(self, d: dec.Drain, t: float) -> None:
        inst = self._find(d.instance_id)
        if inst is None or inst.phase != "serving":
            return
        inst.phase = GRACE
        inst.grace_since = t
        if d.reason.startswith("reclaimed"):
            self.counts["reclaim_drains"] += 1

    def _end(self, d: dec.EndGrace, t: float) -> None:
        inst = self._find(d.instance_id)
        if inst is None or inst.phase == STOPPED:
            return
        if inst.n_assigned:
            self.sim.cut_off(inst, t)
        self.sim.terminate(inst, t)

    def _prewarm(self, d: dec.Prewarm, t: float) -> None:
        sim = self.sim
        m = sim.by_name[d.model]
        layers = d.layers or m.spec.num_layers
        begin = max([t + m.load_setup_s] + [sim.cl.link_free[(d.node, g)] for g in d.gpus])
        lender = next(
            (
                i
                for i in sim.instances
                if i.phase == GRACE and i.node == d.node and set(i.gpus) & set(d.gpus)
            ),
            None,
        )
        rep = SimReplica(
            d.model, d.node, d.gpus, d.bytes_per_gpu, layers, begin, m.per_layer_load_s, lender
        )
        self.counts["prewarms"] += 1
        for g in d.gpus:
            sim.cl.link_free[(d.node, g)] = rep.t_done
        sim.cl.add_replica(rep)
        if lender is not None:
            lender.lent.append(rep)
            sim.lent_placements += 1
