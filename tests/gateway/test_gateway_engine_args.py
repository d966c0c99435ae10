"""The gateway reads ModelDeployments with the operator's parser but without the engine-argument
allowlist: the operator's admission decides (with the admin's widening, which the gateway is not
told), and the gateway answers a refused deployment at once with the operator's message."""

from __future__ import annotations

from gw_support import AGENT_ADDRESS, NODE, md, mirror
from warmserve_gateway.catalog import Catalog

CALLER = frozenset({"default"})


def test_gateway_routes_by_the_operators_admission_of_engine_args() -> None:
    # the admin allowed the endpoint; the instance's engine listens on the agent's host
    widened = md("events", "events", [("i0", "http://127.0.0.1:8001")], node=NODE)
    kv_events = '{"publisher": "zmq", "endpoint": "tcp://collector:5557"}'
    widened["spec"]["engine"] = {"args": ["--kv-events-config", kv_events]}
    refused = md("remote", "remote", [], ready_reason="InvalidSpec")
    refused["spec"]["engine"] = {"args": ["--trust-remote-code"]}
    why = "spec.engine.args: --trust-remote-code: not allowed for tenants: it can run code"
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
    assert "--load-format: set by warmserve" in c.invalid["default/bad"]
