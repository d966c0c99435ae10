"""Which shared-memory names of vLLM's CPU all-reduce the agent unlinks: a rank before joining
removes only its own stale segment of that slot's group; tearing a group down removes every
rank's, and never another slot's (whose id merely starts the same)."""

from __future__ import annotations

from pathlib import Path

from warmserve_agent.engines.vllm.tp_executor import remove_group_shm, unlink_stale_rank_shm


def _touch(d: Path, *names: str) -> None:
    for n in names:
        (d / n).touch()


def test_a_joining_rank_unlinks_only_its_own_stale_segment(tmp_path: Path) -> None:
    _touch(tmp_path, "slot-ab.store-tp:0-[0-1]-cpushm_0", "slot-ab.store-tp:0-[0-1]-cpushm_1")
    assert unlink_stale_rank_shm("file:///d/slot-ab.store", 1, str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot-ab.store-tp:0-[0-1]-cpushm_0"]


def test_a_torn_down_group_leaves_no_name_and_other_slots_keep_theirs(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        "slot-ab.store-tp:0-[0-1]-cpushm_0",
        "slot-ab.store-tp:0-[0-1]-cpushm_1",
        "slot-abc.store-tp:0-[0-1]-cpushm_0",
        "slot-ab[x].store-tp:0-[0-1]-cpushm_0",
    )
    assert remove_group_shm("slot-ab", str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "slot-ab[x].store-tp:0-[0-1]-cpushm_0",
        "slot-abc.store-tp:0-[0-1]-cpushm_0",
    ]
