"""The operator's side of the engine boundary, against in-memory agents (no Kubernetes, no gRPC):
spec.engine reaches Activate, a bad engine argument stops the deployment at admission, and
status reports TTFT against spec.ttftObjectiveSeconds."""

from __future__ import annotations

from dataclasses import replace

from tests.operator.test_reconciler import Harness


async def test_engine_name_and_args_reach_the_agent() -> None:
    h = Harness(nodes=1)
    h.kube.add_md(
        "a",
        "llama-a",
        minInstances=1,
        engine={"name": "vllm", "args": ["--max-model-len=256", "--enforce-eager"]},
    )
    await h.tick(4)
    agent = h.agents["node-0"]
    assert h.instances("llama-a"), "the minimum instance starts"
    ((engine, args),) = set(agent.engine_args.values())
    assert engine == "vllm" and args == ("--max-model-len=256", "--enforce-eager")


async def test_bad_engine_arg_is_refused_at_admission_naming_it() -> None:
    h = Harness(nodes=1)
    h.kube.add_md("a", "llama-a", minInstances=1, engine={"args": ["--max-modle-len", "256"]})
    await h.tick(4)
    cond = h.cond("a", "Degraded")
    assert cond["reason"] == "InvalidSpec" and "--max-modle-len" in cond["message"]
    assert h.cond("a", "Ready")["status"] == "False"
    assert not h.instances("llama-a"), "no instance ever starts with a refused argument"
    assert not [c for c in h.agents["node-0"].calls if c[0] == "activate"]


async def test_disallowed_engine_arg_is_refused_at_admission_and_reaches_no_agent() -> None:
    h = Harness(nodes=1)
    args = ["--max-model-len=256", "--trust-remote-code", "--tokenizer", "attacker/repo"]
    h.kube.add_md("a", "llama-a", minInstances=1, engine={"args": args})
    await h.tick(4)
    cond = h.cond("a", "Degraded")
    assert cond["reason"] == "InvalidSpec"
    assert "--trust-remote-code: not allowed for tenants" in cond["message"], cond
    assert h.cond("a", "Ready")["status"] == "False"
    warnings = [e for e in h.kube.events if e[1] == "Warning" and e[2] == "InvalidSpec"]
    assert warnings and "--trust-remote-code" in warnings[0][3]
    assert not h.instances("llama-a") and not h.slots("llama-a")
    assert not [c for c in h.agents["node-0"].calls if c[0] == "activate"]


async def test_admin_widening_lets_a_deployment_through() -> None:
    args = ["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://collector:5557"}']
    h = Harness(nodes=1)
    h.kube.add_md("a", "llama-a", minInstances=1, engine={"args": args})
    await h.tick(4)
    assert "--allow-engine-arg kv_events_config" in h.cond("a", "Degraded")["message"]
    assert not h.instances("llama-a")

    from warmserve.engine_args import EngineArgPolicy

    widened = EngineArgPolicy.from_admin(["kv_events_config"])
    h = Harness(nodes=1)
    h.cfg = replace(h.cfg, engine_policy=widened)
    h.rec = h.new_reconciler()
    h.agents["node-0"].engine_policy = widened  # the chart gives the agents the same list
    h.kube.add_md("a", "llama-a", minInstances=1, engine={"args": args})
    await h.tick(4)
    assert h.instances("llama-a"), "the widened argument is admitted and the instance starts"
    ((_, got),) = set(h.agents["node-0"].engine_args.values())
    assert got == tuple(args)


async def test_status_reports_ttft_against_the_objective() -> None:
    h = Harness(nodes=1)
    h.kube.add_md("a", "llama-a", minInstances=1, ttftObjectiveSeconds=0.5)
    await h.tick(4)
    assert h.cond("a", "TTFTObjectiveMet")["status"] == "Unknown"
    (inst,) = h.agents["node-0"].instances.values()
    inst.ttft = (0.2, 40)
    await h.tick(2)
    assert h.cond("a", "TTFTObjectiveMet")["status"] == "True"
    assert h.status("a")["ttft"]["observedP95Seconds"] == 0.2
    inst.ttft = (0.9, 41)
    await h.tick(2)
    cond = h.cond("a", "TTFTObjectiveMet")
    assert cond["status"] == "False" and cond["reason"] == "ObjectiveMissed"
    assert h.status("a")["ttft"] == {
        "objectiveSeconds": 0.5,
        "source": "engines",
        "observedP95Seconds": 0.9,
        "samples": 41,
        "windowSeconds": 300.0,
    }
    assert any(e[2] == "TTFTObjectiveMissed" for e in h.kube.events)
