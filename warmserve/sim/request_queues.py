"""The simulator's request queues (the gateway's part): dispatch, queueing, measured demand.

A request goes to the least-loaded *serving* instance of its model with a free batch slot and
KV room; otherwise it waits in the model's FIFO queue (also while an instance starts).  Waiting
requests are the gateway's *held* demand; a request that finds no room wakes the controller
(:meth:`warmserve.sim.executor.ControlExecutor.wake`) or the system's hook.  Every change of a
model's requests in flight is measured exactly (:mod:`warmserve.control.demand`).

A mixin of :class:`warmserve.sim.core.Simulation` (the event loop owns the state it reads and
writes: queues, instances per model, statistics, the controller).
"""

from __future__ import annotations

from mypy_extensions import trait

from warmserve.sim.cluster import SERVING, Req, SimInstance
from warmserve.sim.model import DROP_NO_CAPACITY, DROP_QUEUE_TIMEOUT
from warmserve.sim.state import SimState


@trait
class RequestQueues(SimState):
    """Requests in: arrive, queue, dispatch to an instance, drop (module docstring)."""

    def _set_inflight(self, midx: int, t: float, delta: int) -> None:
        self.inflight[midx] += delta
        if self.controller is not None:  # demand (warmserve.control.demand), measured exactly
            self.controller.measure(self.names[midx], t, self.inflight[midx])

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
        self.inflight[midx] += 1  # _set_inflight(midx, t, +1), inline (per request)
        if self.controller is not None:
            self.controller.measure(self.names[midx], t, self.inflight[midx])
        q = self.queue[midx]
        q.append(r)
        if len(q) == 1:
            self._dispatch(midx, t)
        if q:
            if self.executor is not None:
                self.executor.wake(t, m)
            else:
                self.hooks.on_waiting(self, m, t)  # type: ignore[arg-type]  # a Simulation

    def _dispatch(self, midx: int, t: float) -> None:
        """Hand queued requests of a model to serving instances with a free slot, FIFO."""
        q = self.queue[midx]
        mine = self.by_model[midx]
        timeout = self.queue_timeout
        while q:
            r = q[0]
            if t - r.t > timeout:
                q.popleft()
                self._drop(r, DROP_QUEUE_TIMEOUT)
                self._set_inflight(midx, t, -1)
                continue
            need = r.inp + r.out
            best = None
            least = 0
            for inst in mine:
                n = inst.n_assigned
                if (
                    inst.phase == SERVING
                    and n < inst.max_batch
                    and (best is None or n < least)
                    and inst.kv_reserved + need
                    <= (inst.kv_usable_tokens if inst.lent else inst.kv_cap_tokens)
                ):
                    best = inst
                    least = n
                    if not n:
                        break  # an idle instance: none later can be less loaded
            if best is None:
                return
            q.popleft()
            self._assign(best, r, t)

    def _assign(self, inst: SimInstance, r: Req, t: float) -> None:
        r.assigned = t
        r.delayed = inst.ready_at > r.t
        inst.last_request_s = t
        inst.settle(t)
        peers = inst.peers
        was_busy = inst.busy if peers else False
        inst.pending.append(r)
        inst.n_assigned += 1
        inst.kv_reserved += r.inp + r.out
        if inst.prefill_end < 0:
            self._start_prefill(inst, t)
            self._reschedule(inst, t)
        if peers and inst.busy != was_busy:
            self._retime_peers(inst, t)
