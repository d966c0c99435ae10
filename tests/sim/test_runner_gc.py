"""The simulation's garbage-collector setting (warmserve.sim.runner.few_collections)."""

from __future__ import annotations

import gc

import pytest

from warmserve.sim.runner import GC_GEN0_THRESHOLD, few_collections


def test_few_collections_freezes_and_restores_the_collector():
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with few_collections():
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > frozen  # what existed is never scanned again
        assert gc.isenabled()  # seldom, not never: cycles are still collected
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_few_collections_restores_after_an_error():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), few_collections():
        raise RuntimeError("the run failed")
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
