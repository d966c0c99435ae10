"""A tensor-parallel rank's intra-op threads: its share of the host's cores (as vLLM's own CPU
executor gives each rank), never fewer than one; a TP=1 engine keeps the process's default."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from warmserve_agent.engines.vllm.cpu_threads import rank_threads


@given(st.integers(1, 64), st.integers(1, 256), st.integers(1, 256))
def test_a_groups_ranks_never_oversubscribe_the_cores_they_can_share(
    tp: int, cores: int, default: int
) -> None:
    n = rank_threads(tp, cores, default)
    assert n >= 1
    if tp == 1:
        assert n == default
    elif tp <= cores:
        assert n * tp <= cores and (n + 1) * tp > cores  # the largest even share
    else:
        assert n == 1  # more ranks than cores: one thread each, never zero


def test_two_ranks_on_two_cores_run_one_thread_each() -> None:
    assert rank_threads(2, 2, 2) == 1
    assert rank_threads(1, 2, 2) == 2
    assert rank_threads(4, 16, 16) == 4
