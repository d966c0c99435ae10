"""Fair shares of GPUs between models: one deployment must not starve the rest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.fairness import FairDemand, fair_caps

demands = st.dictionaries(
    st.sampled_from(list("abcdefgh")),
    st.builds(FairDemand, st.sampled_from([1, 2, 4, 8]), st.integers(0, 40), st.integers(0, 40)),
    max_size=8,
)


@given(demands, st.integers(0, 64))
@settings(max_examples=300, deadline=None)
def test_fair_caps_invariants(d: dict[str, FairDemand], capacity: int) -> None:
    caps = fair_caps(d, capacity)
    assert set(caps) == set(d)
    assert all(0 <= caps[m] <= d[m].want for m in d), "never more than wanted"
    total = sum(caps[m] * d[m].tp for m in d)
    if sum(x.want * x.tp for x in d.values()) <= capacity:
        assert caps == {m: x.want for m, x in d.items()}, "everything fits: everyone gets it"
        return
    assert total <= capacity, "never more GPUs than there are"
    left = capacity - total
    for m, x in d.items():
        if caps[m] < x.want:
            assert x.tp > left, f"{m} could still get an instance: not work-conserving"
            # weighted max-min: another model's last instance went to it while its GPUs per
            # unit of need were no more than this one's (unless this one's did not fit then)
            for o, y in d.items():
                if caps[o] > 0 and o != m:
                    before = (caps[o] - 1) * y.tp / y.weight
                    assert before <= caps[m] * x.tp / x.weight + 1e-9 or x.tp > left + y.tp


def test_a_hog_does_not_starve_the_others() -> None:
    caps = fair_caps(
        {"hog": FairDemand(1, 1000), "chat": FairDemand(1, 2, 2), "big": FairDemand(4, 1, 1)}, 8
    )
    assert caps["chat"] == 2 and caps["big"] == 1 and caps["hog"] == 2


def test_shares_follow_load_not_gpu_counts() -> None:
    """A model with ten times the load gets about ten times the GPUs, not an equal split."""
    caps = fair_caps({"busy": FairDemand(1, 20, 20), "quiet": FairDemand(1, 2, 2)}, 11)
    assert caps == {"busy": 10, "quiet": 1}


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(PolicyInputError, match="tp >= 1"):
        FairDemand(0, 1)
    with pytest.raises(PolicyInputError, match="capacity"):
        fair_caps({}, -1)
