"""The engine boundary: one :class:`Engine` protocol for every engine and every host.

An engine serves one instance from an activated prewarm slot (WarmServe §4): its weights are
already in the slot, its KV cache is the slot's pages after them.  The same protocol is
implemented by

* the engines themselves (``warmserve_agent.engines``: ``simulated``, ``vllm``), which run in a
  GPU worker process (or in the agent process for tests), and
* the agent-side hosts (``engine_host.WorkerEngine``, ``InProcessEngine``) that the node core
  drives; they forward to the engine in its process.

So ``NodeCore`` drives any engine through the same calls:

* ``prepare(spec)`` — at prewarm time, build everything that needs no resident weight and no KV
  page (the spec's KV pages are not mapped, its weights maybe partly), serving nothing; a host
  runs it in the background (``engine_host``).  Optional for an engine's users: ``start`` without
  it builds first.
* ``start(spec) -> endpoint`` — take over the slot described by the typed
  :class:`~warmserve_agent.engines.spec.EngineSpec` and serve an OpenAI-compatible API.  An engine
  never re-reads weight files for resident layers: it uses the slot.  A prepared engine only maps
  the rest of its slot, grows its KV cache and opens its endpoint.
* ``layers_ready(n)`` — the first ``n`` layers are now resident (a partially prewarmed model
  finishes loading through the agent's streaming loader while the engine serves: a computation
  needing layer ``i`` waits for layer ``i`` only, ``engines.layer_gate``); raises
  :class:`WeightsMismatch` if they are not the store's bytes.
* ``set_kv_capacity(nbytes) -> accepted`` — grace-period lending (Eq. 1): the engine may use at
  most ``nbytes`` of KV cache (summed over the group); it answers what it accepted (never less
  than what admitted requests hold) and the agent unmaps only pages beyond that.
* ``stats() -> EngineStats`` — R, waiting, K, M from the engine's own scheduler, TTFT, and how
  its ``start`` spent its time (``EngineStages``, with its first token).
* ``stop()``.

Engines are chosen by name through the registry in ``warmserve_agent.engines`` (the way vLLM
picks an executor class from its config).  docs/agent.md, "Engines", explains how to add one.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from warmserve_agent.engines.spec import EngineSpec, EngineStats, PreparedReport


class Engine(Protocol):
    def prepare(self, spec: EngineSpec) -> None: ...
    def start(self, spec: EngineSpec) -> str: ...
    def layers_ready(self, n: int) -> None: ...
    def set_kv_capacity(self, nbytes: int) -> int: ...
    def stats(self) -> EngineStats: ...
    def stop(self) -> None: ...


class EngineHost(Engine, Protocol):
    """Where the node core reaches an engine (``engine_host``): the engine protocol, with
    ``prepare`` running in the background, plus how far a preparation got, its teardown, and
    when the host's process was ready (``time.perf_counter()``)."""

    process_taken_at: float

    def prepared(self, wait_s: float = 0.0) -> PreparedReport: ...
    def drop_prepared(self) -> None: ...


class EngineError(RuntimeError):
    """An engine could not start or serve (message says why).

    Raised in a worker process, it reaches the agent as the same type
    (:mod:`~warmserve_agent.worker_errors`)."""


class WeightsError(EngineError):
    """The slot's bytes differ from the store's digests; ``tensors`` names the shards."""

    def __init__(self, message: str, tensors: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tensors = tuple(tensors)


class WeightVerificationError(WeightsError):
    """The slot's bytes differ from the store's at start: the slot must be evicted."""


class WeightsMismatch(WeightsError):
    """Layers announced as resident do not match the store."""


class TtftWindow:
    """Times to first token observed in the last ``window_s`` seconds; p95 on demand."""

    def __init__(self, window_s: float = 300.0, max_samples: int = 100_000) -> None:
        self.window_s = window_s
        self._obs: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def observe(self, seconds: float, now: float | None = None) -> None:
        with self._lock:
            self._obs.append((time.monotonic() if now is None else now, float(seconds)))

    def p95(self, now: float | None = None) -> tuple[float, int]:
        """(p95 seconds, samples) over the window; (0.0, 0) without samples."""
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._obs and self._obs[0][0] < cutoff:
                self._obs.popleft()
            vals = sorted(v for _, v in self._obs)
        if not vals:
            return 0.0, 0
        # nearest-rank percentile: the smallest value with >= 95 % of samples at or below it
        k = max(0, min(len(vals) - 1, -(-95 * len(vals) // 100) - 1))
        return vals[k], len(vals)


def verify_shard(
    read_va: Callable[[int, int], bytes], va: int, tensors: list[tuple[str, int, int, str]]
) -> list[str]:
    """Names of tensors whose bytes at ``va + offset`` differ from their blake2b-128 digest.

    Run by a worker on its own GPU's shard of a slot (tensor-parallel ranks other than the one
    hosting the engine)."""
    bad = []
    for name, off, n, digest in tensors:
        if hashlib.blake2b(read_va(va + off, n), digest_size=16).hexdigest() != digest:
            bad.append(name)
    return bad
