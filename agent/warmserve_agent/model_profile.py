"""What this agent measured about each model: the prewarm-depth profile (WarmServe §4, "profiled
offline") and what a prepared engine costs, reported in ``Describe`` (``ModelInfo.profile``).

The operator resolves ``spec.prewarm.layers: auto`` from these numbers with the policy's depth
rule (:mod:`warmserve.policy.prewarm_depth`): per-layer load time (a layer's shard over the
rate measured here), per-layer forward compute, and the activation's head start.  Sources:

* **load**: the loader's own timing of whole layers (``record_load``, called after each run of
  the slot loader): bytes per GPU over seconds, summed over every load of the model;
* **compute**: a timed forward on a serving engine (``record_forward``).  :func:`time_forward`
  sends two one-token completions straight to a new instance's endpoint, a prompt of
  :data:`PROBE_PROMPT_TOKENS` tokens (the first size the engine takes) and one of a single
  token, each the fastest of :data:`PROBE_REPEATS`; their difference is the forward of the
  prompt without the fixed costs of a request (HTTP, scheduling, the first token's sampling),
  divided by the layers (0 when it is below what a request's timing resolves: a forward too
  short to matter).  The fastest measurement is kept (load from serving traffic only adds).
  The probe measures an idle serving instance or nothing: the agent cancels it when the
  instance begins grace or ends (its request is given up, so it never waits for KV blocks that
  grace lent away);
* **head start**: the fastest prewarm-hit activation (``record_activation``): the rest of a
  partially resident model streams in while the instance activates;
* **engine overhead**: bytes per GPU a prepared engine occupies beside the weights
  (``record_engine_overhead``; the largest report is kept).  Nothing reports it yet: an engine
  prepared here holds host memory (``PreparedReport.host_bytes``, shown in Describe), not GPU
  pages; a prepared engine's device memory on a GPU is what the GPU kit is to measure and report
  here, so until then it is 0 and placement charges nothing for it.

Every value is 0 until measured; the operator falls back to all layers without a load rate and a
timed forward.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from warmserve.api.agent.v1 import agent_pb2 as pb

log = logging.getLogger("warmserve.agent")

# the representative prompt of a timed forward, then shorter ones for an engine whose context
# is shorter (an engine refuses a prompt beyond its --max-model-len)
PROBE_PROMPT_TOKENS = (128, 32, 8)
PROBE_TOKEN_ID = 100  # any id inside every vocabulary; the content does not matter
PROBE_TIMEOUT_S = 60.0
PROBE_REPEATS = 3  # each prompt is timed this often; the fastest counts (noise only adds)


@dataclass
class _Measured:
    load_bytes: int = 0
    load_s: float = 0.0
    layer_compute_s: float = 0.0
    prompt_tokens: int = 0
    compute_tp: int = 0
    head_start_s: float = 0.0
    engine_overhead_bytes: int = 0


def _ok(x: float) -> bool:
    return math.isfinite(x) and x > 0


class ModelProfiles:
    """Per model, the measurements above (thread-safe: the loaders and the servicer record)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: dict[str, _Measured] = {}

    def _rec(self, model: str) -> _Measured:
        return self._by_model.setdefault(model, _Measured())

    def record_load(self, model: str, bytes_per_gpu: int, seconds: float) -> None:
        if bytes_per_gpu <= 0 or not _ok(seconds):
            return
        with self._lock:
            r = self._rec(model)
            r.load_bytes += int(bytes_per_gpu)
            r.load_s += float(seconds)

    def record_forward(
        self, model: str, tp: int, prompt_tokens: int, layer_compute_s: float
    ) -> None:
        if tp < 1 or prompt_tokens < 1 or not (math.isfinite(layer_compute_s)
                                                 and layer_compute_s >= 0):
            return
        with self._lock:
            r = self._rec(model)
            # compare per GPU-second of work, so a faster reading at another tp also wins
            if r.compute_tp == 0 or layer_compute_s * tp < r.layer_compute_s * r.compute_tp:
                # (0 is a measurement: a forward below what a request's timing resolves)
                r.layer_compute_s, r.compute_tp = layer_compute_s, tp
                r.prompt_tokens = prompt_tokens

    def record_activation(self, model: str, seconds: float) -> None:
        if not _ok(seconds):
            return
        with self._lock:
            r = self._rec(model)
            r.head_start_s = seconds if r.head_start_s == 0 else min(r.head_start_s, seconds)

    def record_engine_overhead(self, model: str, bytes_per_gpu: int) -> None:
        if bytes_per_gpu <= 0:
            return
        with self._lock:
            r = self._rec(model)
            r.engine_overhead_bytes = max(r.engine_overhead_bytes, int(bytes_per_gpu))

    def wants_forward(self, model: str) -> bool:
        with self._lock:
            r = self._by_model.get(model)
            return r is None or r.compute_tp == 0

    def pb(self, model: str) -> pb.ModelProfile | None:
        with self._lock:
            r = self._by_model.get(model)
            if r is None:
                return None
            return pb.ModelProfile(
                load_bytes_per_second=r.load_bytes / r.load_s if r.load_s > 0 else 0.0,
                layer_compute_seconds=r.layer_compute_s,
                prompt_tokens=r.prompt_tokens,
                compute_tp=r.compute_tp,
                head_start_seconds=r.head_start_s,
                engine_overhead_bytes=r.engine_overhead_bytes,
            )


class _Refused(Exception):
    """The engine answered a probe request with an HTTP error (e.g. a prompt beyond its
    context)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


async def _complete(session: Any, url: str, model: str, tokens: int) -> float:
    """Seconds for one ``max_tokens: 1`` completion of a ``tokens``-token prompt."""
    body = {"model": model, "prompt": [PROBE_TOKEN_ID] * tokens, "max_tokens": 1, "stream": False}
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        await resp.read()
        if resp.status >= 400:
            raise _Refused(resp.status)
    return time.perf_counter() - t0


async def time_forward(
    endpoint: str,
    model: str,
    num_layers: int,
    sizes: tuple[int, ...] = PROBE_PROMPT_TOKENS,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> tuple[float, int] | None:
    """(per-layer forward seconds, prompt tokens) on the engine at ``endpoint`` for the first
    prompt size in ``sizes`` it takes (module docstring), or ``None`` when the engine did not
    answer or the difference was not positive (a busy engine: measured again at the next
    instance).  Cancelling it gives its request up at once (the connection is closed, so the
    engine drops the request): a probe must never hold an instance that stops serving."""
    import aiohttp

    url = f"{endpoint.rstrip('/')}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def fastest(tokens: int) -> float:
            return min([await _complete(session, url, model, tokens) for _ in range(PROBE_REPEATS)])

        try:
            # warm-up: first-request costs are not compute
            await _complete(session, url, model, 1)
            one = await fastest(1)
        except Exception as exc:  # the instance may end meanwhile; nothing to record
            log.info("event=forward_probe_failed model=%s err=%s", model, exc)
            return None
        for tokens in sizes:
            try:
                full = await fastest(tokens)
            except _Refused as exc:  # refused (a prompt beyond its context): shorter
                log.info("event=forward_probe_refused model=%s tokens=%d code=%s", model,
                         tokens, exc.status)
                continue
            except Exception as exc:
                log.info("event=forward_probe_failed model=%s err=%s", model, exc)
                return None
            per_layer = max(0.0, (full - one) / num_layers)
            log.info("event=forward_timed model=%s tokens=%d per_layer_s=%.6f one_s=%.6f",
                     model, tokens, per_layer, one)
            return per_layer, tokens
    return None
