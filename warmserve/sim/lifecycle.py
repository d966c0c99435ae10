"""Instance lifecycle in the simulator: create, serve, drain's end, stop (issue 3 §1, §4.1).

An instance is created by a start (:mod:`warmserve.sim.executor`) or a fixed layout, serves
from its ready time, is cut off when its grace period runs out with requests still running,
and on stop frees its GPUs — WarmServe keeps its weights as a slot (§4.1), SLLM-GPU's cache with
its own priority.  Also: lent replicas evicted by a grace instance's KV growth, and why a start
found no GPU group (``full``, ``spread``, ``fragmented``).

A mixin of :class:`warmserve.sim.core.Simulation`.
"""

from __future__ import annotations

from mypy_extensions import trait

from warmserve.policy.cluster import ReplicaKind
from warmserve.sim.cluster import SERVING, STARTING, STOPPED, SimInstance, SimReplica
from warmserve.sim.model import DROP_GRACE_CUTOFF, SimModel, StaticInstance
from warmserve.sim.state import SimState

EV_READY = 1  # an instance finished starting (the event loop's heap kind)


@trait
class Lifecycle(SimState):
    """Instances: create, ready, cut off, terminate (module docstring)."""

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
        self.account(t)
        for g in inst.gpus:
            if (node, g) not in self.cl.holder:  # colocated static instances share GPUs
                self.held += 1
            self.cl.holder[(node, g)] = inst
        self.cl.generation += 1
        return inst

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
        self.account(t)
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
                # a kept slot is a replica like any other: its prepared engine is charged too
                m.spec.bytes_per_gpu + m.spec.engine_overhead_bytes,
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
        self.sample(t)


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
