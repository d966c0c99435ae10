"""Nothing in flight holds ``EndInstance`` (stand-in agent: gRPC, the simulated engine).

The agent's background forward probe (``model_profile.time_forward``) on the stand-in agent
(gRPC, the simulated engine): a probe measures an idle serving instance or nothing.  When the
instance begins grace (its free KV may be lent to a neighbour's prewarm, Eq. 1) or ends, the
probe is cancelled and its HTTP request given up, so the engine is idle again at once and
``EndInstance`` is not held by the probe's request.  A client's request in flight does not
hold it either: the engine aborts it (answered with ``finish_reason`` ``abort``, as vLLM)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from warmserve_agent.testing import AgentThread, write_model

from tests.agent.agent_support import cfg_for, wait_for
from warmserve.api.agent.client import SyncAgentClient

# a 128-token probe prompt takes 12.8 s to prefill here: the probe is in flight for ~40 s
PREFILL_TOK_S = 10.0


def _load(c: SyncAgentClient) -> tuple[int, int]:
    (i,) = c.describe().instances
    return i.running, i.waiting


def test_grace_cancels_the_probe_and_end_instance_is_not_held_by_it(
    tmp_path: Path, model_root: Path
) -> None:
    write_model(model_root, "paced", layers=4, profile={"prefill_tok_s": PREFILL_TOK_S})
    with AgentThread(cfg_for(tmp_path, model_root)) as a, SyncAgentClient(a.address) as c:
        act = c.activate("paced", [0], request_id="act")
        iid = act.instance.instance_id
        wait_for(lambda: _load(c)[0] >= 1, what="the probe's request in the engine")
        time.sleep(1.0)  # past its one-token requests: the long prompt prefills now
        assert _load(c) == (1, 0)

        c.begin_grace(iid)
        # the probe gave its request up: the engine is idle before anything is lent
        wait_for(lambda: _load(c) == (0, 0), timeout=3.0, what="the probe's request given up")
        # a replayed Activate answers the first outcome and starts no probe on a grace instance
        assert c.activate("paced", [0], request_id="act").instance.instance_id == iid
        time.sleep(0.5)
        assert _load(c) == (0, 0)

        t0 = time.monotonic()
        c.end_instance(iid)
        took = time.monotonic() - t0
        assert took < 3.0, f"EndInstance took {took:.1f} s"
        assert not a.server.service.instances._probes, "no probe left running"
        (m,) = [m for m in c.describe().models if m.name == "paced"]
        assert m.profile.compute_tp == 0, "a cut-short probe records nothing"


def test_a_request_in_flight_does_not_hold_end_instance(tmp_path: Path, model_root: Path) -> None:
    # 1 token a second: the request would take a minute
    write_model(model_root, "slow", layers=2, profile={"decode_tok_s": 1.0})
    with AgentThread(cfg_for(tmp_path, model_root)) as a, SyncAgentClient(a.address) as c:
        act = c.activate("slow", [0])
        iid = act.instance.instance_id
        # the probe is done first (its requests decode one token): only the client's is left
        wait_for(lambda: not a.server.service.instances._probes, what="the probe's end")
        answer: list[dict] = []

        def ask() -> None:
            body = json.dumps({"prompt": "hello", "max_tokens": 60}).encode()
            req = urllib.request.Request(
                f"{act.instance.endpoint}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                answer.append(json.loads(r.read()))

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        wait_for(lambda: _load(c) == (1, 0), what="the request decoding")
        c.begin_grace(iid)
        t0 = time.monotonic()
        c.end_instance(iid)
        took = time.monotonic() - t0
        client.join(10)
        assert took < 3.0, f"EndInstance took {took:.1f} s"
        assert answer and answer[0]["choices"][0]["finish_reason"] == "abort", answer
