"""Real tokens through the whole stack (group ``vllm``: hack/test.sh runs it with the python of
hack/vllm/setup.sh): the official ``openai`` client → the gateway → an instance the operator
started on a node agent → real vLLM (CPU) over a prewarmed slot, on a real kube-apiserver.

The stack is wired as the chart wires it (``warmserve.testing.stack.Stack``: CRDs, the chart's
operator and gateway ServiceAccounts and RBAC rendered by helm, their tokens for the processes,
the demand Service's EndpointSlices); one agent process with one simulated 1 GiB GPU hosts the
``vllm`` engine. Two ModelDeployments with ``engine: vllm``: SmolLM2-135M-Instruct (``smollm2``,
the real model of warmserve.realmodel) and a second copy of it under another name
(``smollm2-b``: the only other real model small enough for this machine would double the
download). One control plane, one agent and one gateway serve every step:

1. both are prewarmed into slots of the **same** GPU (a universal worker holding two real
   models), no instance yet;
2. the first chat request to A at zero instances is held at the gateway, A starts on its
   prewarmed slot (``PrewarmHit`` Event) and answers with exactly the tokens plain vLLM gives
   for the same weights and greedy sampling (computed meanwhile in a process of its own);
3. the official client through the gateway on A: streaming with
   ``stream_options.include_usage``, completions with ``n=2``, ``/v1/responses``,
   ``/v1/embeddings`` (a clear 404 ``unsupported_route``: vLLM has no such route for a
   generative model), errors in OpenAI's shape (unknown model, vLLM's own 400s);
4. the load moves to B: A drains through its grace period, lending KV pages (the agent's
   ``lendable``/``lent`` bytes), ends, B starts on the same GPU and answers the same tokens;
   A's slot is evicted or kept as the policy decides; ``kubectl get wsmd`` and
   ``warmserve status`` show it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.real_engine_support import (
    MAX_TOKENS,
    QUESTION,
    AgentRecorder,
    Reference,
    status_of,
    store_models,
    vllm_deployment,
)
from warmserve.testing.procs import Procs, wait_for
from warmserve.testing.stack import Stack, demand_of, metric, seed_history

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

A, B = "smollm2", "smollm2-b"
SETTLE_S = 120.0  # the operator's moves (prewarm, plan) on a loaded 2-core machine
START_S = 420.0  # a vLLM engine built over a slot on this CPU, under load


@pytest.fixture
def stack(k8s_control_plane: Any, k8s_namespace: str, tmp_path: Path, procs: Procs) -> Stack:
    return Stack(k8s_control_plane, k8s_namespace, tmp_path, procs)


def _events(st: Stack, name: str) -> list[str]:
    doc = st.get("events", "--field-selector", f"involvedObject.name={name}")
    return [e.get("reason", "") for e in doc["items"]]


def _ask(client: openai.OpenAI, model: str) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )


class Held:
    """One chat request in a thread (it waits at the gateway until an instance serves)."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.answer: Any = None
        self.error: BaseException | None = None
        self.t0 = time.monotonic()
        self.seconds = 0.0
        self._t = threading.Thread(target=self._run, args=(client, model), daemon=True)
        self._t.start()

    def _run(self, client: openai.OpenAI, model: str) -> None:
        try:
            self.answer = _ask(client, model)
        except BaseException as exc:  # reported by result()
            self.error = exc
        self.seconds = time.monotonic() - self.t0

    def result(self, timeout: float) -> Any:
        self._t.join(timeout)
        assert not self._t.is_alive(), f"no answer within {timeout:.0f}s"
        if self.error is not None:
            raise self.error
        return self.answer


class Steady:
    """Requests to one model one after another until stopped: load that keeps its instance
    serving (the operator drains an idle one after --scale-down-delay) while the test looks."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.answered = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(client, model), daemon=True)
        self._t.start()

    def _run(self, client: openai.OpenAI, model: str) -> None:
        while not self._stop.is_set():
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            self.answered += 1

    def stop(self) -> None:
        self._stop.set()
        self._t.join(120)


def _check_tokens(answer: Any, ref: dict[str, Any], model: str) -> None:
    choice = answer.choices[0]
    assert answer.model == model
    assert answer.prompt_token_ids == ref["prompt"], "the chat template gave other tokens"
    assert choice.token_ids == ref["tokens"], (choice.message.content, ref["text"])
    assert choice.finish_reason == ref["finish"] == "stop"
    assert choice.message.content == ref["text"] and "Paris" in ref["text"]


def test_real_tokens_through_gateway_operator_agent_and_vllm(
    stack: Stack, smollm2_dir: Path, tmp_path: Path
) -> None:
    st, ns = stack, stack.ns
    t_start = time.monotonic()
    times: dict[str, float] = {}
    ref = Reference(smollm2_dir, tmp_path / "reference.log")  # computes while the stack starts
    rec: AgentRecorder | None = None
    try:
        st.install()
        models = store_models(smollm2_dir, tmp_path / "models", (A, B))
        st.start_agents(models, {"node-a": "1x1GiB"}, extra=("--engines", "simulated,vllm"))
        ((node, address),) = st.agents.items()
        rec = AgentRecorder(address, (A, B))
        mds = [vllm_deployment(ns, A), vllm_deployment(ns, B)]
        items = {"apiVersion": "v1", "kind": "List", "items": mds}
        st.kubectl("apply", "-f", "-", input=json.dumps(items))
        for name in (A, B):  # one basic prewarmed replica each
            seed_history(st.kubectl, ns, name, name, avg=1.0, peak=1.0)
        st.start_operator(
            "operator", 100, poll_s=1.0, extra=("--scale-down-delay", "3", "--max-grace", "10")
        )
        gw = st.start_gateway("gw-a")
        client = openai.OpenAI(
            base_url=gw.api + "/v1", api_key="unused", max_retries=0, timeout=START_S + 60
        )
        times["stack_s"] = time.monotonic() - t_start

        # 1. Both real models prewarmed into slots of the one GPU, no instance.
        def both_prewarmed() -> bool:
            for name in (A, B):
                reps = status_of(st, name).get("prewarmedReplicas") or []
                if not reps or any(r["state"] != "ready" for r in reps):
                    return False
            return rec is not None and rec.seen.together

        wait_for(both_prewarmed, "A and B prewarmed on GPU 0", SETTLE_S, st.logs)
        assert rec.seen.gpu_states[-1] == "universal"
        times["prewarmed_s"] = time.monotonic() - t_start

        # 2. The first request to A at zero instances: held, a prewarm hit, plain vLLM's tokens.
        assert status_of(st, A).get("instanceCount", 0) == 0
        first = Held(client, A)
        wait_for(
            lambda: (
                demand_of(gw.admin, st.demand_token)["models"].get(A, {}).get("held", 0) >= 1
                or first.answer is not None
            ),
            "the first request to A held at the gateway",
            30,
            st.logs,
        )
        answer = first.result(START_S)
        times["first_answer_s"] = first.seconds
        # it waited at the gateway for the instance (the gateway's own record: dispatched
        # after a hold, not at arrival)
        waited = metric(gw.admin, "warmserve_gateway_queue_wait_seconds_sum", model=A)
        assert waited > 0.5, waited
        times["first_held_s"] = waited
        reference = ref.result()
        _check_tokens(answer, reference, A)
        wait_for(lambda: "PrewarmHit" in _events(st, A), "A's PrewarmHit Event", SETTLE_S, st.logs)
        assert "ColdStart" not in _events(st, A)
        (a_inst,) = [i for i in rec.seen.instances.values() if i["model"] == A]
        assert a_inst["prewarm_hit"] and a_inst["engine"] == "vllm" and a_inst["gpus"] == [0]

        # 3. The official client on A through the gateway.
        _openai_surface(client)

        # 4. The load moves to B: A drains through grace (lending KV pages) and ends; B starts on
        #    the same GPU.
        t_move = time.monotonic()
        to_b = Held(client, B)
        steady = Steady(client, B)  # and more, until the checks below are done
        answer_b = to_b.result(START_S + SETTLE_S)
        times["move_to_b_s"] = time.monotonic() - t_move
        _check_tokens(answer_b, reference, B)
        wait_for(
            lambda: (
                status_of(st, A).get("instanceCount", 0) == 0
                and status_of(st, B).get("instanceCount") == 1
            ),
            "A at 0 instances, B at 1 in status",
            SETTLE_S,
            st.logs,
        )
        assert rec.seen.grace_lent.get(A, 0) > 0, f"A lent no KV in grace: {rec.seen}"
        assert {"Draining", "InstanceEnded"} <= set(_events(st, A)), _events(st, A)
        b_events = set(_events(st, B))
        assert b_events & {"PrewarmHit", "ColdStart"}, b_events
        (b_inst,) = [i for i in rec.seen.instances.values() if i["model"] == B]
        assert b_inst["gpus"] == [0] and b_inst["engine"] == "vllm"
        assert "grace" in rec.seen.gpu_states, rec.seen.gpu_states

        # ... and kubectl and warmserve status show it.
        table = st.kubectl("get", "wsmd", "-n", ns).stdout
        rows = {ln.split()[0]: ln.split() for ln in table.splitlines()[1:]}
        assert rows[A][3] == "0" and rows[B][3] == "1", table  # the Instances column
        admin_env = {**st.env, "KUBECONFIG": str(st.plane.kubeconfig)}
        view = json.loads(
            subprocess.run(
                [sys.executable, "-m", "warmserve", "status", "-n", ns, "--json"],
                capture_output=True, text=True, env=admin_env, check=True, timeout=60,
            ).stdout
        )  # fmt: skip
        by_name = {m["name"]: m for m in view["models"]}
        assert [i["node"] for i in by_name[f"{ns}/{B}"]["instances"]] == [node], by_name
        assert by_name[f"{ns}/{A}"]["instances"] == [], by_name
        text = subprocess.run(
            [sys.executable, "-m", "warmserve", "status", "-n", ns],
            capture_output=True, text=True, env=admin_env, check=True, timeout=60,
        ).stdout  # fmt: skip
        a_kept = any(
            r["model"] == A for n in view["nodes"] for g in n["gpus"] for r in g["resident"]
        )
        assert (A in text) and (B in text), text
        steady.stop()
        assert steady.answered > 0
        times["total_s"] = time.monotonic() - t_start
        print(table)
        print(text)
        print(
            "real-engine e2e:",
            json.dumps(
                {
                    **{k: round(v, 1) for k, v in times.items()},
                    "b_start": sorted(b_events & {"PrewarmHit", "ColdStart"}),
                    "a_lent_bytes": rec.seen.grace_lent.get(A, 0),
                    "gpu0_states": rec.seen.gpu_states,
                    "a_slot_kept": a_kept,
                }
            ),
        )
    finally:
        if rec is not None:
            rec.stop()
        ref.stop()
        st.kubectl("delete", "gpunode", *st.agents, "--ignore-not-found", "--wait=false",
                   check=False)  # fmt: skip


def _openai_surface(client: openai.OpenAI) -> None:
    """What the official client does against the gateway, on the serving instance of A."""
    # streaming chat with the usage chunk the client asked for
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        model=A,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        pieces += [c.delta.content or "" for c in chunk.choices]
    assert "Paris" in "".join(pieces)
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 10

    # completions with n=2 (sampling: vLLM refuses n > 1 under greedy)
    two = client.completions.create(
        model=A, prompt="The capital of France is", max_tokens=6, n=2, temperature=0.8, seed=1
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage is not None and two.usage.completion_tokens <= 12
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy"):
        client.completions.create(model=A, prompt="x", max_tokens=2, n=2, temperature=0)

    # the Responses API
    r = client.responses.create(model=A, input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.object == "response" and "Paris" in r.output_text

    # embeddings: a generative model has none; a clear 404 in OpenAI's shape
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model=A, input="hello")
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "unsupported_route"

    # errors in OpenAI's shape: an unknown model (the gateway), a bad request (vLLM's own)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=A, messages=[{"role": "user", "content": "hi"}], max_tokens=4096
        )
    assert isinstance(err.value.body, dict) and err.value.body["message"]
