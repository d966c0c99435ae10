"""The discrete-event loop: requests, engines, GPU accounting.

One :class:`Simulation` runs one system on one workload.  Time is seconds from the start of the
simulated period.  Events live in one ``heapq`` (time, sequence number, kind, object, version);
arrivals are merged in from the request stream without going through the heap.  Stale
instance events are skipped by a version number.

What is simulated (the physics; what *decides* is elsewhere), one module per concept, mixed
into :class:`Simulation` (which owns the state, the clock and the loop):

- **Request queues** (:mod:`warmserve.sim.request_queues`): a request goes to the least-loaded
  *serving* instance of its model with a free batch slot and KV room; otherwise it waits in the
  model's FIFO queue (also while an instance starts).  Waiting requests are the gateway's *held*
  demand.
- **Engine** (:mod:`warmserve.sim.batching`): continuous batching per instance, analytically
  between membership changes (see :mod:`warmserve.sim.cluster`); a grace instance's lent
  replicas are evicted if its KV use grows into them (§4.1).
- **Instance lifecycle** (:mod:`warmserve.sim.lifecycle`): create, ready, cut off, stop.
- **Start-up and loading** (§6, Fig. 8) are carried out by :mod:`warmserve.sim.executor`.
- Here: the event loop, the control ticks and windows, GPU-hour accounting, invariants.

Streaming: requests arrive chunk by chunk from a
:class:`~warmserve.sim.workload.RequestStream` (or from arrays, for tests), live as
:class:`~warmserve.sim.cluster.Req` objects only while queued or running, and leave their
latencies in online histograms (:mod:`warmserve.sim.result_rows`).  ``record=True`` also keeps
per-request outcome arrays (tests).

Who decides (:mod:`warmserve.sim.hooks`): for controlled systems (WarmServe and the autoscaling
baselines) the loop is an executor of :class:`warmserve.control.Controller` decisions — the same
controller, rules and snapshot the operator runs (:mod:`warmserve.sim.executor`); fixed-layout
baselines create their instances at setup; Prism activates instances from its plug-in.  No
baseline code lives here.

Over 400 lines: the event loop is one class compiled by mypyc; its parts (request queues,
batching, lifecycle) are already traits of their own.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import numpy as np

from warmserve.control.controller import ControlConfig, Controller, ModelEntry
from warmserve.control.history import LoadHistory
from warmserve.policy import autoscaler as autoscaler_mod
from warmserve.policy.gpu_groups import is_laminar
from warmserve.policy.overshoot import DEFAULT_OVERSHOOT_HEADROOM, DEFAULT_OVERSHOOT_SPARES
from warmserve.sim.batching import EV_INST, Batching
from warmserve.sim.cluster import (
    STOPPED,
    Req,
    SimCluster,
    SimInstance,
)
from warmserve.sim.executor import ControlExecutor
from warmserve.sim.hooks import Controlled, SystemHooks
from warmserve.sim.lifecycle import EV_READY, Lifecycle
from warmserve.sim.model import (
    DROP_GRACE_CUTOFF,
    DROP_NO_CAPACITY,
    DROP_QUEUE_TIMEOUT,
    DROP_UNFINISHED,
    SimModel,
    SimOutput,
    StartRecord,
)
from warmserve.sim.request_queues import RequestQueues
from warmserve.sim.stats import ModelStats
from warmserve.sim.systems import SystemConfig
from warmserve.sim.workload import Requests

log = logging.getLogger("warmserve.sim")

EV_TICK, EV_WINDOW = 2, 3  # EV_INST: warmserve.sim.batching; EV_READY: .lifecycle

__all__ = [
    "DROP_GRACE_CUTOFF",
    "DROP_NO_CAPACITY",
    "DROP_QUEUE_TIMEOUT",
    "DROP_UNFINISHED",
    "SimOutput",
    "Simulation",
    "StartRecord",
]


class Simulation(RequestQueues, Batching, Lifecycle):
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
        overshoot_spares: int = DEFAULT_OVERSHOOT_SPARES,
        overshoot_headroom: float = DEFAULT_OVERSHOOT_HEADROOM,
    ) -> None:
        self.check = check
        self.sys = system
        self.hooks = hooks or (Controlled() if system.mode == "autoscale" else SystemHooks())
        self.models = models
        self.by_name = {m.spec.name: m for m in models}
        self.names = [m.spec.name for m in models]
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
                    overshoot_spares=overshoot_spares,
                    overshoot_headroom=overshoot_headroom,
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
        n_arr = 0
        exhausted = False
        inf = math.inf
        pop = heapq.heappop
        arrive, engine_event, ready = self._arrive, self._engine_event, self._ready
        progress = self.progress
        while True:
            if k >= n_arr and not exhausted:
                chunk = next(self.source, None)
                if chunk is None:
                    exhausted = True
                else:
                    arr = chunk.arrival.tolist()
                    mod = chunk.model.tolist()
                    inp = chunk.input_tokens.tolist()
                    outs = chunk.output_tokens.tolist()
                    n_arr = len(arr)
                    k = 0
                    continue
            t_ev = heap[0][0] if heap else inf
            if k < n_arr and arr[k] <= t_ev:  # an arrival (first at equal times)
                t = arr[k]
                if t > t_end:
                    break
                self.t_now = t
                self.events += 1
                r = Req(self.issued, t, mod[k], inp[k], outs[k])
                self.issued += 1
                k += 1
                arrive(r, t)
            else:
                if k >= n_arr and self.done >= self.issued:  # exhausted: nothing left to do
                    break
                t = t_ev
                if t > t_end or t == inf:
                    break
                self.t_now = t
                self.events += 1
                _t, _seq, kind, obj, ver = pop(heap)
                if kind == EV_INST:
                    inst = cast(SimInstance, obj)
                    if ver == inst.version and inst.phase != STOPPED:
                        engine_event(inst, t)
                elif kind == EV_READY:
                    ready(cast(SimInstance, obj), t)
                elif kind == EV_TICK:
                    self._tick(t)
                elif kind == EV_WINDOW:
                    self._window(t)
            if progress is not None and t - last_progress >= 60.0:
                last_progress = t
                progress(min(t, self.duration))
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
        self.account(end)
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
        self.sample(0.0)

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
        self.account(t)
        self.sample(t)
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
