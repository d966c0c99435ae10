"""Algorithm 1 with a :class:`MatchMemo` plans exactly what it plans from
scratch: random sequences of cluster changes (plans applied, forecasts, instances, replicas and
spares changed, earlier states repeated) planned with one shared memo give the plans computed
without one."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.policy.test_placement import clusters
from warmserve.policy.cluster import ClusterState, InstancePhase, LoadForecast
from warmserve.policy.evict_aware_placement import apply_plan, plan_prewarm
from warmserve.policy.replica_match import MatchMemo


def _change(s: ClusterState, rnd: random.Random) -> ClusterState:
    """One change of the kind an executor sees between two plans."""
    what = rnd.randrange(5)
    if what == 0 and s.forecasts:  # a window closed: one model's forecast changed
        name = rnd.choice(sorted(s.forecasts))
        avg = rnd.uniform(0, 100)
        fc = dict(s.forecasts)
        fc[name] = LoadForecast(avg, avg * rnd.uniform(0.5, 3.0))
        return replace(s, forecasts=fc)
    if what == 1 and s.instances:  # an instance drained (grace) or ended
        k = rnd.randrange(len(s.instances))
        insts = list(s.instances)
        if rnd.random() < 0.5:
            insts[k] = replace(insts[k], phase=InstancePhase.GRACE)
        else:
            del insts[k]
        return replace(s, instances=tuple(insts))
    if what == 2 and s.replicas:  # a replica was used by a start or evicted
        reps = list(s.replicas)
        del reps[rnd.randrange(len(reps))]
        return replace(s, replicas=tuple(reps))
    if what == 3 and s.replicas:  # a replica re-scored by hand (priority changed)
        reps = list(s.replicas)
        k = rnd.randrange(len(reps))
        reps[k] = replace(reps[k], score=reps[k].score + 1.0)
        return replace(s, replicas=tuple(reps))
    return s  # nothing changed: the next plan reuses everything


PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(clusters(), st.integers(0, 2**32 - 1), st.booleans())
def test_memo_plans_equal_full_plans(s: ClusterState, seed: int, evict_aware: bool) -> None:
    rnd = random.Random(seed)
    memo = MatchMemo()
    seen = [s]
    for _ in range(8):
        spare: int | dict[str, int] = rnd.choice(
            [0, 1, {m: rnd.randint(0, 2) for m in s.models}]
        )
        full = plan_prewarm(s, evict_aware=evict_aware, spare_replicas=spare)
        inc = plan_prewarm(s, evict_aware=evict_aware, spare_replicas=spare, memo=memo)
        assert inc == full
        # the same state again (the simulator's first-fit count plans each snapshot twice)
        again = plan_prewarm(s, evict_aware=not evict_aware, spare_replicas=spare, memo=memo)
        assert again == plan_prewarm(s, evict_aware=not evict_aware, spare_replicas=spare)
        r = rnd.random()
        if r < 0.4:
            s = apply_plan(s, full)  # the plan carried out
        elif r < 0.5:
            s = rnd.choice(seen)  # back to an earlier state
        else:
            s = _change(s, rnd)
        seen.append(s)
