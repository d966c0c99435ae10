"""The discrete-event loop: requests, engines, GPU accounting (issue 3 §1; issues 11, 12).

One :class:`Simulation` runs one system on one workload.  Time is seconds from the start of the
simulated period.  Events live in one ``heapq`` (time, sequence number, kind, object, version);
arrivals are merged in from the request stream without going through the heap.  Stale
instance events are skipped by a version number.

What is simulated here (the physics; what *decides* is elsewhere):

- **Gateway**: a request goes to the least-loaded *serving* instance of its model with a free
  batch slot and KV room; otherwise it waits in the model's FIFO queue (also while an instance
  starts).  Waiting requests are the gateway's *held* demand.
- **Engine**: continuous batching per instance, analytically between membership changes (see
  :mod:`warmserve.sim.cluster`); a grace instance's lent replicas are evicted if its KV use grows
  into them (§4.1).
- **Start-up and loading** (§6, Fig. 8) are carried out by :mod:`warmserve.sim.executor`.

Streaming (issue 12 §5): requests arrive chunk by chunk from a
:class:`~warmserve.sim.workload.RequestStream` (or from arrays, for tests), live as
:class:`~warmserve.sim.cluster.Req` objects only while queued or running, and leave their
latencies in online histograms (:mod:`warmserve.sim.metrics`).  ``record=True`` also keeps
per-request outcome arrays (tests).

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
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from warmserve.control.controller import ControlConfig, Controller, ModelEntry
from warmserve.control.history import LoadHistory
from warmserve.policy import autoscaler as autoscaler_mod
from warmserve.policy.cluster import ReplicaKind
from warmserve.policy.gpu_groups import is_laminar
from warmserve.sim.cluster import (
    GRACE,
    SERVING,
    STARTING,
    STOPPED,
    Req,
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
from warmserve.sim.stats import ModelStats
from warmserve.sim.systems import SystemConfig
from warmserve.sim.workload import Requests

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
    """One run of one system.  Deterministic: no randomness after the workload is drawn.

    Requests come from ``source`` (an iterable of :class:`~warmserve.sim.workload.Requests`
    chunks in time order) or, for tests, from the arrays ``arrival``, ``model_of``,
    ``input_tokens`` and ``output_tokens`` (one chunk).
    """

    def __init__(
        self,
        *,
        system: SystemConfig,
        models: list[SimModel],
        cluster: SimCluster,
        duration_s: float,
        window_s: float,
        autoscaler: autoscaler_mod.AutoscalerConfig,
        scale_interval_s: float,
        queue_timeout_s: float,
        drain_s: float,
        source: Iterable[Requests] | None = None,
        arrival: np.ndarray | None = None,
        model_of: np.ndarray | None = None,
        input_tokens: np.ndarray | None = None,
        output_tokens: np.ndarray | None = None,
        predictor: object | None = None,
        hooks: SystemHooks | None = None,
        initial_instances: dict[str, int] | None = None,
        progress: Callable[[float], None] | None = None,
        check: bool = False,
        record: bool = False,
        spare_replicas: int = 0,
    ) -> None:
        self.check = check
        self.sys = system
        self.hooks = hooks or (Controlled() if system.mode == "autoscale" else SystemHooks())
        self.models = models
        self.by_name = {m.spec.name: m for m in models}
        self.specs = {m.spec.name: m.spec for m in models}
        self.timers = [m.step_timer() for m in models]
        self.cl = cluster
        if source is None:
            if arrival is None or model_of is None or input_tokens is None or output_tokens is None:
                raise ValueError("a Simulation needs a request source or request arrays")
            source = [Requests(np.asarray(arrival, dtype=float), np.asarray(model_of),
                               np.asarray(input_tokens), np.asarray(output_tokens))]
        self.source: Iterator[Requests] = iter(source)
        self.record = record
        self.recorded: list[Req] = []
        self.issued = 0
        self.stats = [ModelStats() for _ in models]
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
        self.by_model: list[list[SimInstance]] = [[] for _ in models]
        self.queue: list[deque[Req]] = [deque() for _ in models]
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
                    reclaim=system.reclaim,
                    spare_replicas=spare_replicas,
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
                        # never shorter than the seeded history: a sliding window would
                        # shift the series every window and defeat the predictor's cache
                        max_windows=max(len(m.avg_history) * 2, 2 * 86400 // int(window_s)),
                    )
                    self.controller.seed_history(m.spec.name, hist, 0.0)
            self.executor = ControlExecutor(self, self.controller)

    # ------------------------------------------------------------------ event plumbing

    def push(self, t: float, kind: int, obj: object = None, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, ver))

    def run(self) -> SimOutput:
        c0 = time.process_time()  # measured only (bench/sim_speed.py), never decides anything
        self._setup()
        self.setup_cpu_s = time.process_time() - c0
        t_end = self.duration + self.drain_s
        t = 0.0
        last_progress = 0.0
        heap = self.heap
        arr: list[float] = []
        mod: list[int] = []
        inp: list[int] = []
        outs: list[int] = []
        k = 0
        exhausted = False
        while True:
            if k >= len(arr) and not exhausted:
                chunk = next(self.source, None)
                if chunk is None:
                    exhausted = True
                else:
                    arr = chunk.arrival.tolist()
                    mod = chunk.model.tolist()
                    inp = chunk.input_tokens.tolist()
                    outs = chunk.output_tokens.tolist()
                    k = 0
                    continue
            t_arr = arr[k] if k < len(arr) else math.inf
            t_ev = heap[0][0] if heap else math.inf
            if t_arr == math.inf and exhausted and self.done >= self.issued:
                break
            t = t_arr if t_arr <= t_ev else t_ev
            if t > t_end or t == math.inf:
                break
            self.t_now = t
            self.events += 1
            if t_arr <= t_ev:
                r = Req(self.issued, t_arr, mod[k], inp[k], outs[k])
                self.issued += 1
                k += 1
                self._arrive(r, t_arr)
            else:
                _, _, kind, obj, ver = heapq.heappop(heap)
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
        # Requests left: still queued or running when the drain ended, or never pulled from
        # the source because the loop stopped first.
        for q in self.queue:
            for r in q:
                self._drop(r, DROP_UNFINISHED)
            q.clear()
        for inst in self.instances:
            if inst.phase != STOPPED:
                for r in self._requests_of(inst):
                    self._drop(r, DROP_UNFINISHED)
        while k < len(arr):
            self._drop(Req(self.issued, arr[k], mod[k], inp[k], outs[k]), DROP_UNFINISHED,
                       issued=True)
            k += 1
        for chunk in self.source:
            for i in range(len(chunk)):
                self._drop(Req(self.issued, float(chunk.arrival[i]), int(chunk.model[i]),
                               int(chunk.input_tokens[i]), int(chunk.output_tokens[i])),
                           DROP_UNFINISHED, issued=True)
        self._account(end)
        out = SimOutput(
            system=self.sys.name,
            stats=self.stats,
            starts=self.starts,
            gpu_seconds=self.gpu_seconds,
            universal_gpu_seconds=self.universal_seconds,
            timeline=self.timeline,
            end_s=end,
            requests=self.issued,
            plans=self.controller.plans if self.controller else 0,
            unplaced=self.executor.unplaced if self.executor else 0,
            lent_evictions=self.lent_evictions,
            lent_placements=self.lent_placements,
            events=self.events,
            start_failures=self.start_failures,
            failure_kinds=dict(sorted(self.failure_kinds.items())),
        )
        if self.executor is not None:
            out.extra.update(self.executor.counts)
        out.extra["setup_cpu_s"] = self.setup_cpu_s
        if self.record:
            rs = sorted(self.recorded, key=lambda r: r.rid)
            nan = math.nan
            out.first_token = np.array([r.first if r.finish >= 0 else nan for r in rs])
            out.finish = np.array([r.finish if r.finish >= 0 else nan for r in rs])
            out.assigned = np.array([r.assigned if r.assigned >= 0 else nan for r in rs])
            out.drop = [r.drop for r in rs]
        return out

    def _requests_of(self, inst: SimInstance) -> list[Req]:
        return list(inst.pending) + list(inst.prefill_batch) + [x[2] for x in inst.running]

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
            timer=self.timers[m.idx],
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
        self.by_model[m.idx].append(inst)
        self._account(t)
        for g in inst.gpus:
            if (node, g) not in self.cl.holder:  # colocated static instances share GPUs
                self.held += 1
            self.cl.holder[(node, g)] = inst
        self.cl.generation += 1
        return inst

    # ------------------------------------------------------------------ accounting

    def account(self, t: float) -> None:
        """Integrate GPU-seconds held by instances and held only by replicas (universal)."""
        t = min(t, self.duration)  # GPU-hours of the simulated period only (not the drain)
        if t > self.t_held:
            dt = t - self.t_held
            self.gpu_seconds += self.held * dt
            if self.cl.replicas:
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

    def _drop(self, r: Req, reason: str, issued: bool = False) -> None:
        """``r`` leaves unserved (counted once; ``issued``: it never entered the loop)."""
        if issued:
            self.issued += 1
            self.stats[r.m].requests += 1
        r.drop = reason
        self.stats[r.m].drops[reason] += 1
        self.done += 1
        if self.record:
            self.recorded.append(r)

    def _arrive(self, r: Req, t: float) -> None:
        midx = r.m
        self.stats[midx].requests += 1
        m = self.models[midx]
        if not m.placeable:
            self._drop(r, DROP_NO_CAPACITY)
            return
        self._set_inflight(midx, t, +1)
        q = self.queue[midx]
        q.append(r)
        if len(q) == 1:
            self._dispatch(midx, t)
        if q:
            if self.executor is not None:
                self.executor.wake(t, m)
            else:
                self.hooks.on_waiting(self, m, t)

    def _dispatch(self, midx: int, t: float) -> None:
        """Hand queued requests of a model to serving instances with a free slot, FIFO."""
        q = self.queue[midx]
        mine = self.by_model[midx]
        while q:
            r = q[0]
            if t - r.t > self.queue_timeout:
                q.popleft()
                self._drop(r, DROP_QUEUE_TIMEOUT)
                self._set_inflight(midx, t, -1)
                continue
            need = r.inp + r.out
            best = None
            for inst in mine:
                if (
                    inst.phase == SERVING
                    and inst.n_assigned < inst.max_batch
                    and inst.kv_reserved + need <= inst.kv_usable_tokens
                    and (best is None or inst.n_assigned < best.n_assigned)
                ):
                    best = inst
            if best is None:
                return
            q.popleft()
            self._assign(best, r, t)

    def _assign(self, inst: SimInstance, r: Req, t: float) -> None:
        r.assigned = t
        r.delayed = inst.ready_at > r.t
        inst.last_request_s = t
        inst.settle(t)
        was_busy = inst.busy
        inst.pending.append(r)
        inst.n_assigned += 1
        inst.kv_reserved += r.inp + r.out
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
        tokens = squares = 0
        for r in batch:
            tokens += r.inp
            squares += r.inp * r.inp
        p = inst.timer.prefill(len(batch), tokens, squares)  # type: ignore[attr-defined]
        if inst.slowdown != 1.0 or inst.config_slowdown is not None:
            p *= self._slowdown_now(inst, True)
        layers = self.models[inst.midx].spec.num_layers
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
        step = inst.timer.decode(len(inst.running), kv)  # type: ignore[attr-defined]
        if inst.slowdown != 1.0 or inst.config_slowdown is not None:
            step *= self._slowdown_now(inst)
        inst.step_s = step
        target = inst.running[0][0]
        self.push(t + max(target - inst.v, 0.0) * step, EV_INST, inst, inst.version)

    def _engine_event(self, inst: SimInstance, t: float) -> None:
        inst.settle(t)
        was_busy = inst.busy
        if inst.prefill_end >= 0 and t >= inst.prefill_end - 1e-12:
            for r in inst.prefill_batch:
                r.first = t
                if r.out <= 1:
                    self._complete(inst, r, t)
                else:
                    heapq.heappush(inst.running, (inst.v + r.out - 1, r.rid, r))
                    inst.sum_in_running += r.inp
                    inst.sum_v0_running += inst.v
            inst.prefill_batch = []
            inst.prefill_end = -1.0
        running = inst.running
        while running and running[0][0] <= inst.v + 1e-6:
            target, _, r = heapq.heappop(running)
            inst.sum_in_running -= r.inp
            inst.sum_v0_running -= target - (r.out - 1)
            self._complete(inst, r, t)
        if not running:
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
            if self.queue[inst.midx]:
                self._dispatch(inst.midx, t)
        elif inst.phase == GRACE and inst.n_assigned == 0 and self.executor is not None:
            self.executor.step(t)  # its last request finished: the grace may end

    def _complete(self, inst: SimInstance, r: Req, t: float) -> None:
        r.finish = t
        self.done += 1
        inst.n_assigned -= 1
        inst.served += 1
        inst.kv_reserved -= r.inp + r.out
        self.stats[r.m].served_request(r.t, r.assigned, r.first, t, r.out, r.delayed)
        if self.record:
            self.recorded.append(r)
        self._set_inflight(inst.midx, t, -1)

    # ------------------------------------------------------------------ instances

    def instances_of(self, name: str) -> list[SimInstance]:
        return [i for i in self.by_model[self.by_name[name].idx] if i.phase != STOPPED]

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
        rs = self._requests_of(inst)
        inst.pending.clear()
        inst.prefill_batch = []
        inst.prefill_end = -1.0
        inst.running = []
        inst.sum_in_running = 0
        inst.sum_v0_running = 0.0
        for r in rs:
            self._drop(r, DROP_GRACE_CUTOFF)
            inst.n_assigned -= 1
            inst.kv_reserved -= r.inp + r.out
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
        self.cl.generation += 1
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
                kept=True,
            )
            self._make_room(rep, t)
            self.cl.add_replica(rep)
        self.instances = [i for i in self.instances if i.phase != STOPPED]
        self.by_model[inst.midx] = [i for i in self.by_model[inst.midx] if i.phase != STOPPED]
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
        if t < self.duration or self.done < self.issued:
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
            t < self.duration or self.done < self.issued
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
