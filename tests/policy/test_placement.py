"""Tests of Eq. 5-8 (scoring) and of evict-aware placement / start choice (Algorithm 1, §5.2)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import (
    GPU,
    ClusterState,
    GiB,
    Instance,
    InstancePhase,
    LoadForecast,
    ModelSpec,
    Node,
    PolicyInputError,
    Replica,
    ReplicaKind,
    WorkerState,
)
from warmserve.policy.evict_aware_placement import apply_plan, plan_prewarm
from warmserve.policy.gpu_groups import aligned_groups, is_laminar
from warmserve.policy.scoring import (
    basic_score,
    burst_score,
    model_replicas,
    priority_key,
    replica_counts,
)
from warmserve.policy.start_choice import NoCapacity, StartChoice, choose_start

BASIC, BURST = ReplicaKind.BASIC, ReplicaKind.BURST

# --------------------------------------------------------------------------- Eq. 5-8


def test_eq5_eq6_counts_hand_computed() -> None:
    # K=1, B=32, L_A=40, L_P=100: N_basic = ceil(1.25)-1 = 1; N_burst = ceil(3.125)-1-1 = 2.
    assert replica_counts(LoadForecast(40, 100), 32, 1) == (1, 2)
    # Enough instances for the average: no basic; the peak still asks ceil(100/32)-3 = 1 burst.
    assert replica_counts(LoadForecast(40, 100), 32, 3) == (0, 1)
    # More instances than the peak needs: nothing.
    assert replica_counts(LoadForecast(40, 100), 32, 5) == (0, 0)
    # Exact multiples do not round up (64/32 = 2 instances).
    assert replica_counts(LoadForecast(64.00000000001, 64), 32, 0) == (2, 0)


def test_eq7_eq8_scores_hand_computed() -> None:
    fc = LoadForecast(40, 100)
    reqs = model_replicas(ModelSpec("m", 10**9, 1, 32, 7.4), fc, 1)
    assert [(r.kind, r.rank) for r in reqs] == [(BASIC, 0), (BURST, 0), (BURST, 1)]
    assert reqs[0].score == pytest.approx(7.4)  # exp(0) * T_c
    assert reqs[1].score == pytest.approx(math.exp(-1 / 3) * 7.4 * 1.5)  # 7.95350
    assert reqs[1].score == pytest.approx(7.953498, abs=1e-5)
    assert reqs[2].score == pytest.approx(math.exp(-2 / 3) * 7.4 * 1.5)  # 5.69893
    assert basic_score(2, 3, 1, 2.0) == pytest.approx(math.exp(-2 / 4) * 2.0)


def test_eq8_la_zero_is_capped_and_la_above_lp_scores_zero() -> None:
    # L_A = 0: the burstiness factor is capped at MAX_BURSTINESS (10): exp(0) * 2 * 10.
    assert burst_score(0, 0, 1, 2.0, LoadForecast(0, 10)) == pytest.approx(20.0)
    # L_P < L_A: factor clipped at 0.
    assert burst_score(0, 1, 1, 2.0, LoadForecast(50, 40)) == 0.0


def test_basic_always_ranks_above_burst() -> None:
    reqs = model_replicas(ModelSpec("b", 10**9, 1, 32, 1.0), LoadForecast(0, 320), 0)
    basic = model_replicas(ModelSpec("a", 10**9, 1, 32, 0.01), LoadForecast(10, 10), 0)
    assert reqs[0].score > basic[0].score  # raw burst score larger...
    assert sorted([reqs[0], basic[0]], key=priority_key)[0] == basic[0]  # ...basic still first


# --------------------------------------------------------------------------- helpers


def node(name: str, n: int, mem: int = 80 * GiB, **states: WorkerState) -> Node:
    gpus = []
    for i in range(n):
        s = states.get(f"g{i}", WorkerState.IDLE)
        free = 0 if s == WorkerState.DEDICATED else mem
        gpus.append(GPU(i, mem, free, s))
    return Node(name, tuple(gpus))


def spec(name: str, tp: int = 1, gb: float = 10, tc: float = 1.0) -> ModelSpec:
    return ModelSpec(name, int(gb * 1e9), tp, 32, tc)


# Forecasts that produce exactly one replica of a known kind and score (T_c chosen):
ONE_BASIC = LoadForecast(10, 10)  # N_basic = 1, score = T_c
ONE_BURST = LoadForecast(0, 10)  # N_burst = 1, score = 10 * T_c (L_A = 0 cap)


def state(nodes, specs, forecasts, replicas=(), instances=()) -> ClusterState:
    return ClusterState(
        tuple(nodes), {s.name: s for s in specs}, tuple(replicas), tuple(instances), forecasts
    )


# --------------------------------------------------------------------------- selection rule


def _two_gpu_with_x_and_y(x_tc: float, y_tc: float, new: ModelSpec, fc: LoadForecast):
    x, y = spec("x", tc=x_tc), spec("y", tc=y_tc)
    reps = [
        Replica("x", BURST, 0, 0, "n", (0,), x.prewarm_bytes_per_gpu),
        Replica("y", BASIC, 0, 0, "n", (1,), y.prewarm_bytes_per_gpu),
    ]
    return state(
        [node("n", 2)], [x, y, new], {"x": ONE_BURST, "y": ONE_BASIC, new.name: fc}, reps
    )


def test_prefers_groups_whose_nested_replicas_are_all_lower_then_least_sum() -> None:
    # GPU0: x burst (score 1.0); GPU1: y basic (0.5).  New basic z score 2: both lower -> least
    # sum -> GPU1.
    s = _two_gpu_with_x_and_y(0.1, 0.5, spec("z", tc=2.0), ONE_BASIC)
    plan = plan_prewarm(s)
    assert [(r.model, r.kind, r.score) for r in plan.keep] == [
        ("x", BURST, pytest.approx(1.0)),
        ("y", BASIC, pytest.approx(0.5)),
    ]
    (z,) = plan.place
    assert (z.model, z.gpus) == ("z", (1,))


def test_priority_compares_kind_before_raw_score() -> None:
    # GPU0: x burst score 3; GPU1: y basic score 0.5.  New burst w with raw score 100: only GPU0's
    # nested replicas are lower (a basic outranks any burst) -> GPU0 despite its larger sum.
    s = _two_gpu_with_x_and_y(0.3, 0.5, spec("w", tc=10.0), ONE_BURST)
    (w,) = plan_prewarm(s).place
    assert w.gpus == (0,)


def test_falls_back_to_least_sum_when_no_group_is_lower() -> None:
    # New burst with score 0.01: neither group is lower -> least sum (GPU1, 0.5 < 3.0).
    s = _two_gpu_with_x_and_y(0.3, 0.5, spec("v", tc=0.001), ONE_BURST)
    (v,) = plan_prewarm(s).place
    assert v.gpus == (1,)


def test_empty_group_wins_and_ties_break_by_node_name_then_gpu() -> None:
    s = state([node("b", 2), node("a", 2)], [spec("m")], {"m": LoadForecast(64, 64)})
    plan = plan_prewarm(s)
    assert [(r.node, r.gpus) for r in plan.place] == [("a", (0,)), ("a", (1,))]


def test_grace_instance_group_admits_only_nested_groups() -> None:
    # A grace instance on unaligned GPUs {1,2}: aligned blocks {0,1},{2,3} partially overlap it,
    # so the only valid TP2 group is the instance's own set.
    n = node("n", 4, g1=WorkerState.GRACE, g2=WorkerState.GRACE)
    inst = Instance("other", "n", (1, 2), 1, 40 * GiB, 0, InstancePhase.GRACE, "o")
    s = state([n], [spec("m", tp=2), spec("other", tp=2)], {"m": ONE_BASIC}, instances=[inst])
    (r,) = plan_prewarm(s).place
    assert r.gpus == (1, 2)


def test_serving_gpus_are_never_candidates() -> None:
    n = node("n", 2, g0=WorkerState.DEDICATED)
    inst = Instance("other", "n", (0,), 1)
    s = state([n], [spec("m"), spec("other")], {"m": LoadForecast(64, 64)}, instances=[inst])
    plan = plan_prewarm(s)
    assert [r.gpus for r in plan.place] == [(1,)]
    assert len(plan.unplaced) == 1
    assert "already holds a replica or instance of this model" in plan.unplaced[0].reason


def test_non_power_of_two_degree() -> None:
    assert aligned_groups(8, 3) == [(0, 1, 2), (4, 5, 6)]
    assert aligned_groups(6, 3) == [(0, 1, 2)]
    assert aligned_groups(8, 6) == [(0, 1, 2, 3, 4, 5)]
    s = state([node("n", 8)], [spec("m", tp=3)], {"m": LoadForecast(64, 64)})
    assert [r.gpus for r in plan_prewarm(s).place] == [(0, 1, 2), (4, 5, 6)]
    s = state([node("n", 2)], [spec("m", tp=3)], {"m": ONE_BASIC})
    (u,) = plan_prewarm(s).unplaced
    assert "no node has 3 GPUs" in u.reason


def test_unplaced_reason_names_memory() -> None:
    s = state([node("n", 2, mem=8 * GiB)], [spec("m", gb=20)], {"m": ONE_BASIC})
    (u,) = plan_prewarm(s).unplaced
    assert "bytes free on each GPU" in u.reason and u.kind == BASIC


def test_existing_replicas_kept_rescored_and_surplus_evicted() -> None:
    m = spec("m", tc=2.0)
    reps = [
        Replica("m", BURST, 3, 9.0, "n", (1,), m.prewarm_bytes_per_gpu),
        Replica("m", BASIC, 0, 9.0, "n", (0,), m.prewarm_bytes_per_gpu),
        Replica("m", BURST, 4, 9.0, "n", (2,), m.prewarm_bytes_per_gpu),
    ]
    n = Node("n", tuple(GPU(i, 80 * GiB, 80 * GiB - m.prewarm_bytes_per_gpu) for i in range(3)))
    s = state([n], [m], {"m": LoadForecast(40, 40)}, reps)  # asks for 2 basic
    plan = plan_prewarm(s)
    assert [(r.kind, r.rank, r.gpus, r.score) for r in plan.keep] == [
        (BASIC, 0, (0,), pytest.approx(2.0)),
        (BASIC, 1, (1,), pytest.approx(2.0 * math.exp(-1 / 2))),
    ]
    assert plan.place == () and plan.evict == (reps[2],)
    after = apply_plan(s, plan)
    assert after.node("n").gpu(2).free_bytes == 80 * GiB
    assert plan_prewarm(after).keep == plan.keep


def test_evict_unaware_ablation_first_fit_may_overlap() -> None:
    a, b, c = spec("a", tp=2, tc=5.0), spec("b", tp=2, tc=1.0), spec("c")
    reps = [Replica("a", BASIC, 0, 5.0, "n", (2, 3), a.prewarm_bytes_per_gpu)]
    free = [0, 80 * GiB, 80 * GiB - a.prewarm_bytes_per_gpu, 80 * GiB - a.prewarm_bytes_per_gpu]
    states = [WorkerState.DEDICATED] + [WorkerState.UNIVERSAL] * 3
    n = Node("n", tuple(GPU(i, 80 * GiB, free[i], states[i]) for i in range(4)))
    inst = Instance("c", "n", (0,), 1)  # serving on GPU0
    s = state([n], [a, b, c], {"a": ONE_BASIC, "b": ONE_BASIC}, reps, [inst])
    aware = plan_prewarm(s)
    # {0,1} holds a serving GPU, so b nests onto a's group {2,3}
    assert [(r.model, r.gpus) for r in aware.place] == [("b", (2, 3))]
    ff = plan_prewarm(s, evict_aware=False)
    assert [(r.model, r.gpus) for r in ff.place] == [("b", (1, 2))]  # first fit: overlaps a
    assert is_laminar([r.gpus for r in aware.replicas])
    assert not is_laminar([r.gpus for r in ff.replicas])


def test_apply_plan_updates_memory_and_states() -> None:
    m = spec("m", gb=10)
    s = state([node("n", 2)], [m], {"m": ONE_BASIC})
    plan = plan_prewarm(s)
    after = apply_plan(s, plan)
    g0, g1 = after.node("n").gpus
    assert (g0.state, g0.free_bytes) == (WorkerState.UNIVERSAL, 80 * GiB - 10**10)
    assert (g1.state, g1.free_bytes) == (WorkerState.IDLE, 80 * GiB)
    assert after.replicas == plan.place
    gone = apply_plan(after, plan_prewarm(replace_forecasts(after, {})))
    assert gone.node("n").gpu(0).state == WorkerState.IDLE and gone.replicas == ()
    assert gone.node("n").gpu(0).free_bytes == 80 * GiB


def replace_forecasts(s: ClusterState, fc: dict[str, LoadForecast]) -> ClusterState:
    return ClusterState(s.nodes, s.models, s.replicas, s.instances, fc)


# --------------------------------------------------------------------------- properties


@st.composite
def clusters(draw) -> ClusterState:
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    n_nodes = rnd.randint(1, 4)
    models = {}
    for i in range(rnd.randint(1, 6)):
        tp = rnd.choice([1, 1, 2, 2, 3, 4, 8])
        models[f"m{i}"] = ModelSpec(
            f"m{i}", rnd.randint(1, 60) * GiB * tp // 2, tp, rnd.choice([8, 32]),
            rnd.uniform(0.0, 10.0), 32, rnd.choice([None, 8, 32]),
        )
    names = sorted(models)
    nodes, instances, replicas = [], [], []
    for k in range(n_nodes):
        n = rnd.choice([1, 2, 4, 6, 8])
        free_pos = list(range(n))
        states = {}
        for _ in range(rnd.randint(0, 2)):  # instances on arbitrary (unaligned) free GPUs
            m = models[rnd.choice(names)]
            if len(free_pos) < m.tp:
                continue
            gpus = sorted(rnd.sample(free_pos, m.tp))
            phase = rnd.choice([InstancePhase.SERVING, InstancePhase.GRACE])
            for g in gpus:
                free_pos.remove(g)
                states[g] = WorkerState.GRACE if phase == InstancePhase.GRACE else (
                    WorkerState.DEDICATED
                )
            instances.append(
                Instance(m.name, f"n{k}", gpus, rnd.randint(0, 8), 40 * GiB, 0, phase)
            )
        gpus = []
        for g in range(n):
            mem = rnd.choice([24, 40, 80]) * GiB
            s = states.get(g, rnd.choice([WorkerState.IDLE, WorkerState.UNIVERSAL]))
            free = 0 if s == WorkerState.DEDICATED else rnd.randint(0, mem // GiB) * GiB
            gpus.append(GPU(g, mem, free, s))
        nodes.append(Node(f"n{k}", tuple(gpus)))
        for _ in range(rnd.randint(0, 2)):  # resident replicas on aligned blocks
            m = models[rnd.choice(names)]
            blocks = aligned_groups(n, m.tp)
            if blocks:
                replicas.append(
                    Replica(m.name, BASIC, 0, 0.0, f"n{k}", rnd.choice(blocks),
                            m.prewarm_bytes_per_gpu)
                )
    forecasts = {}
    for name in names:
        if rnd.random() < 0.9:
            avg = rnd.uniform(0, 100)
            forecasts[name] = LoadForecast(avg, avg * rnd.uniform(0.5, 3.0))
    rnd.shuffle(nodes)
    return ClusterState(tuple(nodes), models, tuple(replicas), tuple(instances), forecasts)


def _overlap_ok(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    i = set(a) & set(b)
    return not i or i in (set(a), set(b))


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(clusters(), st.booleans())
def test_placement_invariants(s: ClusterState, evict_aware: bool) -> None:
    plan = plan_prewarm(s, evict_aware=evict_aware)
    # memory: new replicas fit into free bytes plus what the plan evicts
    budget = {(n.name, g.index): g.free_bytes for n in s.nodes for g in n.gpus}
    for r in plan.evict:
        for g in r.gpus:
            key = (r.node, g)
            budget[key] = min(budget[key] + r.bytes_per_gpu, s.node(r.node).gpu(g).memory_bytes)
    for r in plan.place:
        spec_ = s.models[r.model]
        assert len(r.gpus) == spec_.tp  # one node, D GPUs: never split
        node_ = s.node(r.node)
        for g in r.gpus:
            gpu = node_.gpu(g)
            assert gpu.state != WorkerState.DEDICATED
            budget[(r.node, g)] -= r.bytes_per_gpu
    assert all(v >= 0 for v in budget.values())
    # the planned set has the requested count per model, keep + place + unplaced
    for name in s.forecasts:
        want = len(model_replicas(s.models[name], s.forecasts[name], s.active_instances(name)))
        got = sum(1 for r in (*plan.replicas, *plan.unplaced) if r.model == name)
        assert got == want
    if not evict_aware:
        return
    others = [(r.node, r.gpus) for r in plan.replicas] + [(i.node, i.gpus) for i in s.instances]
    for r in plan.place:
        for nd, gpus in others:
            if nd == r.node and gpus != r.gpus:
                assert _overlap_ok(r.gpus, gpus), (r, gpus)


@PROPS
@given(clusters())
def test_basic_is_never_displaced_by_burst(s: ClusterState) -> None:
    """No placed burst replica r sits where an unplaced basic replica b could have gone.

    Precisely: for an unplaced basic b and a placed burst r of the same degree with
    need(b) <= need(r), r's group must intersect a replica or instance of b's model (the only
    reason b could not take r's group, since basics are placed first and placements only
    shrink free memory and valid groups).
    """
    plan = plan_prewarm(s)
    occupied = [(r.model, r.node, set(r.gpus)) for r in plan.replicas] + [
        (i.model, i.node, set(i.gpus)) for i in s.instances
    ]
    for b in (u for u in plan.unplaced if u.kind == BASIC):
        bs = s.models[b.model]
        for r in (p for p in plan.place if p.kind == BURST):
            rs = s.models[r.model]
            if rs.tp != bs.tp or bs.prewarm_bytes_per_gpu > rs.prewarm_bytes_per_gpu:
                continue
            blocked = any(
                m == b.model and nd == r.node and g & set(r.gpus)
                for m, nd, g in occupied
                if not (m == r.model and nd == r.node and g == set(r.gpus))
            )
            assert blocked, (b, r)


@PROPS
@given(clusters(), st.booleans())
def test_plan_is_deterministic_and_independent_of_node_order(
    s: ClusterState, evict_aware: bool
) -> None:
    a = plan_prewarm(s, evict_aware=evict_aware)
    assert plan_prewarm(s, evict_aware=evict_aware) == a
    rev = ClusterState(tuple(reversed(s.nodes)), s.models, s.replicas, s.instances, s.forecasts)
    assert plan_prewarm(rev, evict_aware=evict_aware) == a


# --------------------------------------------------------------------------- start choice


def test_start_prefers_a_prewarm_hit() -> None:
    m = spec("m")
    s = state(
        [node("a", 2)], [m], {}, [Replica("m", BASIC, 0, 1.0, "a", (1,), m.prewarm_bytes_per_gpu)]
    )
    c = choose_start(s, "m")
    assert isinstance(c, StartChoice) and c.hit and c.gpus == (1,) and c.evicts == ()


def test_start_hit_evicting_least_score() -> None:
    m, o = spec("m"), spec("o")
    reps = [
        Replica("m", BASIC, 0, 1.0, "a", (0,)),
        Replica("o", BASIC, 0, 5.0, "a", (0,)),
        Replica("m", BURST, 0, 0.5, "b", (0,)),
        Replica("o", BURST, 0, 2.0, "b", (0, 1)),
    ]
    c = choose_start(state([node("a", 2), node("b", 2)], [m, o], {}, reps), "m")
    assert isinstance(c, StartChoice) and c.hit
    assert (c.node, c.gpus, c.evicted_score) == ("b", (0,), 2.0)
    assert c.replica == reps[2] and c.evicts == (reps[3],)


def test_cold_start_on_group_evicting_least() -> None:
    reps = [Replica("o", BASIC, 0, 5.0, "a", (0,)), Replica("o", BURST, 0, 1.0, "a", (1,))]
    c = choose_start(state([node("a", 2)], [spec("m"), spec("o")], {}, reps), "m")
    assert isinstance(c, StartChoice) and not c.hit and c.replica is None
    assert (c.gpus, c.evicted_score) == ((1,), 1.0)


def test_replica_on_grace_gpus_is_not_a_hit() -> None:
    n = node("a", 2, g0=WorkerState.GRACE)
    inst = Instance("o", "a", (0,), 2, phase=InstancePhase.GRACE)
    reps = [Replica("m", BASIC, 0, 1.0, "a", (0,))]
    c = choose_start(state([n], [spec("m"), spec("o")], {}, reps, [inst]), "m")
    assert isinstance(c, StartChoice) and not c.hit and c.gpus == (1,)


def test_cold_start_on_unaligned_free_gpus() -> None:
    # Serving TP-1 instances on GPUs 0, 3, 4, 7 leave no aligned block of 4 free, but GPUs 1, 2,
    # 5, 6 are: the TP-4 model starts there instead of waiting for a scale-down, evicting the
    # least-score replica's GPUs last (the replica on GPU 2 scores more than the one on GPU 5).
    busy = {f"g{i}": WorkerState.DEDICATED for i in (0, 3, 4, 7)}
    n = node("a", 8, **busy)
    insts = [Instance("o", "a", (i,), 1) for i in (0, 3, 4, 7)]
    reps = [Replica("o", BASIC, 0, 3.0, "a", (2,)), Replica("o", BURST, 0, 1.0, "a", (5,))]
    c = choose_start(state([n], [spec("m", tp=4), spec("o")], {}, reps, insts), "m")
    assert isinstance(c, StartChoice) and not c.hit
    assert c.gpus == (1, 2, 5, 6) and c.evicted_score == 4.0
    # The instance's exact GPU set is then an occupant: a later plan never partially overlaps it.
    after = state(
        [node("a", 8, **{f"g{i}": WorkerState.DEDICATED for i in (0, 1, 2, 3, 4, 5, 6, 7)})],
        [spec("m", tp=4), spec("o"), spec("x", tp=2)],
        {"x": ONE_BASIC},
        (),
        [*insts, Instance("m", "a", c.gpus, 1)],
    )
    assert plan_prewarm(after).place == ()
    # With only 3 startable GPUs left there is no capacity.
    busy5 = {f"g{i}": WorkerState.DEDICATED for i in (0, 1, 3, 4, 7)}
    insts5 = [Instance("o", "a", (i,), 1) for i in (0, 1, 3, 4, 7)]
    c = choose_start(
        state([node("a", 8, **busy5)], [spec("m", tp=4), spec("o")], {}, (), insts5), "m"
    )
    assert isinstance(c, NoCapacity)


def test_start_ties_break_best_fit_keeping_free_blocks_whole() -> None:
    # The simulator's starved TP-2 model: node "a" has GPUs 0-2 free, node "b" only GPU 0.  A
    # TP-1 start with equal evicted score goes to "b" (the node with fewer startable GPUs), so
    # "a" keeps a free pair; by node name alone it took a's GPU and left one GPU per node.
    m = spec("m")
    a = node("a", 4, g3=WorkerState.DEDICATED)
    b = node("b", 4, g1=WorkerState.DEDICATED, g2=WorkerState.DEDICATED, g3=WorkerState.DEDICATED)
    insts = [Instance("o", "a", (3,), 1), Instance("o", "b", (1,), 1),
             Instance("o", "b", (2,), 1), Instance("o", "b", (3,), 1)]
    hits = [Replica("m", BURST, 0, 0.0, "a", (0,)), Replica("m", BURST, 0, 0.0, "b", (0,))]
    c = choose_start(state([a, b], [m, spec("o")], {}, hits, insts), "m")
    assert isinstance(c, StartChoice) and c.hit and (c.node, c.gpus) == ("b", (0,))
    c = choose_start(state([a, b], [m, spec("o")], {}, (), insts), "m")
    assert isinstance(c, StartChoice) and not c.hit and (c.node, c.gpus) == ("b", (0,))
    # Evicted score still comes first: a hit on "a" that evicts nothing beats one on "b" that
    # evicts a replica.
    other = Replica("o", BASIC, 0, 3.0, "b", (0,))
    c = choose_start(state([a, b], [m, spec("o")], {}, [*hits, other], insts), "m")
    assert isinstance(c, StartChoice) and (c.node, c.gpus, c.evicts) == ("a", (0,), ())
    # Equal fit: node name, then lowest GPU.
    c = choose_start(state([node("b", 2), node("a", 2)], [m], {}), "m")
    assert isinstance(c, StartChoice) and (c.node, c.gpus) == ("a", (0,))


def test_no_capacity_reasons() -> None:
    c = choose_start(state([node("a", 2)], [spec("m", tp=4)], {}), "m")
    assert isinstance(c, NoCapacity) and "exceeds the GPU count" in c.reason
    c = choose_start(state([node("a", 2, mem=8 * GiB)], [spec("m", gb=20)], {}), "m")
    assert isinstance(c, NoCapacity) and "exceed the memory of every GPU" in c.reason
    n = node("a", 2, g0=WorkerState.DEDICATED, g1=WorkerState.DEDICATED)
    inst = Instance("o", "a", (0, 1), 1)
    c = choose_start(state([n], [spec("m"), spec("o", tp=2)], {}, instances=[inst]), "m")
    assert isinstance(c, NoCapacity) and "serving or draining" in c.reason
    with pytest.raises(PolicyInputError, match="unknown model"):
        choose_start(state([node("a", 2)], [spec("m")], {}), "nope")
