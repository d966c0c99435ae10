"""The discrete-event loop: requests, engines, GPU accounting (issue 3 §1; issue 11).

One :class:`Simulation` runs one system on one workload.  Time is seconds from the start of the
simulated period.  Events live in one ``heapq`` (time, sequence number, kind, object, version);
arrivals are merged in from the sorted request arrays without going through the heap.  Stale
instance events are skipped by a version number.

What is simulated here (the physics; what *decides* is elsewhere):

- **Gateway**: a request goes to the least-loaded *serving* instance of its model with a free
  batch slot and KV room; otherwise it waits in the model's FIFO queue (also while an instance
  starts).  Waiting requests are the gateway's *held* demand.
- **Engine**: continuous batching per instance, analytically between membership changes (see
  :mod:`warmserve.sim.cluster`); a grace instance's lent replicas are evicted if its KV use grows
  into them (§4.1).
- **Start-up and loading** (§6, Fig. 8) are carried out by :mod:`warmserve.sim.executor`.

Who decides (:mod:`warmserve.sim.hooks`): for controlled systems (WarmServe and the autoscaling
baselines) the loop is an executor of :class:`warmserve.control.Controller` decisions — the same
controller, rules and snapshot the operator runs (:mod:`warmserve.sim.executor`); fixed-layout
baselines create their instances at setup; Prism activates instances from its plug-in.  No
baseline code lives here.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import Counter, deque
from collections.abc import Callable

import numpy as np

from warmserve.control.controller import ControlConfig, Controller, ModelEntry
from warmserve.control.history import LoadHistory
from warmserve.policy import autoscaler as autoscaler_mod
from warmserve.policy.cluster import ReplicaKind
from warmserve.policy.placement import is_laminar
from warmserve.sim.cluster import (
    GRACE,
    SERVING,
    STARTING,
    STOPPED,
    SimCluster,
    SimInstance,
    SimReplica,
)
from warmserve.sim.executor import ControlExecutor
from warmserve.sim.hooks import Controlled, SystemHooks
from warmserve.sim.model import (
    DROP_GRACE_CUTOFF,
    DROP_NO_CAPACITY,
    DROP_QUEUE_TIMEOUT,
    DROP_UNFINISHED,
    SimModel,
    SimOutput,
    StartRecord,
    StaticInstance,
)
from warmserve.sim.sharing import dynamic_slowdown
from warmserve.sim.systems import SystemConfig

log = logging.getLogger("warmserve.sim")

EV_INST, EV_READY, EV_TICK, EV_WINDOW = 0, 1, 2, 3

__all__ = [
    "DROP_GRACE_CUTOFF",
    "DROP_NO_CAPACITY",
    "DROP_QUEUE_TIMEOUT",
    "DROP_UNFINISHED",
    "SimOutput",
    "Simulation",
    "StartRecord",
]


class Simulation:
    """One run of one system.  Deterministic: no randomness after the workload is drawn."""

    def __init__(
        self,
        *,
        system: SystemConfig,
        models: list[SimModel],
        cluster: SimCluster,
        arrival: np.ndarray,
        model_of: np.ndarray,
        input_tokens: np.ndarray,
        output_tokens: np.ndarray,
        duration_s: float,
        window_s: float,
        autoscaler: autoscaler_mod.AutoscalerConfig,
        scale_interval_s: float,
        queue_timeout_s: float,
        drain_s: float,
        predictor: object | None = None,
        hooks: SystemHooks | None = None,
        initial_instances: dict[str, int] | None = None,
        progress: Callable[[float], None] | None = None,
        check: bool = False,
    ) -> None:
        self.check = check
        self.sys = system
        self.hooks = hooks or (Controlled() if system.mode == "autoscale" else SystemHooks())
        self.models = models
        self.by_name = {m.spec.name: m for m in models}
        self.specs = {m.spec.name: m.spec for m in models}
        self.cl = cluster
        self.arr = arrival.tolist()
        self.mod = model_of.tolist()
        self.inp = input_tokens.tolist()
        self.out = output_tokens.tolist()
        n = len(self.arr)
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.drop: list[str | None] = [None] * n
        self.assigned = [math.nan] * n
        self.start_failures = 0
        self.failure_kinds: Counter[str] = Counter()
        self.duration = duration_s
        self.window_s = window_s
        self.scale_interval = scale_interval_s
        self.queue_timeout = queue_timeout_s
        self.drain_s = drain_s
        self.initial = initial_instances or {}
        self.progress = progress

        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.iid = 0
        self.instances: list[SimInstance] = []
        self.queue: list[deque[int]] = [deque() for _ in models]
        self.inflight = [0] * len(models)
        self.starts: list[StartRecord] = []
        self.held = 0
        self.t_held = 0.0
        self.t_now = 0.0
        self.gpu_seconds = 0.0
        self.universal_seconds = 0.0
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.lent_evictions = 0
        self.lent_placements = 0
        self.events = 0
        self.done = 0
        self.controller: Controller | None = None
        self.executor: ControlExecutor | None = None
        if self.hooks.controlled:
            self.controller = Controller(
                ControlConfig(
                    window_s=window_s,
                    autoscaler=autoscaler,
                    predictor=predictor,  # type: ignore[arg-type]
                    prewarm=system.prewarm,
                    proactive=system.proactive,
                    evict_aware=system.evict_aware,
                )
            )
            self.controller.set_models(
                {m.spec.name: ModelEntry(m.spec) for m in models if m.placeable}, 0.0
            )
            for m in models:
                if m.placeable and m.avg_history:
                    hist = LoadHistory(
                        window_s,
                        end=0,
                        avg=np.array(m.avg_history, dtype=np.float64),
                        peak=np.array(m.peak_history, dtype=np.float64),
                        max_windows=max(len(m.avg_history) + 1, 16),
                    )
                    self.controller.seed_history(m.spec.name, hist, 0.0)
            self.executor = ControlExecutor(self, self.controller)

    # ------------------------------------------------------------------ event plumbing

    def push(self, t: float, kind: int, obj: object = None, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, ver))

    def run(self) -> SimOutput:
        self._setup()
        n = len(self.arr)
        nxt = 0
        t_end = self.duration + self.drain_s
        t = 0.0
        last_progress = 0.0
        while True:
            t_arr = self.arr[nxt] if nxt < n else math.inf
            t_ev = self.heap[0][0] if self.heap else math.inf
            if t_arr == math.inf and self.done >= n:
                break
            t = min(t_arr, t_ev)
            if t > t_end or t == math.inf:
                break
            self.t_now = t
            self.events += 1
            if t_arr <= t_ev:
                self._arrive(nxt, t_arr)
                nxt += 1
            else:
                _, _, kind, obj, ver = heapq.heappop(self.heap)
                if kind == EV_INST:
                    assert isinstance(obj, SimInstance)
                    if ver == obj.version and obj.phase != STOPPED:
                        self._engine_event(obj, t)
                elif kind == EV_READY:
                    assert isinstance(obj, SimInstance)
                    self._ready(obj, t)
                elif kind == EV_TICK:
                    self._tick(t)
                elif kind == EV_WINDOW:
                    self._window(t)
            if self.progress is not None and t - last_progress >= 60.0:
                last_progress = t
                self.progress(min(t, self.duration))
        end = min(max(t, self.duration), t_end) if math.isfinite(t) else self.duration
        for i in range(n):
            if math.isnan(self.finish[i]) and self.drop[i] is None:
                self.drop[i] = DROP_UNFINISHED
        self._account(end)
        return SimOutput(
            system=self.sys.name,
            first_token=np.array(self.first_token),
            finish=np.array(self.finish),
            drop=self.drop,
            starts=self.starts,
            gpu_seconds=self.gpu_seconds,
            universal_gpu_seconds=self.universal_seconds,
            timeline=self.timeline,
            end_s=end,
            plans=self.controller.plans if self.controller else 0,
            unplaced=self.executor.unplaced if self.executor else 0,
            lent_evictions=self.lent_evictions,
            lent_placements=self.lent_placements,
            events=self.events,
            assigned=np.array(self.assigned),
            start_failures=self.start_failures,
            failure_kinds=dict(sorted(self.failure_kinds.items())),
        )

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        self.hooks.setup(self)
        if self.executor is not None:
            self.executor.bootstrap(
                0.0,
                {m.spec.name: self.initial.get(m.spec.name, 0) for m in self.models if m.placeable},
            )
            self.executor.step(0.0)
            self.push(self.scale_interval, EV_TICK)
        self.push(self.window_s, EV_WINDOW)
        self._sample(0.0)

    def create_static(self, s: StaticInstance) -> SimInstance:
        m = self.by_name[s.model]
        inst = self.new_instance(m, s.node, s.gpus, 0.0, 0.0, 0.0, hit=True)
        inst.slowdown = s.slowdown
        if s.kv_cap_tokens is not None:
            inst.kv_cap_tokens = s.kv_cap_tokens
        if s.max_batch is not None:
            inst.max_batch = s.max_batch
        if s.config_slowdown is not None:
            inst.config_slowdown = s.config_slowdown
            inst.prefill_config_slowdown = s.prefill_config_slowdown
            for other in self.instances:
                if (
                    other is not inst
                    and other.node == inst.node
                    and set(other.gpus) & set(inst.gpus)
                ):
                    other.peers.append(inst)
                    inst.peers.append(other)
        inst.phase = SERVING
        return inst

    def new_instance(
        self,
        m: SimModel,
        node: str,
        gpus: tuple[int, ...],
        t: float,
        ready: float,
        full: float,
        hit: bool,
    ) -> SimInstance:
        self.iid += 1
        inst = SimInstance(
            iid=self.iid,
            model=m.spec.name,
            midx=m.idx,
            node=node,
            gpus=tuple(gpus),
            engine=m.engine,
            max_batch=m.spec.max_batch,
            kv_cap_tokens=m.kv_cap_tokens,
            kv_bytes_per_token=m.kv_bytes_per_token,
            t_start=t,
            ready_at=ready,
            full_at=full,
            hit=hit,
            t_last=t,
        )
        self.instances.append(inst)
        self._account(t)
        for g in inst.gpus:
            if (node, g) not in self.cl.holder:  # colocated static instances share GPUs
                self.held += 1
            self.cl.holder[(node, g)] = inst
        return inst

    # ------------------------------------------------------------------ accounting

    def account(self, t: float) -> None:
        """Integrate GPU-seconds held by instances and held only by replicas (universal)."""
        t = min(t, self.duration)  # GPU-hours of the simulated period only (not the drain)
        if t > self.t_held:
            dt = t - self.t_held
            self.gpu_seconds += self.held * dt
            universal = {(r.node, g) for r in self.cl.replicas for g in r.gpus} - set(
                self.cl.holder
            )
            self.universal_seconds += len(universal) * dt
            self.t_held = t

    def sample(self, t: float) -> None:
        self.timeline.append((t, self.cl.counts()))

    _account = account
    _sample = sample

    # ------------------------------------------------------------------ requests

    def _set_inflight(self, midx: int, t: float, delta: int) -> None:
        self.inflight[midx] += delta
        if self.controller is not None:  # demand (warmserve.control.demand), measured exactly
            self.controller.measure(self.models[midx].spec.name, t, self.inflight[midx])

    def _arrive(self, rid: int, t: float) -> None:
        midx = self.mod[rid]
        m = self.models[midx]
        if not m.placeable:
            self.drop[rid] = DROP_NO_CAPACITY
            self.done += 1
            return
        self._set_inflight(midx, t, +1)
        q = self.queue[midx]
        q.append(rid)
        if len(q) == 1:
            self._dispatch(midx, t)
        if q and self.executor is not None:
            self.executor.step(t, only=m.spec.name)
        elif q:
            self.hooks.on_waiting(self, m, t)

    def _dispatch(self, midx: int, t: float) -> None:
        """Hand queued requests of a model to serving instances with a free slot, FIFO."""
        q = self.queue[midx]
        while q:
            rid = q[0]
            if t - self.arr[rid] > self.queue_timeout:
                q.popleft()
                self.drop[rid] = DROP_QUEUE_TIMEOUT
                self.done += 1
                self._set_inflight(midx, t, -1)
                continue
            need = self.inp[rid] + self.out[rid]
            best = None
            for inst in self.instances:
                if inst.midx != midx or inst.phase != SERVING or not inst.free_slot(need):
                    continue
                if best is None or inst.n_assigned < best.n_assigned:
                    best = inst
            if best is None:
                return
            q.popleft()
            self._assign(best, rid, t)

    def _assign(self, inst: SimInstance, rid: int, t: float) -> None:
        self.assigned[rid] = t
        inst.last_request_s = t
        inst.settle(t)
        was_busy = inst.busy
        inst.pending.append(rid)
        inst.n_assigned += 1
        inst.kv_reserved += self.inp[rid] + self.out[rid]
        if inst.prefill_end < 0:
            self._start_prefill(inst, t)
            self._reschedule(inst, t)
        if inst.peers and inst.busy != was_busy:
            self._retime_peers(inst, t)

    def _slowdown_now(self, inst: SimInstance, prefill: bool = False) -> float:
        """The instance's slowdown for work timed now (dynamic for shared GPUs)."""
        if inst.config_slowdown is None:
            return inst.slowdown
        config = inst.config_slowdown
        if prefill and inst.prefill_config_slowdown is not None:
            config = inst.prefill_config_slowdown
        return dynamic_slowdown(config, sum(1 for p in inst.peers if p.busy))

    def _retime_peers(self, inst: SimInstance, t: float) -> None:
        """A shared instance turned busy or idle: its neighbours' decode steps change speed
        from now on (a prefill already running keeps the speed it was timed with)."""
        for peer in inst.peers:
            if peer.phase == STOPPED or peer.prefill_end >= 0 or not peer.running:
                continue
            peer.settle(t)
            self._reschedule(peer, t)

    def _start_prefill(self, inst: SimInstance, t: float) -> None:
        batch = list(inst.pending)
        inst.pending.clear()
        p = inst.engine.prefill_s([self.inp[r] for r in batch]) * self._slowdown_now(inst, True)
        layers = self.by_name[inst.model].spec.num_layers
        # The last layer's compute cannot finish before that layer is resident (streaming).
        inst.prefill_end = max(t + p, inst.full_at + p / layers)
        inst.prefill_batch = batch
        inst.step_s = 0.0

    def _reschedule(self, inst: SimInstance, t: float) -> None:
        inst.version += 1
        if inst.prefill_end >= 0:
            self.push(inst.prefill_end, EV_INST, inst, inst.version)
            return
        if not inst.running:
            inst.step_s = 0.0
            return
        if t < inst.full_at:  # decode needs every layer resident
            inst.step_s = 0.0
            self.push(inst.full_at, EV_INST, inst, inst.version)
            return
        kv = round(inst.kv_tokens_now())
        inst.step_s = inst.engine.decode_step_s(len(inst.running), kv) * self._slowdown_now(inst)
        target = inst.running[0][0]
        self.push(t + max(target - inst.v, 0.0) * inst.step_s, EV_INST, inst, inst.version)

    def _engine_event(self, inst: SimInstance, t: float) -> None:
        inst.settle(t)
        was_busy = inst.busy
        if inst.prefill_end >= 0 and t >= inst.prefill_end - 1e-12:
            for rid in inst.prefill_batch:
                self.first_token[rid] = t
                n_out = self.out[rid]
                if n_out <= 1:
                    self._complete(inst, rid, t)
                else:
                    heapq.heappush(inst.running, (inst.v + n_out - 1, rid))
                    inst.sum_in_running += self.inp[rid]
                    inst.sum_v0_running += inst.v
            inst.prefill_batch = []
            inst.prefill_end = -1.0
        while inst.running and inst.running[0][0] <= inst.v + 1e-6:
            target, rid = heapq.heappop(inst.running)
            inst.sum_in_running -= self.inp[rid]
            inst.sum_v0_running -= target - (self.out[rid] - 1)
            self._complete(inst, rid, t)
        if not inst.running:
            inst.sum_in_running = 0
            inst.sum_v0_running = 0.0
        if inst.pending and inst.prefill_end < 0:
            self._start_prefill(inst, t)
        if inst.phase == GRACE and inst.lent:
            self._check_lent(inst, t)
        self._reschedule(inst, t)
        if inst.peers and inst.busy != was_busy:
            self._retime_peers(inst, t)
        if inst.phase == SERVING:
            self._dispatch(inst.midx, t)
        elif inst.phase == GRACE and inst.n_assigned == 0 and self.executor is not None:
            self.executor.step(t)  # its last request finished: the grace may end

    def _complete(self, inst: SimInstance, rid: int, t: float) -> None:
        self.finish[rid] = t
        self.done += 1
        inst.n_assigned -= 1
        inst.served += 1
        inst.kv_reserved -= self.inp[rid] + self.out[rid]
        self._set_inflight(inst.midx, t, -1)

    # ------------------------------------------------------------------ instances

    def instances_of(self, name: str) -> list[SimInstance]:
        return [i for i in self.instances if i.model == name and i.phase != STOPPED]

    def live(self) -> list[SimInstance]:
        return [i for i in self.instances if i.phase != STOPPED]

    def failure_kind(self, tp: int) -> str:
        """Why a start found no group: the cluster is ``full`` (fewer than ``tp`` GPUs free),
        the free GPUs are ``spread`` over nodes, or a node has ``tp`` free GPUs but no group the
        placement may use (``fragmented``: not an aligned block)."""
        free = [
            sum(1 for g in range(self.cl.gpus_per_node) if (n, g) not in self.cl.holder)
            for n in self.cl.node_names
        ]
        if max(free, default=0) >= tp:
            return "fragmented"
        return "spread" if sum(free) >= tp else "full"

    def schedule_ready(self, inst: SimInstance, at: float) -> None:
        """``inst`` serves from ``at`` (at once if ``at`` is now or past)."""
        if at <= self.t_now:
            self._ready(inst, self.t_now)
        else:
            self.push(at, EV_READY, inst)

    def _ready(self, inst: SimInstance, t: float) -> None:
        if inst.phase != STARTING:
            return
        inst.phase = SERVING
        inst.t_last = t
        self._dispatch(inst.midx, t)

    def _check_lent(self, inst: SimInstance, t: float) -> None:
        """Evict lent replicas (newest first) if the instance's KV use grows into them (§4.1)."""
        while inst.lent and inst.kv_tokens_now() > inst.kv_usable_tokens:
            rep = inst.lent[-1]
            self.cl.remove_replica(rep, t)
            self.lent_evictions += 1

    def cut_off(self, inst: SimInstance, t: float) -> None:
        """Its grace period ran out with requests still running: they are dropped."""
        inst.settle(t)
        rids = list(inst.pending) + list(inst.prefill_batch) + [r for _, r in inst.running]
        inst.pending.clear()
        inst.prefill_batch = []
        inst.prefill_end = -1.0
        inst.running = []
        inst.sum_in_running = 0
        inst.sum_v0_running = 0.0
        for rid in rids:
            self.drop[rid] = DROP_GRACE_CUTOFF
            self.done += 1
            inst.n_assigned -= 1
            inst.kv_reserved -= self.inp[rid] + self.out[rid]
            self._set_inflight(inst.midx, t, -1)

    def terminate(self, inst: SimInstance, t: float) -> None:
        self._account(t)
        inst.phase = STOPPED
        inst.version += 1
        for g in inst.gpus:
            if self.cl.holder.get((inst.node, g)) is inst:
                other = next((p for p in inst.peers if p.phase != STOPPED and g in p.gpus), None)
                if other is not None:  # a GPU shared with a live instance stays held
                    self.cl.holder[(inst.node, g)] = other
                else:
                    del self.cl.holder[(inst.node, g)]
                    self.held -= 1
        for p in inst.peers:
            if inst in p.peers:
                p.peers.remove(inst)
        inst.peers = []
        for rep in list(inst.lent):
            rep.lender = None
        inst.lent.clear()
        m = self.by_name[inst.model]
        if self.sys.on_stop in ("replica", "cache") and t >= inst.full_at:
            # WarmServe keeps the weights as a slot (§4.1; the agent does the same, and the
            # controller scores it like any slot it did not plan); SLLM-GPU's cache keeps them
            # with its own priority, T_c (the cost of a miss).
            prio = (
                (ReplicaKind.BASIC, 0, m.spec.cold_start_s) if self.sys.on_stop == "cache" else None
            )
            rep = SimReplica(
                inst.model,
                inst.node,
                inst.gpus,
                m.spec.bytes_per_gpu,
                m.spec.num_layers,
                t_begin=t,
                per_layer_s=0.0,
                priority=prio,
            )
            self._make_room(rep, t)
            self.cl.add_replica(rep)
        self.instances = [i for i in self.instances if i.phase != STOPPED]
        self._sample(t)

    _terminate = terminate

    def _make_room(self, new: SimReplica, t: float) -> None:
        """Cache mode: drop the oldest other replicas on these GPUs until ``new`` fits."""
        used = self.cl.replica_bytes()
        for g in new.gpus:
            while used.get((new.node, g), 0) + new.bytes_per_gpu > self.cl.hbm_bytes:
                victims = [r for r in self.cl.replicas if r.node == new.node and g in r.gpus]
                if not victims:
                    break
                self.cl.remove_replica(victims[0], t)
                used = self.cl.replica_bytes()

    # ------------------------------------------------------------------ ticks & windows

    def _tick(self, t: float) -> None:
        assert self.executor is not None
        self.executor.step(t)
        for midx in range(len(self.models)):
            if self.queue[midx]:
                self._dispatch(midx, t)
        if t < self.duration or self.done < len(self.arr):
            self.push(t + self.scale_interval, EV_TICK)

    def _window(self, t: float) -> None:
        if self.check:
            self.check_invariants(t)
        if self.executor is not None:
            self.executor.step(t)
        self._account(t)
        self._sample(t)
        if self.check:
            self.check_invariants(t)
        if t + self.window_s <= self.duration + self.drain_s and (
            t < self.duration or self.done < len(self.arr)
        ):
            self.push(t + self.window_s, EV_WINDOW)

    def check_invariants(self, t: float) -> None:
        """State invariants (tests run with ``check=True``): no GPU memory over-committed, every
        holder is a live instance on its GPUs, and with evict-aware placement the GPU sets of
        replicas and instances on a node are laminar (§5.2: disjoint or nested)."""
        if self.controller is not None:  # the one demand rule matches the exact counter
            from warmserve.control.demand import observed_demand

            assert self.executor is not None
            obs = self.executor.observation(t)
            want = observed_demand(obs, [m.spec.name for m in self.models if m.placeable])
            for m in self.models:
                if m.placeable and want[m.spec.name] != self.inflight[m.idx]:
                    raise AssertionError(
                        f"t={t}: demand of {m.spec.name} {want[m.spec.name]} != "
                        f"in flight {self.inflight[m.idx]}"
                    )
        used = self.cl.replica_bytes()
        for (node, g), b in used.items():
            inst = self.cl.holder.get((node, g))
            if inst is None and b > self.cl.hbm_bytes:
                raise AssertionError(f"t={t}: {node}/gpu{g} holds {b} replica bytes > HBM")
        for (node, g), inst in self.cl.holder.items():
            if inst.phase == STOPPED or inst.node != node or g not in inst.gpus:
                raise AssertionError(f"t={t}: stale holder on {node}/gpu{g}")
        if self.sys.evict_aware:
            for node in self.cl.node_names:
                sets = [r.gpus for r in self.cl.replicas if r.node == node]
                sets += [i.gpus for i in self.live() if i.node == node]
                if not is_laminar(sets):
                    raise AssertionError(f"t={t}: partial overlap on {node}: {sets}")
