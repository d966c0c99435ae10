"""Replaying the plan through the gateway with real HTTP requests.

Each request is an OpenAI streaming chat completion sent at its planned wall-clock time to a
gateway replica (round robin, as a Service spreads connections), with a prompt of the trace's
input length (the simulated engine counts words as tokens) and ``max_tokens`` = the trace's
output length.  Measured per request: time to the first streamed token (TTFT, as the client sees
it through the gateway), total latency, the HTTP status and the gateway's error ``code``.

Outcomes (what the CI test asserts on):

* ``ok`` — 200 and the stream ended with ``[DONE]``;
* ``capped`` — the gateway refused at a cap it documents: 429 ``queue_full`` (the model's
  ``maxQueue`` or the replica's ``--max-held``) or 503 ``hold_timeout`` after at least
  ``maxHoldSeconds``;
* ``dropped`` — anything else: a connection error, another status, a broken stream, or a 503
  ``hold_timeout`` before the hold time was up.  A healthy stack drops nothing;
* ``cancelled`` — still open when the replay was stopped (Ctrl-C, or the end of ``--minutes``
  plus the drain time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .workload import ReplayPlan

OK, CAPPED, DROPPED, CANCELLED = "ok", "capped", "dropped", "cancelled"


@dataclass
class Result:
    index: int
    model: str
    planned_s: float  # arrival in the plan (wall seconds from the measured start; < 0: warm-up)
    sent_s: float  # when it was sent, same clock
    replica: int
    status: int = 0  # HTTP status, 0 = no answer
    code: str = ""  # the gateway's error code, or the exception's name
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0
    outcome: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def classify(r: Result, max_hold_s: float) -> str:
    if r.status == 200 and r.code == "done":
        return OK
    if r.status == 429 and r.code == "queue_full":
        return CAPPED
    if r.status == 503 and r.code == "hold_timeout" and (r.latency_s or 0) >= max_hold_s - 0.5:
        return CAPPED
    return DROPPED


class Replayer:
    """Sends the plan's requests; ``results`` fills in as answers finish."""

    def __init__(
        self,
        plan: ReplayPlan,
        endpoints: Sequence[str],
        max_hold_s: float,
        *,
        on_result: Callable[[Result], None] | None = None,
    ) -> None:
        self.plan = plan
        self.endpoints = list(endpoints)
        self.max_hold_s = max_hold_s
        self.on_result = on_result
        self.results: list[Result] = []
        self.sent = 0
        self.inflight = 0
        self.t0 = 0.0  # monotonic time of the measured start (plan time 0)

    def now(self) -> float:
        """Seconds since the measured start (negative during the warm-up)."""
        return time.monotonic() - self.t0

    async def run(self, t0_monotonic: float, stop: asyncio.Event, drain_s: float) -> None:
        """Send every request at its time (until ``stop``), then wait up to ``drain_s`` for the
        answers still open; cancel what remains."""
        import aiohttp

        self.t0 = t0_monotonic
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.max_hold_s + 60)
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            p = self.plan
            for i in range(len(p)):
                at = float(p.arrival[i])
                delay = at - self.now()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
                t = asyncio.create_task(self._one(session, i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            deadline = time.monotonic() + drain_s
            while tasks and not stop.is_set() and time.monotonic() < deadline:
                await asyncio.wait(list(tasks), timeout=0.5)
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, session: Any, i: int) -> None:
        p = self.plan
        replica = self.sent % len(self.endpoints)
        self.sent += 1
        model = p.models[int(p.model[i])]
        r = Result(i, model, float(p.arrival[i]), self.now(), replica)
        n_in = max(1, int(p.input_tokens[i]))
        body = {
            "model": model,
            "messages": [{"role": "user", "content": " ".join(["w"] * n_in)}],
            "max_tokens": int(min(max(1, int(p.output_tokens[i])), 4096)),
            "stream": True,
        }
        t_send = time.monotonic()
        self.inflight += 1
        try:
            async with session.post(
                self.endpoints[replica] + "/v1/chat/completions",
                data=json.dumps(body),
                headers={"Content-Type": "application/json"},
            ) as resp:
                r.status = resp.status
                if resp.status != 200:
                    raw = await resp.read()
                    try:
                        r.code = str(json.loads(raw)["error"].get("code") or "")
                    except (ValueError, KeyError, TypeError, AttributeError):
                        r.code = "non_json_error"
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        if r.ttft_s is None:
                            r.ttft_s = time.monotonic() - t_send
                        if line.strip() == b"data: [DONE]":
                            r.code = "done"
                        else:
                            r.tokens += 1
                    if r.code != "done":
                        r.code = "incomplete_stream"
        except asyncio.CancelledError:
            r.outcome = CANCELLED
            raise
        except Exception as exc:  # connection refused/reset, timeouts: a dropped request
            r.code = type(exc).__name__
        finally:
            self.inflight -= 1
            r.latency_s = time.monotonic() - t_send
            if not r.outcome:
                r.outcome = classify(r, self.max_hold_s)
            self.results.append(r)
            if self.on_result is not None:
                self.on_result(r)
