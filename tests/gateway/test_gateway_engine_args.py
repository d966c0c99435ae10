"""The gateway does not judge vLLM's engine arguments: it parses ModelDeployments with the API
types' parser (``spec.engine.args`` a bounded list of strings, as the CRD's schema states), and
the operator's admission decides on the arguments (with the admin's widening, which the gateway
is not told).  A refused deployment is held like any other until the operator writes its Ready
condition (reason InvalidSpec); from then on the gateway answers it at once with the operator's
message."""

from __future__ import annotations

import pytest
import yaml
from warmserve_gateway.catalog import Catalog
from warmserve_operator.engine import admit_model_deployment

from tests.gateway.gw_support import AGENT_ADDRESS, NODE, REPO, md, mirror
from warmserve.api.crd import ENGINE_NAMES, MAX_ENGINE_ARG_CHARS, MAX_ENGINE_ARGS, SpecError
from warmserve.engine_args import DEFAULT_POLICY

CALLER = frozenset({"default"})


def _refused_by_the_operator(body: dict) -> str:
    """The operator's InvalidSpec message for ``body`` (its admission, default allowlist)."""
    with pytest.raises(SpecError) as exc:
        admit_model_deployment(body, DEFAULT_POLICY)
    return str(exc.value)


def test_gateway_routes_by_the_operators_admission_of_engine_args() -> None:
    # the admin allowed the endpoint; the instance's engine listens on the agent's host
    widened = md("events", "events", [("i0", "http://127.0.0.1:8001")], node=NODE)
    kv_events = '{"publisher": "zmq", "endpoint": "tcp://collector:5557"}'
    widened["spec"]["engine"] = {"args": ["--kv-events-config", kv_events]}
    refused = md("remote", "remote", [], ready_reason="InvalidSpec")
    refused["spec"]["engine"] = {"args": ["--trust-remote-code"]}
    why = "spec.engine.args: --trust-remote-code: not allowed for tenants: it can run code"
    assert why in _refused_by_the_operator(refused)
    refused["status"]["conditions"][0]["message"] = why
    managed = md("bad", "bad", [])
    managed["spec"]["engine"] = {"args": ["--load-format", "auto"]}
    c = Catalog()
    assert mirror([widened])["spec"]["agentAddress"] == AGENT_ADDRESS
    c.replace_nodes([mirror([widened])])  # the operator's record of the instance
    c.replace([widened, refused, managed])
    dep = c.resolve("events", CALLER)
    assert dep is not None and c.is_served(dep) and not dep.unservable()
    assert [i.instance_id for i in c.served[dep.key].serving] == ["i0"]
    dep = c.resolve("remote", CALLER)
    assert dep is not None and why in dep.unservable()  # 503 at once, naming the argument

    # The gateway does not read vLLM's schema: before the operator has judged, an argument
    # warmserve sets itself is held like any other deployment's request...
    assert "default/bad" not in c.invalid
    dep = c.resolve("bad", CALLER)
    assert dep is not None and c.is_served(dep) and dep.unservable() == ""
    # ... and once the operator wrote InvalidSpec, answered at once with its message.
    message = _refused_by_the_operator(managed)
    assert "--load-format: set by warmserve" in message
    managed["status"]["conditions"] = [
        {"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": message}
    ]
    c.upsert(managed)
    dep = c.resolve("bad", CALLER)
    assert dep is not None and message in dep.unservable()


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ("--enforce-eager", "spec.engine.args must be a list of strings"),
        ([7], "spec.engine.args must be a list of strings"),
        (["--seed", "1"] * (MAX_ENGINE_ARGS // 2) + ["--x"], f"at most {MAX_ENGINE_ARGS}"),
        (["x" * (MAX_ENGINE_ARG_CHARS + 1)], f"spec.engine.args[0] is {MAX_ENGINE_ARG_CHARS + 1}"),
    ],
)
def test_gateway_refuses_engine_args_outside_the_crd_schema(args: object, why: str) -> None:
    """What the CRD's schema bounds (a list of at most 64 strings of at most 1024 characters) the
    API parser checks for every reader: such a deployment is not served, with the field named."""
    body = md("odd", "odd", [])
    body["spec"]["engine"] = {"args": args}
    c = Catalog()
    c.replace([body])
    assert c.resolve("odd", CALLER) is None
    assert why in c.invalid["default/odd"]


def test_the_parsers_engine_bounds_are_the_crd_schemas() -> None:
    """The API parser checks what the schema states, so its bounds are the schema's."""
    doc = yaml.safe_load((REPO / "crds" / "warmserve.io_modeldeployments.yaml").read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    engine = spec["properties"]["engine"]["properties"]
    assert engine["args"]["maxItems"] == MAX_ENGINE_ARGS
    assert engine["args"]["items"]["maxLength"] == MAX_ENGINE_ARG_CHARS
    assert engine["name"]["enum"] == list(ENGINE_NAMES)
