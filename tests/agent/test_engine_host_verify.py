"""Which engines' other tensor-parallel ranks are hashed at activation: those of an engine that
checks its own rank's bytes (the simulated engine), not vLLM's, which trusts the slot as it
trusts a file (hashing a large shard at activation would cost seconds per GiB)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from warmserve_agent.engine import WeightsMismatch
from warmserve_agent.engine_host import WorkerEngine


class _Worker:
    def __init__(self, bad: list[str]) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.bad = bad

    def call(self, cmd: str, timeout_s: float = 30.0, **kw: Any) -> Any:
        self.calls.append((cmd, kw))
        return self.bad


class _Pool:
    def __init__(self, bad: list[str] | None = None) -> None:
        self.workers = {0: _Worker([]), 1: _Worker(bad or [])}

    def worker(self, g: int) -> _Worker:
        return self.workers[g]


def _spec(engine: str) -> Any:
    regions = [
        SimpleNamespace(host_file="", local=True, va=0x1000),
        SimpleNamespace(host_file="", local=False, va=0x2000),
    ]
    tensors = [
        SimpleNamespace(name=f"t{i}", offset=64 * i, shard_len=[32, 32], layer=i) for i in range(4)
    ]
    return SimpleNamespace(
        engine=engine, regions=regions, tensors=tensors, digests=[["d"] * 4, ["e"] * 4]
    )


@pytest.mark.parametrize(("engine", "hashed"), [("simulated", True), ("vllm", False)])
def test_other_ranks_are_hashed_only_for_an_engine_that_checks_its_own(
    engine: str, hashed: bool
) -> None:
    pool = _Pool()
    eng = WorkerEngine(pool, [0, 1])  # type: ignore[arg-type]
    eng._spec = _spec(engine)
    eng._verify_remote(0, 4)
    calls = pool.workers[1].calls
    assert [c for c, _ in calls] == (["verify"] if hashed else [])
    assert not pool.workers[0].calls  # the engine's own rank is never sent to a worker
    if hashed:
        assert [t[0] for t in calls[0][1]["tensors"]] == [f"t{i}[rank 1]" for i in range(4)]


def test_a_mismatch_on_another_rank_fails_the_simulated_engines_activation() -> None:
    eng = WorkerEngine(_Pool(bad=["t2[rank 1]"]), [0, 1])  # type: ignore[arg-type]
    eng._spec = _spec("simulated")
    with pytest.raises(WeightsMismatch, match="evict the slot"):
        eng._verify_remote(0, 4)
