"""Fair shares between tenants (namespaces) first, then between a tenant's models; demand
capped per tenant.  Pure policy (warmserve.policy.fairness), shared by operator and simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.fairness import FairDemand, cap_per_group, fair_caps

grouped = st.dictionaries(
    st.sampled_from(list("abcdefgh")),
    st.builds(
        FairDemand,
        st.sampled_from([1, 2, 4, 8]),
        st.integers(0, 40),
        st.integers(0, 40),
        st.sampled_from(["team-a", "team-b", "team-c"]),
    ),
    max_size=8,
)


def _gpus(caps: dict[str, int], d: dict[str, FairDemand], group: str) -> int:
    return sum(caps[m] * x.tp for m, x in d.items() if x.group == group)


@given(grouped, st.integers(0, 64))
@settings(max_examples=400, deadline=None)
def test_no_tenant_gets_more_than_its_share_while_another_wants_more(
    d: dict[str, FairDemand], capacity: int
) -> None:
    caps = fair_caps(d, capacity)
    assert all(0 <= caps[m] <= d[m].want for m in d)
    if sum(x.want * x.tp for x in d.values()) <= capacity:
        assert caps == {m: x.want for m, x in d.items()}
        return
    total = sum(caps[m] * x.tp for m, x in d.items())
    assert total <= capacity
    left = capacity - total
    groups = {x.group for x in d.values()}
    for b in groups:
        unmet = [x.tp for m, x in d.items() if x.group == b and caps[m] < x.want]
        if not unmet:
            continue
        assert min(unmet) > left, "work-conserving: an unmet instance that fits was not given"
        for a in groups - {b}:
            given_a = [x.tp for m, x in d.items() if x.group == a and caps[m] > 0]
            if not given_a:
                continue
            # When tenant a got its last instance, tenant b (still wanting one that fitted
            # then) had at least as many GPUs as a had before it: max-min between tenants.
            if min(unmet) <= left + min(given_a):
                assert _gpus(caps, d, a) - max(given_a) <= _gpus(caps, d, b), (a, b, caps)


@given(grouped, st.integers(0, 64))
@settings(max_examples=300, deadline=None)
def test_one_tenant_is_exactly_todays_rule(d: dict[str, FairDemand], capacity: int) -> None:
    """Everyone in one namespace (the simulator; a one-namespace cluster): the shares are the
    ones the per-model rule gives, whatever that namespace is called."""
    one = {m: replace(x, group="") for m, x in d.items()}
    named = {m: replace(x, group="team-z") for m, x in d.items()}
    assert fair_caps(named, capacity) == fair_caps(one, capacity)


def test_a_tenant_cannot_buy_gpus_with_more_deployments_or_more_load() -> None:
    # team-a floods 6 deployments with load; team-b has one modest model.
    d = {f"a{i}": FairDemand(1, 40, 40, "team-a") for i in range(6)}
    d["b"] = FairDemand(1, 4, 4, "team-b")
    caps = fair_caps(d, 8)
    assert caps["b"] == 4  # its whole want: below the half it is entitled to
    assert sum(caps[f"a{i}"] for i in range(6)) == 4
    d["b"] = FairDemand(1, 40, 1, "team-b")  # b wants much more than half, with little load
    caps = fair_caps(d, 8)
    assert caps["b"] == 4 and sum(caps[f"a{i}"] for i in range(6)) == 4


def test_within_a_tenant_shares_still_follow_load() -> None:
    d = {
        "busy": FairDemand(1, 20, 20, "team-a"),
        "quiet": FairDemand(1, 2, 2, "team-a"),
        "other": FairDemand(1, 40, 40, "team-b"),
    }
    caps = fair_caps(d, 22)
    assert caps["other"] == 11
    assert caps == {"busy": 10, "quiet": 1, "other": 11}


counts = st.dictionaries(st.sampled_from(list("abcdefgh")), st.integers(0, 500), max_size=8)
owners = st.dictionaries(
    st.sampled_from(list("abcdefgh")), st.sampled_from(["team-a", "team-b", "team-c"])
)


@given(counts, owners, st.one_of(st.none(), st.integers(0, 300)))
@settings(max_examples=400, deadline=None)
def test_held_demand_capped_per_tenant(
    c: dict[str, int], g: dict[str, str], cap: int | None
) -> None:
    out = cap_per_group(c, g, cap)
    assert all(0 < out[m] <= c[m] for m in out), "never more than reported, zeros left out"
    groups = {g.get(m, "") for m in c}
    for grp in groups:
        members = [m for m in c if g.get(m, "") == grp]
        before = sum(c[m] for m in members)
        after = sum(out.get(m, 0) for m in members)
        if cap is None or before <= cap:
            assert all(out.get(m, 0) == c[m] for m in members), "under the cap: unchanged"
        else:
            assert after == cap, "over the cap: exactly the cap, spread over its models"
            for m in members:  # in proportion: within one request of the exact share
                assert abs(out.get(m, 0) - c[m] * cap / before) < 1


def test_bad_cap_is_a_clear_error() -> None:
    with pytest.raises(PolicyInputError, match="cap"):
        cap_per_group({"a": 1}, {}, -1)
    with pytest.raises(PolicyInputError, match="counts"):
        cap_per_group({"a": -1}, {}, 3)
