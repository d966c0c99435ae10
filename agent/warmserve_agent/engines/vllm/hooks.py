"""What the ``vllm`` engine plugs into vLLM, apart from the slot loader (``loader.py``).

* :class:`HoldUntilResident`: ASGI middleware over vLLM's OpenAI app, holding generation requests
  (not refusing them) until a partially prewarmed model has every layer resident;
* :func:`ttft_logger_factory`: a vLLM stat logger feeding vLLM's own first-token latencies into
  the engine's TTFT window (the agent's ``EngineStats``);
* :func:`extent` / :func:`slot_dtype`: facts about tensors and checkpoints the engine reports or
  passes to vLLM;
* :func:`cleanup_vllm_process_state`: vLLM's own teardown, so a pooled process can host the next
  engine.

vLLM is imported lazily (inside functions) so this module imports without it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from warmserve_agent.engine import TtftWindow
from warmserve_agent.engines.spec import EngineSpec


class HoldUntilResident:
    """ASGI middleware: generation requests wait until every layer is resident (``engine._ready``,
    an ``asyncio.Event`` the engine sets once ``layers_ready`` reports the last layer)."""

    def __init__(self, app: Any, engine: Any) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ready = self.engine._ready
        if (
            scope.get("type") == "http"
            and ready is not None
            and not ready.is_set()
            and scope.get("path", "").startswith("/v1/")
            and scope.get("method") == "POST"
        ):
            await ready.wait()
        await self.app(scope, receive, send)


def ttft_logger_factory(window: TtftWindow) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TtftLogger(StatLoggerBase):
        """Feeds vLLM's own per-request first-token latencies into the engine's window."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.window = window

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None:
                for t in iteration_stats.time_to_first_tokens_iter:
                    self.window.observe(t)

        def log_engine_initialized(self) -> None:
            pass

    return TtftLogger


def extent(t: Any) -> int:
    """Bytes from ``t.data_ptr()`` to the end of the last element ``t`` addresses."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def slot_dtype(spec: EngineSpec) -> str:
    """The checkpoint's floating dtype (of its largest tensor)."""
    floats = [t for t in spec.tensors if t.dtype in _TORCH_DTYPES]
    if not floats:
        return "auto"
    return _TORCH_DTYPES[max(floats, key=lambda t: t.nbytes).dtype]


def cleanup_vllm_process_state() -> None:
    """Let the next engine in this pooled process start clean (vLLM's own test teardown)."""
    import gc

    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    gc.collect()
