"""Memory owned by the GPU worker processes: a MemoryBackend that forwards to them.

The paper's per-GPU actors own their GPU's memory, and with CUDA they must: VMM mappings belong
to the process (context) that created them, and the engine that uses the slot runs in the GPU's
worker process.  :class:`WorkerMemoryBackend` keeps the agent's page tables (``MemoryManager``)
where they are and sends every physical operation (``open_gpu``, ``reserve``, ``map``,
``unmap``, ``write``, ...) to the worker of that GPU, which runs the real backend (``simulated``
or ``cuda``) in-process.

Consequence, by design: **a GPU's memory dies with its worker.**  When a worker crashes the agent
drops every slot touching that GPU (``NodeCore.gpu_lost``) and the replacement worker opens a
fresh, empty page pool (``MemoryManager.reopen_gpu``).  Recycling workers after each instance
would throw the kept weights away, so ``recycle_workers`` is refused in this mode.

Weights never cross the pipe: ``load_ranges`` sends ``(virtual address, file, offset, length)``
descriptors and the worker reads the safetensors ranges itself into a staging ring it owns
(pinned with ``cuda``) and copies them asynchronously (:mod:`~warmserve_agent.backends.staging`).
Timeouts of the calls that move or hash weights grow with the bytes they move
(:func:`~warmserve_agent.worker.timeout_for_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from warmserve_agent.worker import WorkerPool, timeout_for_bytes
from warmserve_agent.worker_errors import WorkerError


class WorkerMemoryBackend:
    """:class:`~warmserve_agent.memory.MemoryBackend` executed by each GPU's worker."""

    in_workers = True  # the engine reads the slot by virtual address in the worker

    def __init__(self, pool: WorkerPool, kind: str, page_bytes: int, **options: Any) -> None:
        if kind not in ("simulated", "cuda"):
            raise ValueError(f"unknown memory backend {kind!r}")
        self.pool = pool
        self.name = kind
        self.page_bytes = page_bytes
        self._options = {"page_bytes": page_bytes, **options}
        self._ticket_bytes: dict[tuple[int, int], int] = {}
        self._dir = Path(options["directory"]) if kind == "simulated" else None
        if kind != "simulated":  # only the simulated MMU can be inspected; no shared file
            self.translation = None  # type: ignore[assignment]
            self.path = None  # type: ignore[assignment]
            self.page_table_path = None  # type: ignore[assignment]

    def _call(self, gpu: int, op: str, *args: Any, timeout_s: float = 120.0) -> Any:
        return self.pool.worker(gpu).call("mem", timeout_s=timeout_s, op=op, args=args)

    def path(self, gpu: int) -> Path:
        """Simulated only: the shared file of ``gpu`` (the engine reads it by physical page)."""
        assert self._dir is not None
        return self._dir / f"gpu{gpu}.mem"

    def page_table_path(self, gpu: int, va: int) -> Path:
        """Simulated only: the reservation's shared page-table file the worker's backend keeps
        (``backends/simulated.py``)."""
        from warmserve_agent.backends.simulated import page_table_file

        assert self._dir is not None
        return page_table_file(self._dir, gpu, va)

    def open_gpu(self, gpu: int, memory_bytes: int) -> int:
        self.pool.worker(gpu).call("mem_init", kind=self.name, options=self._options)
        return int(self._call(gpu, "open_gpu", gpu, memory_bytes, timeout_s=600.0))

    def reserve(self, gpu: int, size: int) -> int:
        return int(self._call(gpu, "reserve", gpu, size))

    def _release(self, gpu: int, op: str, *args: Any) -> None:
        """Unmapping or freeing on a GPU whose worker died is moot: that memory died with it
        (its own ``gpu_lost`` drops its tables).  Happens when two workers of one slot die
        together, e.g. a tensor-parallel engine's rank 0 ended after another rank died."""
        w = self.pool.worker(gpu)
        if not w.alive():
            return
        try:
            self._call(gpu, op, gpu, *args)
        except WorkerError:
            if w.alive():
                raise

    def free_reservation(self, gpu: int, va: int, size: int) -> None:
        self._release(gpu, "free_reservation", va, size)

    def map(self, gpu: int, va: int, ppages: Sequence[int]) -> None:
        self._call(gpu, "map", gpu, va, list(ppages))

    def unmap(self, gpu: int, va: int, npages: int) -> None:
        self._release(gpu, "unmap", va, npages)

    def write(self, gpu: int, va: int, data: memoryview | bytes) -> None:
        self._call(gpu, "write", gpu, va, bytes(data))

    def load_ranges(self, gpu: int, ranges: Sequence[tuple[int, str, int, int]]) -> int:
        nbytes = sum(r[3] for r in ranges)
        ticket = int(
            self._call(gpu, "load_ranges", gpu, list(ranges), timeout_s=timeout_for_bytes(nbytes))
        )
        self._ticket_bytes[(gpu, ticket)] = nbytes
        return ticket

    def wait_loaded(self, gpu: int, ticket: int) -> None:
        nbytes = self._ticket_bytes.pop((gpu, ticket), 0)
        self._call(gpu, "wait_loaded", gpu, ticket, timeout_s=timeout_for_bytes(nbytes))

    def staging_bytes(self, gpu: int) -> int:
        return int(self._call(gpu, "staging_bytes", gpu))

    def read(self, gpu: int, va: int, nbytes: int) -> bytes:
        return self._call(gpu, "read", gpu, va, nbytes, timeout_s=timeout_for_bytes(nbytes))

    def sync(self, gpu: int) -> None:
        if self.name == "cuda":
            self._call(gpu, "sync", gpu)

    def translation(self, gpu: int) -> dict[int, int]:
        return self._call(gpu, "translation", gpu)

    def close(self) -> None:
        for gpu in self.pool.gpus:
            w = self.pool.worker(gpu)
            if w.alive():
                w.call("mem", op="close", args=())
