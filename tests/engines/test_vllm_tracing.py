"""vLLM continues the gateway's trace (group ``vllm``: real vLLM on CPU).

The agent, started with ``--otlp-traces-endpoint`` (here ``engine_traces_endpoint``), starts
vLLM with ``--otlp-traces-endpoint`` and OTLP over HTTP; a request carrying a ``traceparent``
(what the gateway sends: its client span) yields vLLM's own request span in that trace, child
of that span, at the real collector.
"""

from __future__ import annotations

import json
import secrets
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = 64 * 1024
GPU = 48 * 1024**2


def test_vllm_continues_the_trace_of_the_traceparent_it_receives(tmp_path: Path) -> None:
    from warmserve_agent.config import AgentConfig
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient
    from warmserve.testing.otel import Collector, in_trace

    make_tiny_llama(tmp_path / "models" / "tiny", layers=4, hidden=128, seed=7)
    otel = Collector(tmp_path / "otelcol").start()
    try:
        cfg = AgentConfig(
            model_dir=tmp_path / "models",
            simulate_gpus=[GPU],
            listen="127.0.0.1:0",
            page_bytes=PAGE,
            memory_dir=tmp_path / "mem",
            spare_workers=0,
            memory_in_workers=True,
            engines=("vllm",),
            engine_traces_endpoint=otel.endpoint,
        )
        tid, sid = secrets.token_hex(16), secrets.token_hex(8)
        with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
            res = client.activate(
                "tiny", [0], engine="vllm", engine_args=["--enforce-eager", "--max-model-len", "64"]
            )
            req = urllib.request.Request(
                f"{res.instance.endpoint}/v1/completions",
                data=json.dumps(
                    {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
                ).encode(),
                headers={"Content-Type": "application/json", "traceparent": f"00-{tid}-{sid}-01"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
            spans = otel.wait_for(lambda got: bool(in_trace(got, tid)), "vLLM's span", 60)
    finally:
        otel.stop()
    (span,) = in_trace(spans, tid)
    assert span.parent == sid  # a child of the span that sent the request
    assert span.service == "warmserve-engine"
    assert span.kind == 2  # SERVER
