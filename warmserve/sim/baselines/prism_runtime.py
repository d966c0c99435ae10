"""Prism inside the simulator's event loop: a plug-in behind :mod:`warmserve.sim.hooks`.

Prism's decisions themselves (KV-pressure placement, idle eviction, activation GPUs) are pure
functions in :mod:`warmserve.sim.baselines.prism`; this module runs them on the simulation: the
initial layout at setup, and an activation whenever a request of a model waits (§6.2, §5.2).
"""

from __future__ import annotations

import logging
from collections import Counter

from warmserve.sim.baselines.prism import (
    PrismFacts,
    PrismGpu,
    PrismModel,
    ResidentModel,
    plan_activation,
)
from warmserve.sim.cluster import SERVING, STARTING
from warmserve.sim.hooks import SimAccess, StaticLayout
from warmserve.sim.model import SimModel, StartRecord, StaticInstance

log = logging.getLogger("warmserve.sim")


class PrismHooks(StaticLayout):
    """Prism's static layout at t = 0, then activations and idle evictions as requests wait."""

    activates = True

    def __init__(self, facts: PrismFacts, instances: list[StaticInstance]) -> None:
        super().__init__(instances)
        self.facts = facts

    def _state(self, sim: SimAccess, t: float) -> tuple[list[PrismGpu], list[ResidentModel]]:
        """Prism's view now: per GPU (global index) its models, SLO-weighted rate and memory
        left for KV; and the resident instances idle beyond their model's threshold (the only
        ones eviction may take)."""
        gpn = sim.cl.gpus_per_node
        live = sim.live()
        count = Counter(i.model for i in live)
        models: list[list[str]] = [[] for _ in range(sim.cl.total_gpus)]
        w = [0.0] * sim.cl.total_gpus
        kv = [self.facts.usable_bytes] * sim.cl.total_gpus
        residents: list[ResidentModel] = []
        for inst in live:
            spec = sim.specs[inst.model]
            rate = self.facts.rates.get(inst.model, 0.0) / count[inst.model]
            base = sim.cl.node_names.index(inst.node) * gpn
            for g in inst.gpus:
                models[base + g].append(inst.model)
                w[base + g] += rate / self.facts.slo_s / spec.tp
                kv[base + g] -= spec.bytes_per_gpu
            idle_for = self.facts.idle_timeout_s.get(inst.model, 0.0)
            if inst.phase == SERVING and t - inst.last_request_s > idle_for:
                residents.append(
                    ResidentModel(
                        inst.name, tuple(base + g for g in inst.gpus), spec.bytes_per_gpu,
                        self.facts.slo_s, inst.last_request_s, inst.n_assigned,
                    )
                )
        gpus = [
            PrismGpu(i, i // gpn, tuple(models[i]), w[i], kv[i])
            for i in range(sim.cl.total_gpus)
        ]
        return gpus, residents

    def on_waiting(self, sim: SimAccess, m: SimModel, t: float) -> None:
        """A request waits and no instance can take it: activate one more instance of ``m``
        on a pooled engine, on the lowest-KVPR GPUs with room, evicting idle models if memory
        is short (Prism §6.2, §5.2).  One activation per model at a time."""
        name = m.spec.name
        mine = sim.instances_of(name)
        if any(i.phase == STARTING for i in mine):
            return
        gpn = sim.cl.gpus_per_node
        gpus, residents = self._state(sim, t)
        # Reactivating an evicted model follows Prism's rule (lowest KVPR, sharing allowed);
        # an extra instance of a model that is running (our scale-out) only goes where no other
        # instance is working: a replica time-sharing a busy GPU would add no capacity.
        idle = {r.name for r in residents}
        own = [
            sim.cl.node_names.index(i.node) * gpn + g
            for i in sim.live()
            if i.model == name or (mine and i.name not in idle)
            for g in i.gpus
        ]
        pm = PrismModel(
            name, m.spec.weight_bytes, self.facts.rates.get(name, 0.0) / (len(mine) + 1),
            self.facts.slo_s, tp=m.spec.tp,
        )
        plan = plan_activation(
            gpus, residents, pm, t, 0.0, gpus_per_node=gpn,
            min_kv_bytes=self.facts.min_kv_bytes, exclude=own,
        )
        if plan is None:
            sim.start_failures += 1
            sim.failure_kinds["no-memory"] += 1
            return
        group, evict = plan
        for victim in evict:
            inst = next(i for i in sim.live() if i.name == victim)
            sim.terminate(inst, t)
        node = sim.cl.node_names[group[0] // gpn]
        local = tuple(g % gpn for g in group)
        act = self.facts.activation_s[name]
        sim.account(t)
        inst = sim.new_instance(m, node, local, t, t + act, t + act, hit=False)
        inst.max_batch = self.facts.batch_of(name)
        inst.config_slowdown = 1.0
        inst.last_request_s = t
        for other in sim.live():
            if other is not inst and other.node == node and set(other.gpus) & set(local):
                other.peers.append(inst)
                inst.peers.append(other)
        self._share_kv(sim, node, local)
        sim.starts.append(StartRecord(t, name, False, act))
        log.debug("event=prism_activate model=%s node=%s gpus=%s evict=%s", name, node, local,
                  evict)
        sim.schedule_ready(inst, t + act)
        sim.sample(t)

    def _share_kv(self, sim: SimAccess, node: str, gpus: tuple[int, ...]) -> None:
        """Split the KV memory of shared GPUs among their instances by SLO-weighted rate, as
        the initial layout does (kvcached shares the pool on demand; this is its
        demand-weighted expectation).  A share below what an instance already holds only
        stops its admissions until requests finish."""
        live = sim.live()
        count = Counter(i.model for i in live)
        on = [i for i in live if i.node == node and set(i.gpus) & set(gpus)]
        for inst in on:
            spec = sim.specs[inst.model]
            per_token = sim.by_name[inst.model].kv_bytes_per_token / spec.tp
            tokens = None
            for g in inst.gpus:
                here = [o for o in live if o.node == node and g in o.gpus]
                weights = sum(sim.specs[o.model].bytes_per_gpu for o in here)
                free = self.facts.usable_bytes - weights
                ws = {o.iid: self.facts.rates.get(o.model, 0.0) / count[o.model] for o in here}
                total = sum(ws.values())
                share = ws[inst.iid] / total if total > 0 else 1.0 / len(here)
                cap = int(max(free, 0.0) * share // per_token)
                tokens = cap if tokens is None else min(tokens, cap)
            inst.kv_cap_tokens = tokens or 0

