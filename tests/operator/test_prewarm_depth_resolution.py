"""``spec.prewarm.layers`` (an integer or ``auto``): the API parser, the operator's resolution
from the agents' measured profiles, the status it reports, and the prepared engine's bytes in
what the operator observes."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_operator.model_spec import (
    CatalogEntry,
    MeasuredProfile,
    depth_profile,
    merge_profiles,
    profile_from_pb,
    resolve,
)
from warmserve_operator.observe import observation
from warmserve_operator.snapshot import GpuView, NodeSnapshot, SlotView
from warmserve_operator.status import ModelView, model_status

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.api.agent.wire import SlotState
from warmserve.api.crd import SpecError, parse_model_deployment
from warmserve.policy.cluster import GiB, WorkerState
from warmserve.policy.prewarm_depth import DepthSource, choose_depth, min_resident_layers


def body(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "x", "namespace": "ns", "uid": "u", "generation": 2},
        "spec": {"model": {"name": "m"}, **spec},
    }


# a 32-layer model of 8 GiB: a layer's shard is 256 MiB; at 2 GiB/s it loads in 125 ms
PROFILE = MeasuredProfile(
    load_bytes_per_s=2 * GiB, layer_compute_s=0.025, prompt_tokens=256, compute_tp=1,
    head_s=0.0, head_start_s=0.5, engine_overhead_bytes=GiB,
)


def catalog(profile: MeasuredProfile | None = PROFILE) -> dict[str, CatalogEntry]:
    return {"m": CatalogEntry("m", 8 * GiB, 32, profile=profile)}


# ------------------------------------------------------------------------------- parser


@pytest.mark.parametrize(("layers", "want"), [(None, None), ("auto", None), (1, 1), (1024, 1024)])
def test_prewarm_layers_parses_auto_or_an_integer(layers: Any, want: int | None) -> None:
    prewarm = {} if layers is None else {"layers": layers}
    assert parse_model_deployment(body(prewarm=prewarm)).prewarm_layers == want


@pytest.mark.parametrize("layers", ["most", "", "AUTO", "8", 0, -1, 1025, 2.5, True, [4], None])
def test_bad_prewarm_layers_are_refused_naming_the_field(layers: Any) -> None:
    with pytest.raises(SpecError, match=r'spec.prewarm.layers must be an integer in \[1, 1024\] '
                                        r"or 'auto'"):
        parse_model_deployment(body(prewarm={"layers": layers}))


# ---------------------------------------------------------------------------- resolution


def test_auto_without_a_profile_keeps_every_layer() -> None:
    spec, depth = resolve(parse_model_deployment(body()), catalog(None))
    assert spec.prewarm_layers is None and spec.resident_layers == 32  # today's behaviour
    assert spec.engine_overhead_bytes == 0
    assert (depth.layers, depth.source) == (32, DepthSource.FALLBACK)
    assert "no measured profile" in depth.reason


def test_auto_with_a_profile_is_the_policy_rule_on_it() -> None:
    spec, depth = resolve(parse_model_deployment(body()), catalog())
    # 125 ms per layer against 25 ms of compute, a 500 ms head start: the last layer must
    # arrive by the time a resident model's forward ends (32 * 25 ms = 800 ms):
    # (32 - r) * 125 - 500 + 25 <= 800  ->  r >= 21.6  ->  22
    assert spec.prewarm_layers == depth.layers == 22
    assert depth.source == DepthSource.PROFILED
    assert "22 of 32 layers" in depth.reason and "256 prompt tokens" in depth.reason
    assert spec.engine_overhead_bytes == GiB
    assert spec.prewarm_bytes_per_gpu == math.ceil(8 * GiB * 22 / 32) + GiB


def test_an_integer_overrides_the_profile() -> None:
    spec, depth = resolve(parse_model_deployment(body(prewarm={"layers": 5})), catalog())
    assert spec.prewarm_layers == 5 and depth.source == DepthSource.SPEC
    assert spec.engine_overhead_bytes == GiB  # the engine is charged whatever the depth
    with pytest.raises(SpecError, match="exceeds the model's 32 layers"):
        resolve(parse_model_deployment(body(prewarm={"layers": 33})), catalog())


def test_a_profile_measured_at_another_tp_is_scaled() -> None:
    md = parse_model_deployment(body(tensorParallel=2))
    p = depth_profile(PROFILE, 8 * GiB, 32, 2)
    assert p is not None
    assert p.layer_load_s == pytest.approx(0.0625)  # half a layer's bytes per GPU
    assert p.layer_compute_s == pytest.approx(0.0125)  # half a layer's work per GPU
    spec, _ = resolve(md, catalog())
    assert spec.prewarm_layers == choose_depth(32, None, p).layers


def test_a_partial_profile_falls_back() -> None:
    for partial in (MeasuredProfile(load_bytes_per_s=GiB), MeasuredProfile(layer_compute_s=0.1,
                                                                             compute_tp=1)):
        spec, depth = resolve(parse_model_deployment(body()), catalog(partial))
        assert spec.prewarm_layers is None and depth.source == DepthSource.FALLBACK


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_an_agents_nonsense_numbers_are_not_measurements(bad: float) -> None:
    msg = pb.ModelProfile(
        load_bytes_per_second=bad, layer_compute_seconds=bad, prompt_tokens=8, compute_tp=1,
        head_seconds=bad, head_start_seconds=bad,
    )
    p = profile_from_pb(msg)
    assert (p.load_bytes_per_s, p.layer_compute_s, p.head_s, p.head_start_s) == (0, 0, 0, 0)
    spec, depth = resolve(parse_model_deployment(body()), catalog(p))
    assert depth.source == DepthSource.FALLBACK and spec.prewarm_layers is None


node_profiles = st.lists(
    st.builds(
        MeasuredProfile,
        load_bytes_per_s=st.floats(min_value=1e8, max_value=1e11),
        layer_compute_s=st.floats(min_value=1e-5, max_value=0.1),
        prompt_tokens=st.just(256),
        compute_tp=st.just(1),
        head_start_s=st.floats(min_value=1e-3, max_value=2.0),  # 0 means "not measured"
        engine_overhead_bytes=st.integers(min_value=0, max_value=4 * GiB),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=100, deadline=None)
@given(node_profiles)
def test_merged_profile_holds_on_every_node(profiles: list[MeasuredProfile]) -> None:
    merged = merge_profiles(profiles)
    assert merged is not None

    def depth(p: MeasuredProfile) -> int:
        dp = depth_profile(p, 8 * GiB, 32, 1)
        assert dp is not None
        return min_resident_layers(32, dp.layer_load_s, dp.layer_compute_s,
                                   head_start_s=dp.head_start_s)

    assert depth(merged) >= max(depth(p) for p in profiles)
    assert merged.engine_overhead_bytes == max(p.engine_overhead_bytes for p in profiles)
    assert merge_profiles(reversed(profiles)) == merged  # the order of the nodes is no input


# ------------------------------------------------------------------- status and observation


def test_status_shows_the_depth_and_why() -> None:
    spec, depth = resolve(parse_model_deployment(body()), catalog())
    view = ModelView(generation=2, window_s=60.0, weight_bytes=spec.weight_bytes,
                     num_layers=32, depth=depth, engine_overhead_bytes=spec.engine_overhead_bytes)
    facts = model_status("m", view, {}, {}, None, "2026-01-01T00:00:00Z")["model"]
    assert facts["prewarmLayers"] == 22 and facts["prewarmLayersSource"] == "profiled"
    assert facts["prewarmLayersReason"] == depth.reason
    assert facts["engineOverheadBytes"] == GiB


def test_a_slot_is_observed_with_its_prepared_engine() -> None:
    slot = SlotView("s1", "m", (0,), 22, 32, 22, 5 * GiB, 8 * GiB, SlotState.READY, owner="u")
    snap = NodeSnapshot("n", "a", 1, (GpuView(0, 80 * GiB, 74 * GiB, WorkerState.UNIVERSAL,
                                              ("s1",)),), (slot,))
    plain = observation(0.0, {"n": snap}, {"m": "u"}, {"u"})
    charged = observation(0.0, {"n": snap}, {"m": "u"}, {"u"}, engine_bytes={"m": GiB})
    assert charged.slots[0].bytes_per_gpu == plain.slots[0].bytes_per_gpu + GiB
