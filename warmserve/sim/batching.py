"""Continuous batching per instance: prefill and decode as events.

Analytic between membership changes (:mod:`warmserve.sim.cluster`'s virtual step counter):
one event per prefill end or decode finish, not per token.  Prefill-first without chunking
(vLLM V0); decode needs every layer resident (a streamed start, :mod:`warmserve.sim.executor`);
instances sharing GPUs (MuxServe, Prism) slow each other down while busy
(:mod:`warmserve.sim.sharing`); a grace instance's lent replicas are evicted when its KV use
grows into them (§4.1).  The step times come from :mod:`warmserve.sim.perf`.

A mixin of :class:`warmserve.sim.core.Simulation`.
"""

from __future__ import annotations

import heapq

from mypy_extensions import trait

from warmserve.sim.cluster import GRACE, SERVING, STOPPED, Req, SimInstance
from warmserve.sim.sharing import dynamic_slowdown
from warmserve.sim.state import SimState

EV_INST = 0  # an instance's next prefill end or decode finish (the event loop's heap kind)


@trait
class Batching(SimState):
    """The engines' physics: prefill, decode, completion (module docstring)."""

    def _requests_of(self, inst: SimInstance) -> list[Req]:
        return list(inst.pending) + list(inst.prefill_batch) + [x[2] for x in inst.running]

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
        p = inst.timer.prefill(len(batch), tokens, squares)
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
            self.seq += 1
            heapq.heappush(self.heap, (inst.prefill_end, self.seq, EV_INST, inst, inst.version))
            return
        running = inst.running
        if not running:
            inst.step_s = 0.0
            return
        if t < inst.full_at:  # decode needs every layer resident
            inst.step_s = 0.0
            self.push(inst.full_at, EV_INST, inst, inst.version)
            return
        v = inst.v
        n = len(running)
        kv = inst.sum_in_running + n * v - inst.sum_v0_running  # SimInstance.kv_tokens_now
        step = inst.timer.decode(n, round(kv if kv > 0.0 else 0.0))
        if inst.slowdown != 1.0 or inst.config_slowdown is not None:
            step *= self._slowdown_now(inst)
        inst.step_s = step
        ahead = running[0][0] - v
        self.seq += 1
        heapq.heappush(
            self.heap,
            (t + (ahead if ahead > 0.0 else 0.0) * step, self.seq, EV_INST, inst, inst.version),
        )

    def _engine_event(self, inst: SimInstance, t: float) -> None:
        # SimInstance.settle, inline (once per event)
        last = inst.t_last
        if t > last:
            if inst.step_s > 0:
                inst.v += (t - last) / inst.step_s
            inst.t_last = t
        peers = inst.peers
        was_busy = inst.busy if peers else False
        running = inst.running
        if inst.prefill_end >= 0 and t >= inst.prefill_end - 1e-12:
            v = inst.v
            for r in inst.prefill_batch:
                r.first = t
                if r.out <= 1:
                    self._complete(inst, r, t)
                else:
                    heapq.heappush(running, (v + r.out - 1, r.rid, r))
                    inst.sum_in_running += r.inp
                    inst.sum_v0_running += v
            inst.prefill_batch = []
            inst.prefill_end = -1.0
        if running:
            limit = inst.v + 1e-6
            while running and running[0][0] <= limit:
                target, _, r = heapq.heappop(running)
                inst.sum_in_running -= r.inp
                inst.sum_v0_running -= target - (r.out - 1)
                self._complete(inst, r, t)
            if not running:
                inst.sum_in_running = 0
                inst.sum_v0_running = 0.0
        else:
            inst.sum_in_running = 0
            inst.sum_v0_running = 0.0
        if inst.pending and inst.prefill_end < 0:
            self._start_prefill(inst, t)
        phase = inst.phase
        if phase == GRACE and inst.lent:
            self._check_lent(inst, t)
        self._reschedule(inst, t)
        if peers and inst.busy != was_busy:
            self._retime_peers(inst, t)
        if phase == SERVING:
            if self.queue[inst.midx]:
                self._dispatch(inst.midx, t)
        elif phase == GRACE and inst.n_assigned == 0 and self.executor is not None:
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
        midx = inst.midx  # RequestQueues._set_inflight(midx, t, -1), inline (per request)
        self.inflight[midx] -= 1
        if self.controller is not None:
            self.controller.measure(self.names[midx], t, self.inflight[midx])
