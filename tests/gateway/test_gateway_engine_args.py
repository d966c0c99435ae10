"""The gateway reads ModelDeployments with the operator's parser but without the engine-argument
allowlist: the operator's admission decides (with the admin's widening, which the gateway is not
told), and the gateway answers a refused deployment at once with the operator's message."""

from __future__ import annotations

from gw_support import md
from warmserve_gateway.catalog import Catalog


def test_gateway_routes_by_the_operators_admission_of_engine_args() -> None:
    widened = md("traced", "traced", [("i0", "http://e0")])  # the admin allowed the endpoint
    widened["spec"]["engine"] = {"args": ["--otlp-traces-endpoint", "http://collector:4317"]}
    refused = md("remote", "remote", [], ready_reason="InvalidSpec")
    refused["spec"]["engine"] = {"args": ["--trust-remote-code"]}
    why = "spec.engine.args: --trust-remote-code: not allowed for tenants: it can run code"
    refused["status"]["conditions"][0]["message"] = why
    managed = md("bad", "bad", [])
    managed["spec"]["engine"] = {"args": ["--load-format", "auto"]}
    c = Catalog()
    c.replace([widened, refused, managed])
    dep = c.lookup("traced")
    assert dep is not None and dep.serving and not dep.unservable()
    dep = c.lookup("remote")
    assert dep is not None and why in dep.unservable()  # 503 at once, naming the argument
    assert "--load-format: set by warmserve" in c.invalid["default/bad"]
