"""Tracing's hostile-input edges without a collector: flags, the held-request trace contexts on
the /demand wire, a tenant's engine arguments (the gateway against malformed client headers is
in test_tracing_e2e.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from warmserve_operator.gateway_demand import held_traces, sum_held

from warmserve.api.demand import MAX_TRACES, DemandError, DemandReport, ModelDemand
from warmserve.cli import main
from warmserve.engine_arg_policy import EngineArgPolicyError
from warmserve.engine_args import (
    EngineArgPolicy,
    EngineArgsError,
    parse_engine_args,
    validate_engine_args,
)
from warmserve.tracing import TracingConfig, TracingConfigError, traces_url, valid_traceparent

API = "warmserve.io/demand/v1"


def tp(trace: int, span: int, flags: int = 1) -> str:
    return f"00-{trace:032x}-{span:016x}-{flags:02x}"


# ---------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("collector:4318", "http(s)://"),
        ("grpc://collector:4317", "http(s)://"),
        ("http://", "http(s)://"),
        ("http://user:secret@collector:4318", "credentials"),
        ("http://collector:4318/?x=1", "query"),
        ("http://collector:99999", "Port out of range"),
        ("http://collector:0", "port 0"),
    ],
)
def test_bad_endpoints_are_refused_naming_the_flag(endpoint: str, why: str) -> None:
    with pytest.raises(TracingConfigError, match="--otlp-traces-endpoint") as exc:
        TracingConfig(endpoint)
    assert why in str(exc.value)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), float("inf"), True])
def test_bad_sample_ratios_are_refused(ratio: Any) -> None:
    with pytest.raises(TracingConfigError, match="--trace-sample-ratio"):
        TracingConfig("http://collector:4318", ratio)


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/") == "https://c/otlp/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


@pytest.mark.parametrize("command", ["gateway", "operator", "agent"])
def test_every_component_refuses_a_bad_endpoint_at_start(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    extra = {"agent": ["--simulate-gpus", "1x1GiB", "--model-dir", str(tmp_path)]}
    rc = main([command, *extra.get(command, []), "--otlp-traces-endpoint", "ftp://x:1"])
    assert rc != 0
    assert "--otlp-traces-endpoint 'ftp://x:1'" in capsys.readouterr().err


# ------------------------------------------------------------------------- the demand wire

traceparents = st.builds(
    tp, st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.sampled_from([0, 1])
)


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=20),
        st.builds(
            ModelDemand,
            st.integers(0, 100),
            st.integers(0, 100),
            st.sampled_from(["", "team-a", "warmserve"]),
            st.lists(traceparents, max_size=MAX_TRACES).map(tuple),
        ),
        max_size=4,
    )
)
def test_demand_reports_with_traces_round_trip(models: dict[str, ModelDemand]) -> None:
    r = DemandReport("gw-1", 1.0, 3, models)
    assert DemandReport.from_json(json.loads(json.dumps(r.to_json()))) == r


def test_without_traces_the_wire_is_unchanged() -> None:
    """A gateway with tracing off writes exactly the old document (an older operator reads
    it), and a document from an older gateway (no traces) still parses."""
    doc = DemandReport("gw", 1.0, 1, {"m": ModelDemand(2, 1)}).to_json()
    assert doc["models"] == {"m": {"held": 2, "inflight": 1}}
    old = {"apiVersion": API, "models": {"m": {"held": 2, "inflight": 1}}}
    assert DemandReport.from_json(old).models["m"] == ModelDemand(2, 1, "", ())


def test_traces_ride_next_to_the_namespace_and_never_add_demand() -> None:
    """The tenancy format carries ``namespace`` per model; ``traces`` sits beside it, and the
    per-namespace cap of held demand counts ``held`` only (links are not demand)."""
    traces = tuple(tp(1, i) for i in range(1, 4))
    r = DemandReport("gw", 1.0, 1, {"m": ModelDemand(9, 0, "team-a", traces)})
    doc = json.loads(json.dumps(r.to_json()))
    assert doc["models"]["m"] == {
        "held": 9, "inflight": 0, "namespace": "team-a", "traces": list(traces)
    }  # fmt: skip
    back = DemandReport.from_json(doc)
    assert back == r
    assert sum_held([back], held_per_namespace=4) == {"m": 4}
    assert held_traces([back]) == {"m": traces}


@pytest.mark.parametrize(
    "traces, why",
    [
        ("00-x", "list"),
        ([tp(1, 1)] * (MAX_TRACES + 1), f"at most {MAX_TRACES}"),
        ([7], "traceparent"),
        (["00-abc-def-01"], "traceparent"),
        ([tp(0, 1)], "traceparent"),  # all-zero trace id
        ([tp(1, 0)], "traceparent"),  # all-zero span id
        ([tp(0xABC, 0xDEF).upper()], "traceparent"),  # W3C: lowercase hex only
        (["01" + tp(1, 1)[2:]], "traceparent"),  # a version this reader does not know
        ([tp(1, 1) + "-extra"], "traceparent"),
    ],
)
def test_bad_trace_contexts_in_a_report_are_refused(traces: Any, why: str) -> None:
    doc = {"apiVersion": API, "models": {"m": {"held": 1, "traces": traces}}}
    with pytest.raises(DemandError, match="traces") as exc:
        DemandReport.from_json(doc)
    assert why in str(exc.value)


def test_held_traces_over_replicas_are_bounded_oldest_first() -> None:
    a = DemandReport("a", 0, 0, {"m": ModelDemand(5, traces=tuple(tp(1, i) for i in range(1, 6)))})
    b = DemandReport("b", 0, 0, {"m": ModelDemand(6, traces=tuple(tp(2, i) for i in range(1, 7)))})
    got = held_traces([a, b])
    assert len(got["m"]) == MAX_TRACES
    assert got["m"][:5] == a.models["m"].traces
    assert all(valid_traceparent(t) for t in got["m"])


# -------------------------------------------------------------------------- engine arguments


def test_a_tenant_cannot_point_the_engines_traces_anywhere() -> None:
    """``--otlp-traces-endpoint`` in spec.engine.args would make the engine send every
    request's trace (model, timings, the gateway's trace ids) to an address the tenant picks,
    from inside the cluster: the agent sets it (the chart's tracing.endpoint), never a tenant."""
    for args in (
        ["--otlp-traces-endpoint", "http://attacker.example:4318"],
        ["--otlp-traces-endpoint=http://10.0.0.1:4318"],
        ["--otlp_traces_endpoint", "http://x:1"],
    ):
        with pytest.raises(EngineArgsError, match="otlp") as exc:
            validate_engine_args(args)
        assert "--otlp-traces-endpoint" in str(exc.value)
        assert "set by warmserve" in str(exc.value)
        # warmserve's own argument (MANAGED): no admin widening lets a tenant set it, and the
        # agent's check after the policy (policy=None) refuses it too
        with pytest.raises(EngineArgsError, match="set by warmserve"):
            parse_engine_args(args, policy=None)
    for extra, unsafe in ((["otlp_traces_endpoint"], []), ([], ["otlp-traces-endpoint"])):
        with pytest.raises(EngineArgPolicyError, match="set by warmserve"):
            EngineArgPolicy.from_admin(extra, unsafe)
