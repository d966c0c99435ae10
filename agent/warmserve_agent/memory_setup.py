"""Which memory backend serves the node's GPU page pools, and who owns the memory.

Prewarm slots and KV caches live in per-GPU page pools mapped through a virtual-memory backend
(WarmServe §4.2: CUDA VMM; ``--simulate-gpus``: simulated device memory files).  With real GPUs
each GPU's worker process owns its memory by default (VMM mappings belong to the process that
made them, and the engine using a slot runs in that worker); the agent then drives the pools
through the workers (:class:`~warmserve_agent.backends.workers.WorkerMemoryBackend`).  Backends
are imported lazily: cuda-python is needed only where a CUDA backend is built.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from warmserve_agent.config import AgentConfig
from warmserve_agent.shm import PREFIX


def new_memory_dir(cfg: AgentConfig) -> Path:
    """Where this agent's simulated GPU memory files go (a fresh directory unless set)."""
    name = f"{PREFIX}{cfg.node_name}-{uuid.uuid4().hex[:8]}"
    return cfg.memory_dir or cfg.memory_root / name


def memory_in_workers(cfg: AgentConfig) -> bool:
    """Whether the GPU worker processes own the memory (auto: yes for CUDA with workers)."""
    if cfg.memory_in_workers is None:
        return cfg.simulate_gpus is None and cfg.use_workers
    return cfg.memory_in_workers


def _sim_timing(cfg: AgentConfig) -> dict[str, Any]:
    return {
        "copy_bytes_per_s": cfg.sim_copy_bytes_per_s or None,
        "map_s_per_page": cfg.sim_map_s_per_page,
    }


def make_backend(cfg: AgentConfig, pool: Any = None, memdir: Path | None = None) -> Any:
    """The memory backend ``cfg`` asks for (see module docstring)."""
    if memory_in_workers(cfg):
        from warmserve_agent.backends.workers import WorkerMemoryBackend

        if cfg.simulate_gpus is not None:
            return WorkerMemoryBackend(
                pool,
                "simulated",
                cfg.page_bytes,
                directory=str(memdir),
                keep_files=cfg.keep_memory,
                **_sim_timing(cfg),
            )
        return WorkerMemoryBackend(
            pool, "cuda", cfg.page_bytes, reserve_bytes=cfg.gpu_reserve_bytes
        )
    if cfg.simulate_gpus is not None:
        from warmserve_agent.backends.simulated import SimulatedBackend

        return SimulatedBackend(
            memdir,
            page_bytes=cfg.page_bytes,
            keep_files=cfg.keep_memory,
            **_sim_timing(cfg),
        )
    from warmserve_agent.backends.cuda import CudaBackend

    return CudaBackend(page_bytes=cfg.page_bytes, reserve_bytes=cfg.gpu_reserve_bytes)


def cuda_gpu_sizes() -> list[int]:
    """GPU count and memory from the driver (no contexts, no allocations)."""
    from warmserve_agent.backends.cuda_driver import device_sizes

    return device_sizes()
