"""SimCluster.counts (the timeline's GPUs per worker state) counts without visiting every GPU;
it must equal gpu_state's rule applied GPU by GPU."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import WorkerState
from warmserve.sim.cluster import GRACE, SERVING, STARTING, SimCluster, SimReplica

NODES, PER_NODE = 3, 4


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.tuples(st.integers(0, NODES - 1), st.integers(0, PER_NODE - 1)),
                    st.sampled_from((STARTING, SERVING, GRACE)), max_size=12),
    st.lists(st.tuples(st.integers(0, NODES - 1), st.sampled_from(((0,), (1,), (0, 1), (2, 3)))),
             max_size=8),
)
def test_counts_equal_the_per_gpu_rule(held: dict, replicas: list) -> None:
    cl = SimCluster(NODES, PER_NODE, 80 * 2**30)
    for (n, g), phase in held.items():
        cl.holder[(f"node-{n}", g)] = SimpleNamespace(phase=phase)  # type: ignore[assignment]
    for n, gpus in replicas:
        cl.add_replica(SimReplica("m", f"node-{n}", gpus, 2**30, 1, 0.0, 0.0))
    used = cl.replica_bytes()
    want = {s.value: 0 for s in WorkerState}
    for n in cl.node_names:
        for g in range(cl.gpus_per_node):
            want[cl.gpu_state(n, g, (n, g) in used).value] += 1
    got = cl.counts()
    assert got == want and list(got) == list(want)
