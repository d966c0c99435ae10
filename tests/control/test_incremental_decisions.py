"""The controller's incremental decisions are exactly its full ones: a controller
that keeps its memos (snapshot, Algorithm 1's match, autoscaler and fair-share answers, the
demand of the observation it observed) decides, over random sequences of cluster changes, what
a controller that rebuilds everything before every decision decides."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmserve.control.controller import ControlConfig, Controller, ModelEntry
from warmserve.control.observation import GpuObs, InstanceObs, Observation, SlotObs
from warmserve.control.snapshot import SnapshotMemo
from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import GiB, InstancePhase, ModelSpec
from warmserve.policy.replica_match import MatchMemo

NODES = ("n0", "n1", "n2")
GPUS = tuple(GpuObs(n, g, 80 * GiB) for n in NODES for g in range(4))
SPECS = {
    "a": ModelSpec("a", 14 * GiB, tp=1, max_batch=4),
    "b": ModelSpec("b", 26 * GiB, tp=2, max_batch=8),
    "c": ModelSpec("c", 6 * GiB, tp=1, max_batch=2),
}
GROUPS = {1: ((0,), (1,), (2,), (3,)), 2: ((0, 1), (2, 3))}


def _full(ctl: Controller) -> None:
    """Forget everything a controller memoises: its next decision is computed from scratch."""
    ctl.snapshot_memo = SnapshotMemo()
    ctl.match_memo = MatchMemo()
    ctl._scale_memo = {}
    ctl._fair_memo = {}
    ctl.observed = (None, {})


def _step(rnd: random.Random, insts: dict[str, InstanceObs], slots: dict[str, SlotObs],
          t: float, k: int) -> None:
    """A few changes, as between two decisions: loads move, instances drain, end or start,
    replicas load, are used or evicted; everything else keeps its (identical) object."""
    for _ in range(rnd.randint(0, 3)):
        what = rnd.randrange(6)
        if what == 0 and insts:  # load moved
            i = insts[rnd.choice(sorted(insts))]
            n = rnd.randint(0, 6)
            insts[i.id] = replace(i, in_flight=n, running=n,
                                  kv_used_bytes=min(n * GiB, i.kv_capacity_bytes))
        elif what == 1 and insts:  # drained
            i = insts[rnd.choice(sorted(insts))]
            insts[i.id] = replace(i, phase=InstancePhase.GRACE, grace_started_s=t)
        elif what == 2 and insts:  # ended
            del insts[rnd.choice(sorted(insts))]
        elif what == 3 and slots:  # a replica used or evicted
            del slots[rnd.choice(sorted(slots))]
        else:  # something new on free GPUs
            model = rnd.choice(sorted(SPECS))
            node = rnd.choice(NODES)
            gpus = rnd.choice(GROUPS[SPECS[model].tp])
            taken = {g for i in insts.values() if i.node == node for g in i.gpus}
            taken |= {g for s in slots.values() if s.node == node for g in s.gpus}
            if taken & set(gpus):
                continue
            if what == 4:
                n = rnd.randint(0, 6)
                insts[f"i{k}-{_}"] = InstanceObs(
                    f"i{k}-{_}", model, node, gpus,
                    rnd.choice([InstancePhase.STARTING, InstancePhase.SERVING]),
                    in_flight=n, running=n, kv_capacity_bytes=20 * GiB,
                    kv_used_bytes=min(n * GiB, 20 * GiB))
            else:
                spec = SPECS[model]
                slots[f"s{k}-{_}"] = SlotObs(f"s{k}-{_}", model, node, gpus,
                                             spec.prewarm_bytes_per_gpu)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_incremental_decisions_equal_full_decisions(seed: int, proactive: bool) -> None:
    rnd = random.Random(seed)
    cfg = ControlConfig(window_s=60.0, proactive=proactive, spare_replicas=rnd.randint(0, 1),
                        autoscaler=AutoscalerConfig(scale_down_delay_s=20.0, max_grace_s=40.0))
    inc, full = Controller(cfg), Controller(cfg)
    entries = {m: ModelEntry(s, max_instances=rnd.choice([None, 2])) for m, s in SPECS.items()}
    for ctl in (inc, full):
        ctl.set_models(entries, 0.0)
    insts: dict[str, InstanceObs] = {}
    slots: dict[str, SlotObs] = {}
    t = 0.0
    for k in range(40):
        t += rnd.choice([0.0, 1.0, 5.0, 17.0])  # 0: decide again in the same instant
        _step(rnd, insts, slots, t, k)
        held = {m: rnd.randint(0, 3) for m in SPECS if rnd.random() < 0.2}
        obs = Observation(t, GPUS, tuple(slots.values()), tuple(insts.values()), held)
        only = None if rnd.random() < 0.7 else (rnd.choice(sorted(SPECS)),)
        inc.observe(obs)
        full.observe(obs)
        _full(full)
        a = inc.decide(obs, only=only)
        b = full.decide(obs, only=only)
        assert a == b
        assert inc.meta == full.meta and inc.replan_reasons == full.replan_reasons
