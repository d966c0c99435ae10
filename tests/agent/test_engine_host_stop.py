"""Stopping a tensor-parallel engine whose rank-0 worker dies under the stop (an agent's shutdown:
the signal reaches the pooled workers too) still tears the other ranks down and unlinks the
group's shared-memory names; nothing else would, since vLLM unlinks them only at a clean
process exit."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from warmserve_agent.engine_host import WorkerEngine
from warmserve_agent.engines.vllm import tp_executor
from warmserve_agent.worker_errors import WorkerError


class _Worker:
    def __init__(self, dies_on: str = "") -> None:
        self.calls: list[str] = []
        self.dies_on = dies_on
        self.dead = False

    def alive(self) -> bool:
        return not self.dead

    def call(self, cmd: str, timeout_s: float = 30.0, **kw: Any) -> Any:
        self.calls.append(cmd)
        if cmd == self.dies_on:
            self.dead = True
            raise WorkerError(f"worker died during {cmd!r}")
        return None


class _Pool:
    def __init__(self, rank0: _Worker) -> None:
        self.workers = {0: rank0, 1: _Worker()}

    def worker(self, g: int) -> _Worker:
        return self.workers[g]


@pytest.mark.parametrize("dies_on", ["", "stop_engine"])
def test_the_group_is_torn_down_and_unlinked_whether_or_not_rank0_survives_the_stop(
    monkeypatch: pytest.MonkeyPatch, dies_on: str
) -> None:
    unlinked: list[str] = []
    monkeypatch.setattr(tp_executor, "remove_group_shm", lambda sid: unlinked.append(sid) or 2)
    pool = _Pool(_Worker(dies_on=dies_on))
    eng = WorkerEngine(pool, [0, 1])  # type: ignore[arg-type]
    eng._spec = SimpleNamespace(slot_id="slot-ab", tp_peers=True)  # type: ignore[assignment]
    if dies_on:
        with pytest.raises(WorkerError, match="died"):
            eng.stop()  # the caller still learns that the stop failed
    else:
        eng.stop()
    assert pool.workers[0].calls == ["stop_engine"]
    assert pool.workers[1].calls == ["stop_rank"]
    assert unlinked == ["slot-ab"]
