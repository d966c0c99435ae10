"""The agent measures each model's prewarm-depth profile and reports it in ``Describe``
(``ModelInfo.profile``): the loader's load rate, a timed forward on a new instance, the
prewarm-hit activation as the streamed layers' head start."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import cfg_for, wait_for, write_model
from warmserve_agent.model_profile import PROBE_PROMPT_TOKENS, ModelProfiles
from warmserve_agent.testing import AgentThread

from warmserve.api.agent.client import SyncAgentClient

PREFILL_TOK_S = 1000.0  # the simulated engine's prefill pace: what the timed forward measures


def test_describe_reports_what_the_agent_measured(tmp_path: Path, model_root: Path) -> None:
    write_model(model_root, "paced", layers=4, profile={"prefill_tok_s": PREFILL_TOK_S})
    with AgentThread(cfg_for(tmp_path, model_root)) as a:
        c = SyncAgentClient(a.address)
        try:
            paced = next(m for m in c.describe().models if m.name == "paced")
            assert not paced.HasField("profile")  # nothing measured yet

            last = c.prewarm_wait("paced", [0], 2, request_id="pw")
            p = next(m for m in c.describe().models if m.name == "paced").profile
            # the loader's own timing: the slot's bytes over its load seconds
            assert p.load_bytes_per_second > 0
            assert p.load_bytes_per_second == pytest.approx(last.bandwidth_bytes_per_s, rel=1e-6)
            assert p.layer_compute_seconds == 0 and p.compute_tp == 0  # no engine ran yet

            act = c.activate("paced", [0], request_id="act")
            assert act.prewarm_hit

            def timed():
                m = next(m for m in c.describe().models if m.name == "paced")
                return m.profile if m.profile.compute_tp else None

            p = wait_for(timed, what="a timed forward")
            assert p.head_start_seconds == pytest.approx(act.activation_seconds, rel=1e-6)
            assert (p.prompt_tokens, p.compute_tp) == (PROBE_PROMPT_TOKENS[0], 1)
            # the engine paces a prefill at PREFILL_TOK_S: the forward of the prompt beyond one
            # token, per layer (the probe's HTTP and scheduling costs cancel out)
            paced_s = (PROBE_PROMPT_TOKENS[0] - 1) / PREFILL_TOK_S / 4
            assert 0.8 * paced_s <= p.layer_compute_seconds <= 4 * paced_s, p
            assert p.engine_overhead_bytes == 0  # no prepared engine reports one here
        finally:
            c.close()


def test_profiles_keep_the_cautious_reading_and_ignore_nonsense() -> None:
    ps = ModelProfiles()
    assert ps.pb("m") is None and ps.wants_forward("m")
    for bad in (math.nan, math.inf, -1.0):
        ps.record_load("m", 10, bad)
        ps.record_forward("m", 1, 128, bad)
        ps.record_activation("m", bad)
    ps.record_load("m", 10, 0.0)  # no time: no rate
    ps.record_activation("m", 0.0)
    ps.record_load("m", -5, 1.0)
    ps.record_forward("m", 0, 128, 0.1)
    ps.record_engine_overhead("m", -1)
    assert ps.pb("m") is None
    assert ps.wants_forward("m")

    ps.record_load("m", 100, 1.0)
    ps.record_load("m", 300, 1.0)
    ps.record_forward("m", 1, 128, 0.02)
    ps.record_forward("m", 1, 128, 0.03)  # a busier engine: slower, not kept
    ps.record_forward("m", 2, 128, 0.009)  # 0.018 GPU-seconds per layer: faster, kept
    ps.record_activation("m", 0.5)
    ps.record_forward("m", 4, 8, 0.0)  # below a request's resolution: the fastest there is
    assert ps.pb("m").layer_compute_seconds == 0.0 and ps.pb("m").compute_tp == 4
    ps.record_forward("m", 1, 128, 0.009)  # not faster than 0: not kept
    ps.record_activation("m", 0.7)
    ps.record_engine_overhead("m", 5)
    ps.record_engine_overhead("m", 3)
    p = ps.pb("m")
    assert p is not None and not ps.wants_forward("m")
    assert p.load_bytes_per_second == 200.0
    assert (p.layer_compute_seconds, p.compute_tp, p.prompt_tokens) == (0.0, 4, 8)
    assert p.head_start_seconds == 0.5 and p.engine_overhead_bytes == 5
