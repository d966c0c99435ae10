"""What the ``vllm`` engine plugs into vLLM, apart from the slot loader (``loader.py``).

* :func:`install_layer_gates`: per-layer readiness (a module's forward waits for its layer only,
  so a partially prewarmed model serves while its last layers land);
* :func:`zero_kv_blocks_on_allocation`: KV blocks zeroed as vLLM hands them out, not at start;
* :func:`ttft_logger_factory`: a vLLM stat logger feeding vLLM's own first-token latencies into
  the engine's TTFT window (the agent's ``EngineStats``) and noting the engine's first token;
* :func:`extent` / :func:`slot_dtype`: facts about tensors and checkpoints the engine reports or
  passes to vLLM;
* :func:`cleanup_vllm_process_state`: vLLM's own teardown, so a pooled process can host the next
  engine.

vLLM is imported lazily (inside functions) so this module imports without it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import Any

from warmserve_agent.engine import TtftWindow
from warmserve_agent.engines.layer_gate import LayerGate
from warmserve_agent.engines.spec import EngineSpec


def install_layer_gates(
    model: Any, spec: EngineSpec, views: dict[str, tuple[int, int]], gate: LayerGate
) -> int:
    """Make every module that holds parameters wait, before its forward, until the layer of its
    parameters is resident (``gate``), and ``compute_logits`` until every layer is; returns the
    hooks installed.  A parameter's layer is the store's (``TensorPlacement.layer``) of the
    tensors its slot view covers (``views``: parameter name -> slot offset, bytes).  The hooks
    remove themselves once every layer is resident: no cost after the load."""
    placed = sorted((t.offset, t.layer) for t in spec.tensors)
    starts = [o for o, _ in placed]
    last = spec.layers_total - 1

    def layer_of(offset: int, nbytes: int) -> int:
        lo, hi = bisect.bisect_left(starts, offset), bisect.bisect_left(starts, offset + nbytes)
        return max((layer for _, layer in placed[lo:hi]), default=last)

    layer_by_param = {
        id(p): layer_of(*views[name])
        for name, p in model.named_parameters(remove_duplicate=False)
        if name in views
    }
    handles: list[Any] = []

    def pre_hook(need: int) -> Any:
        def wait(module: Any, args: Any) -> None:
            if gate.complete:  # every layer landed: drop the hooks (this thread runs forwards)
                while handles:
                    handles.pop().remove()
                return
            gate.wait(need)

        return wait

    for module in model.modules():
        layers = [
            layer_by_param[id(p)]
            for p in module.parameters(recurse=False)
            if id(p) in layer_by_param
        ]
        if layers:
            handles.append(module.register_forward_pre_hook(pre_hook(max(layers) + 1)))
    compute_logits = getattr(model, "compute_logits", None)
    if compute_logits is not None:  # the LM head is applied outside forward (vLLM)

        def gated_logits(*args: Any, **kwargs: Any) -> Any:
            gate.wait(gate.total)
            return compute_logits(*args, **kwargs)

        model.compute_logits = gated_logits
    return len(handles)


def zero_kv_blocks_on_allocation(client: Any) -> None:
    """Have vLLM zero every KV block when it hands the block to a request (its own mechanism for
    caches that need it, ``needs_kv_cache_zeroing``) instead of zeroing the whole cache at start:
    the slot's KV pages hold a previous tenant's bytes, and a prepared engine's are mapped only
    at activation.  Run on the engine thread before the first request."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    core = client.engine_core
    sched = core.scheduler
    for mgr in sched.kv_cache_manager.coordinator.single_type_managers:
        if isinstance(mgr.kv_cache_spec, AttentionSpec):
            mgr._record_new_block_ids = True
    sched.needs_kv_cache_zeroing = True
    runner_zeroes_blocks(core.model_executor.driver_worker.worker.model_runner)


def runner_zeroes_blocks(runner: Any) -> None:
    """Let one rank's model runner zero the blocks the scheduler lists (every rank gets the
    list with each step): the CPU runner zeroes by block itself; the GPU runner needs its
    zeroer's metadata, which vLLM builds only for caches it knows need zeroing (without it the
    GPU runner skips zeroing silently)."""
    gpu_runner = runner.device.type != "cpu" and hasattr(runner, "_init_kv_zero_meta")
    if gpu_runner and not hasattr(runner, "_kv_block_zeroer"):
        runner._init_kv_zero_meta()


def ttft_logger_factory(window: TtftWindow, on_first_token: Callable[[], None]) -> Any:
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
                    on_first_token()
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
        from vllm.distributed import parallel_state
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        # Group names count up per process ("tp:0", "tp:1", ...) and vLLM's CPU shared-memory
        # all-reduce needs every rank's name to agree: ranks in pooled workers with different
        # histories would fall back to gloo over TCP (0.4-4 ms an all-reduce, not µs).  Next engine:
        # names as in a fresh process.
        parallel_state._group_name_counter.clear()
    gc.collect()
