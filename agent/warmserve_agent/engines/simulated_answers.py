"""What the simulated engine answers on the routes beyond plain completions, shaped as vLLM 0.32
answers them for a generative model (the official ``openai`` client parses these):

* ``n`` choices (``/v1/completions``, ``/v1/chat/completions``): vLLM's checks (an integer
  >= 1; more than one needs sampling, not greedy ``temperature: 0``), one choice per index,
  streamed interleaved by ``index``;
* ``/v1/responses``: the Responses API (a string or a list of messages in, a ``response`` out;
  streamed as vLLM's ``response.*`` events);
* ``/v1/embeddings``: a generative model has none, and vLLM then has no such route: 404
  ``{"detail": "Not Found"}`` (FastAPI's own answer, not OpenAI's error shape; the gateway
  turns it into one, docs/gateway.md).

Pure functions of the request and the generated words; the serving side
(:mod:`.simulated_openai`) paces and admits.
"""

from __future__ import annotations

import uuid
from typing import Any

# vLLM's answer for a route the model's tasks do not register (FastAPI's 404).
NOT_FOUND_BODY = {"detail": "Not Found"}
# Largest n accepted; vLLM bounds it only by the KV cache, which the engine checks as well.
MAX_N = 128
DEFAULT_MAX_OUTPUT_TOKENS = 16


class BadRequest(ValueError):
    """A request vLLM refuses with 400; the message is vLLM's."""


def choices_n(body: dict[str, Any]) -> int:
    """``n`` as vLLM validates it (``SamplingParams``): an integer >= 1, 1 under greedy."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise BadRequest("n: Input should be a valid integer")
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise BadRequest(f"n must be at most {MAX_N}, got {n}.")
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, int | float) and temperature < 1e-5:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.")
    return n


# ---- the Responses API ----------------------------------------------------------------------


def responses_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """(prompt text, max_output_tokens) of a ``/v1/responses`` request."""
    inp = body.get("input")
    if isinstance(inp, str):
        texts = [inp]
    elif isinstance(inp, list) and inp:
        texts = []
        for item in inp:
            if not isinstance(item, dict):
                raise BadRequest("input: each item must be an object")
            content = item.get("content", "")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [str(p.get("text", "")) for p in content if isinstance(p, dict)]
            else:
                raise BadRequest("input: content must be a string or a list of parts")
    else:
        raise BadRequest("input: Input should be a valid string or a non-empty list")
    mt = body.get("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS)
    if mt is None:
        mt = DEFAULT_MAX_OUTPUT_TOKENS
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= 4096:
        raise BadRequest("max_output_tokens must be an integer in [1, 4096]")
    if bool(body.get("stream")) and body.get("stream_options") is not None:
        raise BadRequest("stream_options is not supported on /v1/responses")
    return " ".join(texts), mt


class ResponseAnswer:
    """One ``/v1/responses`` answer: the object and, when streamed, its events in order."""

    def __init__(self, model: str, body: dict[str, Any], created: int) -> None:
        self.id = f"resp_{uuid.uuid4().hex[:16]}"
        self.item_id = f"msg_{uuid.uuid4().hex[:16]}"
        self.model = model
        self.created = created
        self.max_output_tokens = body.get("max_output_tokens") or DEFAULT_MAX_OUTPUT_TOKENS
        self.temperature = body.get("temperature", 1.0)
        self.seq = 0

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
        return {
            "id": self.item_id,
            "content": content if status == "completed" else [],
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def response(
        self, text: str | None, prompt_tokens: int, output_tokens: int, done: bool
    ) -> dict[str, Any]:
        # The simulated engine never stops early: every answer ends at max_output_tokens.
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if done else None,
            "instructions": None,
            "metadata": None,
            "model": self.model,
            "object": "response",
            "output": [self._message(text, "completed")] if done and text is not None else [],
            "parallel_tool_calls": True,
            "temperature": self.temperature,
            "tool_choice": "none",
            "tools": [],
            "top_p": 1.0,
            "max_output_tokens": self.max_output_tokens,
            "status": "incomplete" if done else "in_progress",
            "usage": usage if done else None,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        import json

        data = {**fields, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def opening(self, prompt_tokens: int) -> list[bytes]:
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        ids = {"item_id": self.item_id, "output_index": 0}
        return [
            self.event("response.created", response=self.response(None, prompt_tokens, 0, False)),
            self.event(
                "response.in_progress", response=self.response(None, prompt_tokens, 0, False)
            ),
            self.event(
                "response.output_item.added",
                item=self._message("", "in_progress"),
                output_index=0,
            ),
            self.event("response.content_part.added", content_index=0, part=part, **ids),
        ]

    def delta(self, piece: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            content_index=0,
            delta=piece,
            item_id=self.item_id,
            logprobs=[],
            output_index=0,
        )

    def closing(self, text: str, prompt_tokens: int, output_tokens: int) -> list[bytes]:
        ids = {"item_id": self.item_id, "output_index": 0}
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        return [
            self.event("response.output_text.done", content_index=0, logprobs=[], text=text, **ids),
            self.event("response.content_part.done", content_index=0, part=part, **ids),
            self.event(
                "response.output_item.done", item=self._message(text, "completed"), output_index=0
            ),
            self.event(
                "response.completed",
                response=self.response(text, prompt_tokens, output_tokens, True),
            ),
        ]
