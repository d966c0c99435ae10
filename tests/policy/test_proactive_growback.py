"""Growing lent KV back (§4.1): the reservation with waiting demand, and which prewarmed layers
to evict for it (newest borrower first, last layers first).  Pure policy: hand examples and
hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import GiB, PolicyInputError
from warmserve.policy.proactive import (
    Borrower,
    grace_reservation,
    reclaim_layers,
    reservation_target,
)


def test_grace_reservation_is_eq1_without_demand_and_grows_with_it() -> None:
    eq1 = reservation_target(3, 32, 60 * GiB, 4 * GiB)
    assert grace_reservation(3, 32, 60 * GiB, 4 * GiB) == eq1
    # a request finds 10 GiB too few in the 6 GiB kept: 16 GiB beats Eq. 1's 5.875 GiB
    assert grace_reservation(3, 32, 60 * GiB, 4 * GiB, 10 * GiB, 6 * GiB) == 16 * GiB
    assert grace_reservation(3, 32, 60 * GiB, 4 * GiB, 1, 1) == eq1  # Eq. 1 is larger
    assert grace_reservation(3, 32, 60 * GiB, 4 * GiB, 100 * GiB, 6 * GiB) == 60 * GiB  # <= M
    with pytest.raises(PolicyInputError):
        grace_reservation(3, 32, 60 * GiB, 4 * GiB, -1)


@given(
    r=st.integers(0, 64),
    c=st.integers(1, 64),
    m=st.integers(0, 1 << 40),
    k_frac=st.floats(0, 1),
    w=st.integers(0, 1 << 41),
    kept_frac=st.floats(0, 1),
)
def test_grace_reservation_bounds(
    r: int, c: int, m: int, k_frac: float, w: int, kept_frac: float
) -> None:
    k = int(m * k_frac)
    kept = int(m * kept_frac)
    got = grace_reservation(r, c, m, k, w, kept)
    assert reservation_target(r, c, m, k) <= got <= m
    if w:
        assert got >= min(m, kept + w)  # what waits fits once the range grows back
    else:
        assert got == reservation_target(r, c, m, k)


def _b(slot: str, gpus: set[int], per_layer: list[int]) -> Borrower:
    cum = [0]
    for n in per_layer:
        cum.append(cum[-1] + n)
    return Borrower(slot, frozenset(gpus), tuple(cum))


def test_newest_borrower_loses_its_last_layers_first() -> None:
    old = _b("old", {0}, [3, 3, 3])
    new = _b("new", {0}, [2, 2, 2, 2])
    assert reclaim_layers({0: 3}, [old, new]) == [("new", 2)]  # 2 layers (4 pages) freed
    assert reclaim_layers({0: 8}, [old, new]) == [("new", 0)]
    assert reclaim_layers({0: 9}, [old, new]) == [("new", 0), ("old", 2)]
    assert reclaim_layers({0: 0}, [old, new]) == []
    # a borrower on another GPU is left alone
    other = _b("other", {1}, [5, 5])
    assert reclaim_layers({0: 2}, [old, new, other]) == [("new", 3)]
    # more than everyone holds: everything goes, still short
    assert reclaim_layers({0: 100}, [old, new]) == [("new", 0), ("old", 0)]


def test_a_borrower_spanning_gpus_counts_on_each() -> None:
    wide = _b("wide", {0, 1}, [4, 4])
    assert reclaim_layers({0: 3, 1: 5}, [wide]) == [("wide", 0)]
    assert reclaim_layers({0: 3, 1: 1}, [wide]) == [("wide", 1)]


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[int, int], list[Borrower]]:
    n = draw(st.integers(0, 5))
    borrowers = [
        _b(
            f"s{i}",
            set(draw(st.sets(st.integers(0, 2), min_size=1, max_size=3))),
            draw(st.lists(st.integers(0, 6), min_size=1, max_size=5)),
        )
        for i in range(n)
    ]
    short = draw(st.dictionaries(st.integers(0, 2), st.integers(-2, 30), max_size=3))
    return short, borrowers


@settings(max_examples=300)
@given(cases())
def test_reclaim_covers_what_it_can_newest_first_and_no_more(
    case: tuple[dict[int, int], list[Borrower]],
) -> None:
    short, borrowers = case
    plan = reclaim_layers(short, borrowers)
    by_slot = {b.slot: b for b in borrowers}
    order = [b.slot for b in borrowers]
    # newest first: the plan walks admission order backwards
    idx = [order.index(s) for s, _ in plan]
    assert idx == sorted(idx, reverse=True)
    freed = dict.fromkeys(range(3), 0)
    for slot, keep in plan:
        b = by_slot[slot]
        top = len(b.pages_by_layers) - 1
        assert 0 <= keep < top  # something was evicted, a prefix stays
        for g in b.gpus:
            freed[g] += b.pages_by_layers[top] - b.pages_by_layers[keep]
    # covered wherever the borrowers on that GPU hold enough
    for g, n in short.items():
        holdable = sum(b.pages_by_layers[-1] for b in borrowers if g in b.gpus)
        if n <= holdable:
            assert freed[g] >= n, (g, n, plan)
    # no more than needed: keeping one more layer of the last borrower touched would have left
    # one of its GPUs short
    if plan:
        slot, keep = plan[-1]
        b = by_slot[slot]
        layer = b.pages_by_layers[keep + 1] - b.pages_by_layers[keep]
        assert any(freed[g] - layer < short.get(g, 0) for g in b.gpus), (short, plan)
