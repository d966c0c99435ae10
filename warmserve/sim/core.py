"""The discrete-event loop: requests, instances, autoscaling, prewarming (issue 3 §1).

One :class:`Simulation` runs one system (a :class:`~warmserve.sim.systems.SystemConfig`) on one
workload.  Time is seconds from the start of the simulated period.  Events live in one ``heapq``
(time, sequence number, kind, object, version); arrivals are merged in from the sorted request
arrays without going through the heap.  Stale instance events are skipped by a version number.

What is simulated, and where the policy is called (never re-implemented here):

- **Gateway**: a request goes to the least-loaded *serving* instance of its model with a free
  batch slot and KV room; otherwise it waits in the model's FIFO queue (also while an instance
  starts).  Load for the policy is the model's requests in flight (queued + on an instance),
  measured by :class:`warmserve.policy.load.WindowLoadTracker`.
- **Autoscaler**: :func:`warmserve.policy.autoscaler.decide` on every queued arrival of a model
  and on a periodic tick (``policy.scale_interval_s``).  Scale-ups start instances where
  :func:`warmserve.policy.placement.choose_start` says; drains put instances into grace.
- **Windows** (``policy.window_s``): each model's window load is closed, appended to its history
  and forecast with :func:`warmserve.policy.predictor.forecast`; systems with prewarming then run
  :func:`warmserve.policy.placement.plan_prewarm` — also whenever GPUs free up.
- **Proactive prewarming** (§4.1): grace GPUs offer the Eq. 1 lendable memory
  (:func:`warmserve.policy.proactive.lendable_bytes`) to the planner; a lent replica is evicted if
  the grace instance's KV use grows into it; when the instance ends, its GPUs turn universal with
  the lent replicas and the old model's weights.
- **Start-up** (§6, Fig. 8): non-weight stages from the engine model's ``startup_s``; weights
  over the host→GPU link layer by layer; streaming systems start serving once the first
  ``prewarm_layers`` are resident and a prefill cannot finish before the last layer is in.
- **Engine**: continuous batching per instance, analytically between membership changes (see
  :mod:`warmserve.sim.cluster`).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from warmserve.policy import autoscaler as autoscaler_mod
from warmserve.policy.cluster import LoadForecast, ModelSpec, ReplicaKind
from warmserve.policy.load import WindowLoadTracker
from warmserve.policy.placement import NoCapacity, choose_start, is_laminar, plan_prewarm
from warmserve.policy.predictor import forecast as predict_forecast
from warmserve.sim.baselines.prism import (
    PrismFacts,
    PrismGpu,
    PrismModel,
    ResidentModel,
    plan_activation,
)
from warmserve.sim.baselines.sharing import dynamic_slowdown
from warmserve.sim.cluster import (
    GRACE,
    SERVING,
    STARTING,
    STOPPED,
    SimCluster,
    SimInstance,
    SimReplica,
)
from warmserve.sim.systems import SystemConfig

log = logging.getLogger("warmserve.sim")

EV_INST, EV_READY, EV_TICK, EV_WINDOW = 0, 1, 2, 3

DROP_QUEUE_TIMEOUT = "queue-timeout"
DROP_NO_CAPACITY = "no-capacity"
DROP_UNFINISHED = "unfinished-at-end"


@dataclass
class ModelRuntime:
    """Static facts about one served model in a run (built by :mod:`warmserve.sim.runner`)."""

    idx: int
    spec: ModelSpec
    engine: object  # H3b's EngineModel
    kv_bytes_per_token: float
    kv_cap_tokens: int  # per instance, on GPUs holding only this model
    per_layer_load_s: float  # one layer's share per GPU over the host link
    avg_history: list[float]
    peak_history: list[float]
    placeable: bool = True


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
    """Raw results of one run (turned into a table by :mod:`warmserve.sim.metrics`)."""

    system: str
    first_token: np.ndarray
    finish: np.ndarray
    drop: list[str | None]
    starts: list[StartRecord]
    gpu_seconds: float
    universal_gpu_seconds: float
    timeline: list[tuple[float, dict[str, int]]]
    end_s: float
    plans: int = 0
    unplaced: int = 0
    lent_evictions: int = 0
    lent_placements: int = 0
    events: int = 0
    assigned: np.ndarray | None = None
    start_failures: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)


class Simulation:
    """One run of one system.  Deterministic: no randomness after the workload is drawn."""

    def __init__(
        self,
        *,
        system: SystemConfig,
        models: list[ModelRuntime],
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
        static_instances: list[StaticInstance] | None = None,
        initial_instances: dict[str, int] | None = None,
        progress: Callable[[float], None] | None = None,
        check: bool = False,
        prism: PrismFacts | None = None,
    ) -> None:
        self.check = check
        self.prism = prism
        self.sys = system
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
        self.asc = autoscaler
        self.scale_interval = scale_interval_s
        self.queue_timeout = queue_timeout_s
        self.drain_s = drain_s
        self.predictor = predictor
        self.static = static_instances or []
        self.initial = initial_instances or {}
        self.progress = progress

        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.iid = 0
        self.instances: list[SimInstance] = []
        self.queue: list[deque[int]] = [deque() for _ in models]
        self.inflight = [0] * len(models)
        self.trackers = [WindowLoadTracker(window_s, 0.0) for _ in models]
        self.avg_hist = [list(m.avg_history) for m in models]
        self.peak_hist = [list(m.peak_history) for m in models]
        self.forecasts: dict[str, LoadForecast] = {}
        self.scale_mem: dict[str, autoscaler_mod.ScaleMemory] = {}
        self.starts: list[StartRecord] = []
        self.held = 0
        self.t_held = 0.0
        self.gpu_seconds = 0.0
        self.universal_seconds = 0.0
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.plans = 0
        self.unplaced = 0
        self.lent_evictions = 0
        self.lent_placements = 0
        self.events = 0
        self.done = 0
        self.windows_per_day = max(1, round(86400.0 / window_s))

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
            plans=self.plans,
            unplaced=self.unplaced,
            lent_evictions=self.lent_evictions,
            lent_placements=self.lent_placements,
            events=self.events,
            assigned=np.array(self.assigned),
            start_failures=self.start_failures,
            failure_kinds=dict(sorted(self.failure_kinds.items())),
        )

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        if self.sys.mode in ("dedicated", "muxserve", "prism"):
            for s in self.static:
                self._create_static(s)
        else:
            self._refresh_forecasts()
            for m in self.models:
                for _ in range(self.initial.get(m.spec.name, 0)):
                    if not self._start(m, 0.0, prewarmed=True):
                        break
            if self.sys.prewarm:
                self._plan(0.0)
            self.push(self.scale_interval, EV_TICK)
        self.push(self.window_s, EV_WINDOW)
        self._sample(0.0)

    def _create_static(self, s: StaticInstance) -> None:
        m = self.by_name[s.model]
        inst = self._new_instance(m, s.node, s.gpus, 0.0, 0.0, 0.0, hit=True)
        inst.slowdown = s.slowdown
        if s.kv_cap_tokens is not None:
            inst.kv_cap_tokens = s.kv_cap_tokens
        if s.max_batch is not None:
            inst.max_batch = s.max_batch
        if s.config_slowdown is not None:
            inst.config_slowdown = s.config_slowdown
            inst.prefill_config_slowdown = s.prefill_config_slowdown
            for other in self.instances:
                if other is not inst and other.node == inst.node and set(other.gpus) & set(
                    inst.gpus
                ):
                    other.peers.append(inst)
                    inst.peers.append(other)
        inst.phase = SERVING

    def _new_instance(
        self, m: ModelRuntime, node: str, gpus: tuple[int, ...], t: float, ready: float,
        full: float, hit: bool,
    ) -> SimInstance:
        self.iid += 1
        inst = SimInstance(
            iid=self.iid, model=m.spec.name, midx=m.idx, node=node, gpus=tuple(gpus),
            engine=m.engine, max_batch=m.spec.max_batch, kv_cap_tokens=m.kv_cap_tokens,
            kv_bytes_per_token=m.kv_bytes_per_token, t_start=t, ready_at=ready, full_at=full,
            hit=hit, t_last=t,
        )
        self.instances.append(inst)
        self._account(t)
        for g in inst.gpus:
            if (node, g) not in self.cl.holder:  # colocated static instances share GPUs
                self.held += 1
            self.cl.holder[(node, g)] = inst
        return inst

    # ------------------------------------------------------------------ accounting

    def _account(self, t: float) -> None:
        """Integrate GPU-seconds held by instances and held only by replicas (universal)."""
        t = min(t, self.duration)  # GPU-hours of the simulated period only (not the drain)
        if t > self.t_held:
            dt = t - self.t_held
            self.gpu_seconds += self.held * dt
            universal = {
                (r.node, g) for r in self.cl.replicas for g in r.gpus
            } - set(self.cl.holder)
            self.universal_seconds += len(universal) * dt
            self.t_held = t

    def _sample(self, t: float) -> None:
        self.timeline.append((t, self.cl.counts()))

    # ------------------------------------------------------------------ requests

    def _set_inflight(self, midx: int, t: float, delta: int) -> None:
        self.inflight[midx] += delta
        self.trackers[midx].update(t, self.inflight[midx])

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
        if q and self.sys.mode == "autoscale":
            self._autoscale(m, t)
        elif q and self.prism is not None:
            self._prism_activate(m, t)

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
        elif inst.phase == GRACE and inst.n_assigned == 0:
            self._terminate(inst, t)

    def _complete(self, inst: SimInstance, rid: int, t: float) -> None:
        self.finish[rid] = t
        self.done += 1
        inst.n_assigned -= 1
        inst.served += 1
        inst.kv_reserved -= self.inp[rid] + self.out[rid]
        self._set_inflight(inst.midx, t, -1)

    # ------------------------------------------------------------------ instances

    def _instances_of(self, name: str) -> list[SimInstance]:
        return [i for i in self.instances if i.model == name and i.phase != STOPPED]

    def _start(self, m: ModelRuntime, t: float, prewarmed: bool = False) -> bool:
        """Start one instance of ``m`` where ``choose_start`` says; False when nothing fits.

        ``prewarmed``: an instance that exists when the run begins (the cluster was serving
        before the simulated period), ready at ``t`` with all weights resident.
        """
        state = self.cl.snapshot(t, self.specs, self._live(), self.forecasts, self.sys.proactive)
        choice = choose_start(state, m.spec.name)
        if isinstance(choice, NoCapacity):
            self.start_failures += 1
            self.failure_kinds[self._failure_kind(m.spec.tp)] += 1
            log.debug("event=start_failed model=%s reason=%r t=%.3f", m.spec.name, choice.reason, t)
            return False
        self._account(t)
        resident = 0
        if choice.replica is not None:
            rep = self.cl.find_replica(choice.replica)
            if rep is not None:
                resident = rep.layers_at(t)
                self.cl.remove_replica(rep, t)
        for ev in choice.evicts:
            rep = self.cl.find_replica(ev)
            if rep is not None:
                self.cl.remove_replica(rep, t)
        layers = m.spec.num_layers
        if prewarmed:
            ready = full = t
            latency = 0.0
        else:
            comm_ready = choice.hit and self.sys.comm_group_on_hit
            stages = m.engine.startup_s(
                pooled_process=self.sys.pooled_process,
                engine_ready=self.sys.engine_ready,
                comm_group_ready=comm_ready or m.spec.tp == 1,
            )
            link = max(self.cl.link_free[(choice.node, g)] for g in choice.gpus)
            wait = max(link - t, 0.0)
            per_layer = m.per_layer_load_s * self.sys.load_slowdown
            if self.sys.stream_layers:
                # WarmServe's worker copies the missing layers from the moment of the start,
                # overlapping the remaining stages (H3b's min_resident_layers assumes the same
                # head start); serving may begin once the first prewarm_layers are resident.
                load_start = t + wait
                need = max(m.spec.resident_layers - resident, 0)
                ready = max(t + stages, load_start + need * per_layer)
                full = load_start + (layers - resident) * per_layer
            else:
                # Stock vLLM: process, import, device, engine ... and all weights, in sequence.
                ready = t + stages + wait + (layers - resident) * per_layer
                full = ready
            for g in choice.gpus:
                self.cl.link_free[(choice.node, g)] = max(full, t)
            latency = ready - t
        inst = self._new_instance(m, choice.node, choice.gpus, t, ready, full, choice.hit)
        if not prewarmed:
            self.starts.append(StartRecord(t, m.spec.name, choice.hit, latency))
        log.debug(
            "event=start model=%s node=%s gpus=%s hit=%s ready_in=%.3f",
            m.spec.name, choice.node, choice.gpus, choice.hit, ready - t,
        )
        if ready <= t:
            self._ready(inst, t)
        else:
            self.push(ready, EV_READY, inst)
        return True

    def _failure_kind(self, tp: int) -> str:
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

    def _live(self) -> list[SimInstance]:
        return [i for i in self.instances if i.phase != STOPPED]

    def _ready(self, inst: SimInstance, t: float) -> None:
        if inst.phase != STARTING:
            return
        inst.phase = SERVING
        inst.t_last = t
        self._dispatch(inst.midx, t)

    def _drain(self, inst: SimInstance, t: float) -> None:
        """Scale-down: the instance enters its grace period (§2.1)."""
        if inst.phase == STARTING:
            # Not serving yet: nothing to drain, stop it now.
            self._terminate(inst, t)
            return
        inst.phase = GRACE
        inst.grace_since = t
        if inst.n_assigned == 0:
            self._terminate(inst, t)
        elif self.sys.proactive and self.sys.prewarm:
            self._plan(t)

    def _check_lent(self, inst: SimInstance, t: float) -> None:
        """Evict lent replicas (newest first) if the instance's KV use grows into them (§4.1)."""
        while inst.lent and inst.kv_tokens_now() > inst.kv_usable_tokens:
            rep = inst.lent[-1]
            self.cl.remove_replica(rep, t)
            self.lent_evictions += 1

    def _terminate(self, inst: SimInstance, t: float) -> None:
        self._account(t)
        inst.phase = STOPPED
        inst.version += 1
        for g in inst.gpus:
            if self.cl.holder.get((inst.node, g)) is inst:
                other = next(
                    (p for p in inst.peers if p.phase != STOPPED and g in p.gpus), None
                )
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
            layers = m.spec.num_layers
            score = m.spec.cold_start_s if self.sys.on_stop == "cache" else 0.0
            kind = ReplicaKind.BASIC if self.sys.on_stop == "cache" else ReplicaKind.BURST
            rep = SimReplica(
                inst.model, kind, 0, score, inst.node, inst.gpus, m.spec.bytes_per_gpu, layers,
                t_begin=t, per_layer_s=0.0,
            )
            self._make_room(rep, t)
            self.cl.replicas.append(rep)
        self.instances = [i for i in self.instances if i.phase != STOPPED]
        self._sample(t)
        if self.sys.prewarm:
            self._plan(t)

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

    # ------------------------------------------------------------------ Prism (§6.2)

    def _prism_state(self, t: float) -> tuple[list[PrismGpu], list[ResidentModel]]:
        """Prism's view now: per GPU (global index) its models, SLO-weighted rate and memory
        left for KV; and the resident instances idle beyond their model's threshold (the only
        ones eviction may take)."""
        assert self.prism is not None
        gpn = self.cl.gpus_per_node
        live = self._live()
        count = Counter(i.model for i in live)
        models: list[list[str]] = [[] for _ in range(self.cl.total_gpus)]
        w = [0.0] * self.cl.total_gpus
        kv = [self.prism.usable_bytes] * self.cl.total_gpus
        residents: list[ResidentModel] = []
        for inst in live:
            spec = self.specs[inst.model]
            rate = self.prism.rates.get(inst.model, 0.0) / count[inst.model]
            base = self.cl.node_names.index(inst.node) * gpn
            for g in inst.gpus:
                models[base + g].append(inst.model)
                w[base + g] += rate / self.prism.slo_s / spec.tp
                kv[base + g] -= spec.bytes_per_gpu
            idle_for = self.prism.idle_timeout_s.get(inst.model, 0.0)
            if inst.phase == SERVING and t - inst.last_request_s > idle_for:
                residents.append(
                    ResidentModel(
                        inst.name, tuple(base + g for g in inst.gpus), spec.bytes_per_gpu,
                        self.prism.slo_s, inst.last_request_s, inst.n_assigned,
                    )
                )
        gpus = [
            PrismGpu(i, i // gpn, tuple(models[i]), w[i], kv[i])
            for i in range(self.cl.total_gpus)
        ]
        return gpus, residents

    def _prism_activate(self, m: ModelRuntime, t: float) -> None:
        """A request waits and no instance can take it: activate one more instance of ``m``
        on a pooled engine, on the lowest-KVPR GPUs with room, evicting idle models if memory
        is short (Prism §6.2, §5.2).  One activation per model at a time."""
        assert self.prism is not None
        name = m.spec.name
        mine = self._instances_of(name)
        if any(i.phase == STARTING for i in mine):
            return
        gpn = self.cl.gpus_per_node
        gpus, residents = self._prism_state(t)
        # Reactivating an evicted model follows Prism's rule (lowest KVPR, sharing allowed);
        # an extra instance of a model that is running (our scale-out) only goes where no other
        # instance is working: a replica time-sharing a busy GPU would add no capacity.
        idle = {r.name for r in residents}
        own = [
            self.cl.node_names.index(i.node) * gpn + g
            for i in self._live()
            if i.model == name or (mine and i.name not in idle)
            for g in i.gpus
        ]
        pm = PrismModel(
            name, m.spec.weight_bytes, self.prism.rates.get(name, 0.0) / (len(mine) + 1),
            self.prism.slo_s, tp=m.spec.tp,
        )
        plan = plan_activation(
            gpus, residents, pm, t, 0.0, gpus_per_node=gpn,
            min_kv_bytes=self.prism.min_kv_bytes, exclude=own,
        )
        if plan is None:
            self.start_failures += 1
            self.failure_kinds["no-memory"] += 1
            return
        group, evict = plan
        for victim in evict:
            inst = next(i for i in self._live() if i.name == victim)
            self._terminate(inst, t)
        node = self.cl.node_names[group[0] // gpn]
        local = tuple(g % gpn for g in group)
        act = self.prism.activation_s[name]
        self._account(t)
        inst = self._new_instance(m, node, local, t, t + act, t + act, hit=False)
        inst.max_batch = self.prism.max_batch
        inst.config_slowdown = 1.0
        inst.last_request_s = t
        for other in self._live():
            if other is not inst and other.node == node and set(other.gpus) & set(local):
                other.peers.append(inst)
                inst.peers.append(other)
        self._prism_share_kv(node, local)
        self.starts.append(StartRecord(t, name, False, act))
        log.debug("event=prism_activate model=%s node=%s gpus=%s evict=%s", name, node, local,
                  evict)
        self.push(t + act, EV_READY, inst)
        self._sample(t)

    def _prism_share_kv(self, node: str, gpus: tuple[int, ...]) -> None:
        """Split the KV memory of shared GPUs among their instances by SLO-weighted rate, as
        the initial layout does (kvcached shares the pool on demand; this is its
        demand-weighted expectation).  A share below what an instance already holds only
        stops its admissions until requests finish."""
        assert self.prism is not None
        live = self._live()
        count = Counter(i.model for i in live)
        on = [i for i in live if i.node == node and set(i.gpus) & set(gpus)]
        for inst in on:
            spec = self.specs[inst.model]
            per_token = self.by_name[inst.model].kv_bytes_per_token / spec.tp
            tokens = None
            for g in inst.gpus:
                here = [o for o in live if o.node == node and g in o.gpus]
                weights = sum(self.specs[o.model].bytes_per_gpu for o in here)
                free = self.prism.usable_bytes - weights
                ws = {o.iid: self.prism.rates.get(o.model, 0.0) / count[o.model] for o in here}
                total = sum(ws.values())
                share = ws[inst.iid] / total if total > 0 else 1.0 / len(here)
                cap = int(max(free, 0.0) * share // per_token)
                tokens = cap if tokens is None else min(tokens, cap)
            inst.kv_cap_tokens = tokens or 0

    # ------------------------------------------------------------------ autoscaling

    def _autoscale(self, m: ModelRuntime, t: float) -> None:
        name = m.spec.name
        mine = self._instances_of(name)
        active_load = len(self.queue[m.idx]) + sum(
            i.n_assigned for i in mine if i.phase != GRACE
        )
        dec = autoscaler_mod.decide(
            m.spec, float(active_load), [i.as_policy() for i in mine], self.asc, t,
            self.scale_mem.get(name),
        )
        self.scale_mem[name] = dec.memory
        started = False
        for _ in range(dec.scale_up):
            if not self._start(m, t):
                break
            started = True
        if dec.drain:
            names = {d.name for d in dec.drain}
            for inst in mine:
                if inst.name in names:
                    self._drain(inst, t)
        if started:
            self._sample(t)

    def _tick(self, t: float) -> None:
        for m in self.models:
            if m.placeable:
                self._autoscale(m, t)
        for midx in range(len(self.models)):
            if self.queue[midx]:
                self._dispatch(midx, t)
        if t < self.duration or self.done < len(self.arr):
            self.push(t + self.scale_interval, EV_TICK)

    # ------------------------------------------------------------------ windows & prewarming

    def _refresh_forecasts(self) -> None:
        for m in self.models:
            self.forecasts[m.spec.name] = predict_forecast(
                self.avg_hist[m.idx], self.peak_hist[m.idx], self.windows_per_day,
                self.predictor,
            )

    def _window(self, t: float) -> None:
        if self.check:
            self.check_invariants(t)
        for m in self.models:
            wl = self.trackers[m.idx].close(t)
            self.avg_hist[m.idx].append(wl.avg)
            self.peak_hist[m.idx].append(wl.peak)
        self._refresh_forecasts()
        if self.sys.prewarm:
            self._plan(t)
        self._account(t)
        self._sample(t)
        if t + self.window_s <= self.duration + self.drain_s and (
            t < self.duration or self.done < len(self.arr)
        ):
            self.push(t + self.window_s, EV_WINDOW)

    def _plan(self, t: float) -> None:
        """Run Algorithm 1 on the current state and execute the plan (evict, keep, load)."""
        live = self._live()
        state = self.cl.snapshot(t, self.specs, live, self.forecasts, self.sys.proactive)
        plan = plan_prewarm(state, evict_aware=self.sys.evict_aware)
        self.plans += 1
        self.unplaced += len(plan.unplaced)
        self._account(t)
        needed = {(r.node, g) for r in plan.place for g in r.gpus}
        for r in plan.evict:
            rep = self.cl.find_replica(r)
            if rep is None:
                continue
            if self.sys.lazy_evict and not any((r.node, g) in needed for g in r.gpus):
                # Surplus but harmless: keep the weights (§4.1 keeps the previously active
                # model on its GPUs) at the lowest priority, so any start or later placement
                # that needs the GPUs evicts it first.
                rep.score = 0.0
                rep.kind = ReplicaKind.BURST
                continue
            self.cl.remove_replica(rep, t)
        for r in plan.keep:
            rep = self.cl.find_replica(r)
            if rep is not None:
                rep.kind, rep.rank, rep.score = r.kind, r.rank, r.score
        grace_at = {
            (i.node, g): i for i in live if i.phase == GRACE for g in i.gpus
        }
        for r in plan.place:
            m = self.by_name[r.model]
            layers = r.layers_resident or m.spec.resident_layers
            begin = max([t] + [self.cl.link_free[(r.node, g)] for g in r.gpus])
            lender = next((grace_at[(r.node, g)] for g in r.gpus if (r.node, g) in grace_at), None)
            rep = SimReplica(
                r.model, r.kind, r.rank, r.score, r.node, r.gpus, r.bytes_per_gpu, layers,
                begin, m.per_layer_load_s, lender,
            )
            for g in r.gpus:
                self.cl.link_free[(r.node, g)] = rep.t_done
            self.cl.replicas.append(rep)
            if lender is not None:
                lender.lent.append(rep)
                self.lent_placements += 1
        if self.check:
            self.check_invariants(t)

    def check_invariants(self, t: float) -> None:
        """State invariants (tests run with ``check=True``): no GPU memory over-committed, every
        holder is a live instance on its GPUs, and with evict-aware placement the GPU sets of
        replicas and instances on a node are laminar (§5.2: disjoint or nested)."""
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
                sets += [i.gpus for i in self._live() if i.node == node]
                if not is_laminar(sets):
                    raise AssertionError(f"t={t}: partial overlap on {node}: {sets}")
