"""The official ``openai`` client (the version vLLM pins) against the real aiohttp gateway in front
of real simulated engines in a node agent: what the client depends on is answered as vLLM 0.32
answers it for a generative model (tests/e2e/test_real_engine_e2e.py checks the same calls
against real vLLM):

* ``n`` choices, whole and streamed (interleaved by ``index``), and vLLM's refusals of ``n``
  (below 1; above 1 under greedy sampling) as the client's ``BadRequestError``;
* ``/v1/responses`` (forwarded by default), whole and streamed as ``response.*`` events;
* ``/v1/embeddings`` (forwarded by default): a generative model has none, the engine answers
  vLLM's ``{"detail": "Not Found"}``, the gateway turns it into a 404 in OpenAI's shape that
  names the model and the route (``unsupported_route``), which the client raises as
  ``NotFoundError``;
* chat streaming with ``stream_options.include_usage``: the last chunk carries the usage.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.gw_support import Engines, md


@pytest.fixture(scope="module")
def tiny(engines: Engines) -> list[tuple[str, str]]:
    return [engines.start("tiny", 0)]


def _client(gw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.urls["api"] + "/v1", api_key="unused", max_retries=0)


async def test_n_choices_whole_and_streamed(make_gateway: Any, tiny: Any) -> None:
    gw, _ = await make_gateway([md("chat", "tiny", tiny)])
    async with _client(gw) as c:
        done = await c.completions.create(model="tiny", prompt="a b c", max_tokens=4, n=2)
        assert [ch.index for ch in done.choices] == [0, 1]
        assert all(len(ch.text.split()) == 4 for ch in done.choices)
        assert done.choices[0].text != done.choices[1].text, "two samples, not one copied"
        assert done.usage is not None and done.usage.completion_tokens == 8

        chat = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=3
        )
        assert [ch.index for ch in chat.choices] == [0, 1, 2]
        assert all(ch.message.content for ch in chat.choices)

        texts: dict[int, str] = {}
        finish: dict[int, str | None] = {}
        usage = None
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                assert chunk.choices == []
                usage = chunk.usage
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                finish[ch.index] = ch.finish_reason or finish.get(ch.index)
        assert sorted(texts) == [0, 1] and all(len(t.split()) == 3 for t in texts.values())
        assert finish == {0: "length", 1: "length"}
        assert usage is not None and usage.completion_tokens == 6

        # vLLM's refusals, in the client's exception types
        with pytest.raises(openai.BadRequestError, match="n must be at least 1, got 0"):
            await c.completions.create(model="tiny", prompt="x", max_tokens=2, n=0)
        with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy"):
            await c.completions.create(model="tiny", prompt="x", max_tokens=2, n=2, temperature=0)


async def test_responses_whole_and_streamed(make_gateway: Any, tiny: Any) -> None:
    gw, _ = await make_gateway([md("chat", "tiny", tiny)])
    async with _client(gw) as c:
        r = await c.responses.create(model="tiny", input="what is a slot", max_output_tokens=5)
        assert r.object == "response" and r.model == "tiny"
        assert len(r.output_text.split()) == 5
        assert r.usage is not None and r.usage.output_tokens == 5 and r.usage.input_tokens == 4
        r2 = await c.responses.create(
            model="tiny",
            input=[{"role": "user", "content": "what is a slot"}],
            max_output_tokens=5,
        )
        assert r2.output_text == r.output_text, "the same prompt, the same simulated words"

        kinds: list[str] = []
        deltas: list[str] = []
        final = None
        stream = await c.responses.create(
            model="tiny", input="what is a slot", max_output_tokens=5, stream=True
        )
        async for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type == "response.completed":
                final = ev.response
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "".join(deltas) == r.output_text
        assert final is not None and final.output_text == r.output_text

        with pytest.raises(openai.BadRequestError, match="input"):
            await c.responses.create(model="tiny", input=[], max_output_tokens=2)
    # the Responses API's usage (input_tokens, output_tokens) counts as tokens, not as an error
    async with aiohttp.ClientSession() as s, s.get(f"{gw.urls['admin']}/metrics") as r:
        text = await r.text()
    assert "warmserve_gateway_usage_errors_total{" not in text, text
    counted = {
        x.labels["type"]: x.value
        for fam in text_string_to_metric_families(text)
        for x in fam.samples
        if x.name == "warmserve_gateway_tokens_total" and x.labels.get("model") == "tiny"
    }
    assert counted == {"input": 8.0, "output": 10.0}, counted  # the two whole answers


async def test_embeddings_of_a_generative_model_are_a_clear_404(
    make_gateway: Any, tiny: Any
) -> None:
    gw, _ = await make_gateway([md("chat", "tiny", tiny)])
    async with _client(gw) as c:
        with pytest.raises(openai.NotFoundError) as err:
            await c.embeddings.create(model="tiny", input="hello")
    body = err.value.body
    assert isinstance(body, dict), body
    assert body["code"] == "unsupported_route" and body["param"] == "model"
    assert "'tiny' does not serve POST /v1/embeddings" in body["message"]
    # the engine itself answers as vLLM does for a generative model (no such route)
    async with (
        aiohttp.ClientSession() as s,
        s.post(tiny[0][1] + "/v1/embeddings", json={"model": "tiny", "input": "x"}) as r,
    ):
        assert r.status == 404 and await r.json() == {"detail": "Not Found"}
