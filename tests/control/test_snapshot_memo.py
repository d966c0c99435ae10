"""build_state's memo never changes a snapshot: a sequence of observations built
with one shared :class:`SnapshotMemo` gives exactly the snapshots built from scratch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.control.observation import GpuObs, InstanceObs, Observation, SlotObs
from warmserve.control.snapshot import SnapshotMemo, build_state
from warmserve.policy.cluster import GiB, InstancePhase, LoadForecast, ModelSpec, ReplicaKind

NODES = ("n0", "n1")
GPUS = tuple(GpuObs(n, g, 80 * GiB) for n in NODES for g in range(4))
SPECS = {
    "a": ModelSpec("a", 14 * GiB, tp=1, max_batch=8),
    "b": ModelSpec("b", 26 * GiB, tp=2, max_batch=16),
}
GROUPS = ((0,), (1,), (2,), (3,), (0, 1), (2, 3))


@st.composite
def observations(draw: st.DrawFn, t: float) -> Observation:
    slots = []
    for k in range(draw(st.integers(0, 4))):
        model = draw(st.sampled_from(("a", "b", "x")))  # "x": not managed
        prio = draw(st.sampled_from((None, (ReplicaKind.BASIC, 0, 2.0))))
        slots.append(SlotObs(f"s{k}", model, draw(st.sampled_from(NODES)),
                             draw(st.sampled_from(GROUPS)),
                             draw(st.sampled_from((GiB, 7 * GiB, 13 * GiB))),
                             draw(st.sampled_from((None, 1, 4))), foreign=model == "x",
                             priority=prio))
    insts = []
    for k in range(draw(st.integers(0, 4))):
        model = draw(st.sampled_from(("a", "b", "x")))
        cap = draw(st.sampled_from((0, 8 * GiB, 40 * GiB)))
        insts.append(InstanceObs(
            f"i{k}", model, draw(st.sampled_from(NODES)), draw(st.sampled_from(GROUPS)),
            draw(st.sampled_from(list(InstancePhase))),
            in_flight=draw(st.integers(0, 3)), running=draw(st.integers(0, 3)),
            kv_capacity_bytes=cap, kv_used_bytes=draw(st.integers(0, cap)),
            max_batch=8, foreign=model == "x"))
    return Observation(t, GPUS, tuple(slots), tuple(insts), {})


@settings(max_examples=60, deadline=None)
@given(st.data(), st.booleans())
def test_memo_gives_the_same_snapshots(data: st.DataObject, proactive: bool) -> None:
    memo = SnapshotMemo()
    forecasts = {"a": LoadForecast(1.0, 2.0)}
    seq = []
    for t in range(6):
        # repeat an earlier observation now and then: the memo's hits must be exact too
        if seq and data.draw(st.booleans()):
            obs = data.draw(st.sampled_from(seq))
        else:
            obs = data.draw(observations(float(t)))
        seq.append(obs)
        # the controller's replica priorities change between polls too
        meta = {("a", "n0", (0,)): (ReplicaKind.BURST, t % 2, 0.5 * t)} if t % 3 else {}
        fresh = build_state(obs, SPECS, forecasts, meta=meta, proactive=proactive)
        reused = build_state(obs, SPECS, forecasts, meta=meta, proactive=proactive, memo=memo)
        assert reused == fresh


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.lists(st.integers(-2, 9), max_size=5).map(tuple),
    st.lists(st.integers(0, 9), max_size=5),
    st.lists(st.booleans(), min_size=1, max_size=3).map(tuple),
))
def test_gpu_set_fast_path_normalises_like_the_full_rule(gpus: object) -> None:
    """as_gpu_set's shortcut for an already normalised tuple returns what the
    full normalisation returns, and raises where it raises."""
    from warmserve.policy.cluster import PolicyInputError, as_gpu_set

    def full(gs: object) -> object:
        out = tuple(sorted(int(g) for g in gs))  # type: ignore[attr-defined]
        if not out or len(set(out)) != len(out) or out[0] < 0:
            return PolicyInputError
        return out

    want = full(gpus)
    if want is PolicyInputError:
        try:
            as_gpu_set(gpus)  # type: ignore[arg-type]
        except PolicyInputError:
            return
        raise AssertionError(f"{gpus!r} accepted")
    got = as_gpu_set(gpus)  # type: ignore[arg-type]
    assert got == want and all(type(g) is int for g in got)


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 50), st.floats(0, 5), st.integers(0, 6), st.integers(0, 3),
       st.sampled_from(list(SPECS)))
def test_memoised_replica_requests_equal_a_fresh_computation(
    avg: float, extra: float, active: int, spare: int, model: str
) -> None:
    from warmserve.policy.scoring import _model_replicas, model_replicas

    fc = LoadForecast(avg, avg + extra)
    fresh = list(_model_replicas.__wrapped__(SPECS[model], fc, active, spare))
    assert model_replicas(SPECS[model], fc, active, spare) == fresh
    assert model_replicas(SPECS[model], fc, active, spare) == fresh  # the cached answer
