"""The incremental free-memory re-plan trigger (:mod:`warmserve.control.free_growth`)
answers exactly as the rule computed over every GPU, with the snapshot memo reusing node
objects between snapshots as the controller's does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.control.test_snapshot_memo import SPECS, observations
from warmserve.control.free_growth import FREE_GROWTH_BYTES, FreeGrowth
from warmserve.control.snapshot import SnapshotMemo, build_state
from warmserve.policy.cluster import ClusterState, LoadForecast, WorkerState


class FullRule:
    """The rule as the controller computed it before (every GPU, every call)."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, int], int] = {}

    @staticmethod
    def free_map(state: ClusterState) -> dict[tuple[str, int], int]:
        return {(n.name, g.index): g.free_bytes for n in state.nodes for g in n.gpus
                if g.state != WorkerState.DEDICATED}

    def reset(self, state: ClusterState) -> None:
        self.last = self.free_map(state)

    def grew(self, state: ClusterState) -> bool:
        cur = self.free_map(state)
        if any(v > self.last.get(k, 0) + FREE_GROWTH_BYTES for k, v in cur.items()):
            return True
        self.last = {k: min(v, self.last.get(k, v)) for k, v in cur.items()}
        return False


@settings(max_examples=80, deadline=None)
@given(st.data(), st.booleans())
def test_incremental_trigger_equals_the_full_rule(data: st.DataObject, proactive: bool) -> None:
    memo = SnapshotMemo()
    fast, full = FreeGrowth(), FullRule()
    seq = []
    for t in range(10):
        if seq and data.draw(st.booleans()):  # repeats: the memo hands back the same nodes
            obs = data.draw(st.sampled_from(seq))
        else:
            obs = data.draw(observations(float(t)))
        seq.append(obs)
        state = build_state(obs, SPECS, {"a": LoadForecast(1.0, 2.0)}, proactive=proactive,
                            memo=memo)
        if data.draw(st.integers(0, 3)) == 0:  # a plan ran on this snapshot
            fast.reset(state)
            full.reset(state)
            continue
        assert fast.grew(state) == full.grew(state)
        assert fast.as_map() == full.last
