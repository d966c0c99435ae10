"""CUDA VMM backend: prewarm slots on real GPUs through the CUDA driver API (cuda-python).

Implements :class:`~warmserve_agent.memory.MemoryBackend` with the driver's virtual memory
management calls (WarmServe §4.2; vllm-integration note §7):

* ``open_gpu``: retain the device's primary context (shared with torch, note §7.2 "context
  pitfall"), size the page pool from the memory **free** now minus ``reserve_bytes`` (room an
  engine needs for its own allocations: activations, CUDA graphs, workspaces),
  and **pre-create one physical handle per page** with ``cuMemCreate`` — creating handles costs
  ~200 µs each, so doing it once at start and recycling handles keeps prewarm, activation and
  lending to ``cuMemMap`` (~1.5 µs) + one batched ``cuMemSetAccess``.  If memory runs out while
  creating handles anyway (another process allocated meanwhile), the pool keeps what it got less
  the reserve instead of failing the agent.
* ``reserve``/``free_reservation``: ``cuMemAddressReserve``/``cuMemAddressFree`` of a whole
  GPU's worth of virtual space per slot.
* ``map``: ``cuMemMap`` page by page, then one ``cuMemSetAccess`` over the contiguous range
  (a mapping has no access until set).  A failure part-way unmaps what this call mapped, so a
  refused map changes nothing.
* ``unmap``: ``cuMemUnmap`` page by page — the driver cannot unmap a sub-range of a mapping and
  our mappings are one page each, so per-page is always legal — after draining the copy stream.
* ``load_ranges``: weights are read from the safetensors files **by this process** into a ring
  of pinned staging buffers (:mod:`~warmserve_agent.backends.staging`) and copied with
  ``cuMemcpyHtoDAsync`` on the GPU's **non-blocking** copy stream (a blocking stream would
  serialise with an engine's kernels on the legacy default stream; item 3); the returned ticket is
  an event that ``wait_loaded`` synchronises.
* Pinned host memory (the staging ring) is allocated with the GPU's context current and freed in
  ``close`` **before** the context is released (item 4); it is bounded by the ring's size.
* Each GPU has its own lock, so several GPUs open (create their handles) in parallel threads
  (item 5): a node's GPUs are opened concurrently by :meth:`MemoryManager.add_gpus`.

``cuda-python`` is imported lazily (not needed to run the simulated backend).  Tests inject a
recording fake driver (``warmserve_agent.fake_cuda``) that models contexts, asynchronous streams,
events and pinned memory, and replay every recorded call against the real ``cuda.bindings``
argument checks; that is a test of call sequences and arguments, not a GPU claim.  On a GPU,
``hack/gpu-check.sh`` runs the same contract tests on the device (docs/agent.md).

Ownership: the CUDA context that holds these mappings belongs to the process that created them,
so on a GPU node this backend lives in the GPU's worker process (the engine reads the slot by
virtual address).  Nothing survives that process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmserve.policy.cluster import PAGE_BYTES
from warmserve_agent.backends.cuda_driver import (
    CudaError,
    checked,
    import_driver,
    init_driver,
)
from warmserve_agent.backends.staging import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_DEPTH,
    DEFAULT_READERS,
    FileRange,
    HostBuffer,
    StagingRing,
)

log = logging.getLogger("warmserve.agent.cuda")

DEFAULT_RESERVE_BYTES = 4 * 1024**3


@dataclass
class _Gpu:
    """One GPU's driver objects (guarded by ``lock``)."""

    dev: Any
    ctx: Any
    lock: threading.RLock = field(default_factory=threading.RLock)
    handles: list[Any] = field(default_factory=list)
    access: Any = None
    stream: Any = None
    ring: StagingRing | None = None
    tickets: dict[int, Any] = field(default_factory=dict)
    next_ticket: int = 1
    info: dict[str, int] = field(default_factory=dict)


class _CudaCopyTarget:
    """Staging-ring target for one GPU: pinned buffers and async copies on its stream."""

    def __init__(self, backend: CudaBackend, gpu: int) -> None:
        self.b = backend
        self.gpu = gpu

    def alloc_buffers(self, count: int, nbytes: int) -> list[HostBuffer]:
        out: list[HostBuffer] = []
        with self.b._use(self.gpu):  # pinned memory belongs to this GPU's context
            try:
                for _ in range(count):
                    (ptr,) = self.b._call("cuMemHostAlloc", nbytes, 0)
                    view = memoryview((ctypes.c_ubyte * nbytes).from_address(int(ptr))).cast("B")
                    out.append(HostBuffer(view, int(ptr)))
            except CudaError:
                self.free_buffers(out)
                raise
        return out

    def free_buffers(self, buffers: list[HostBuffer]) -> None:
        with self.b._use(self.gpu):
            for buf in buffers:
                buf.view.release()
                self.b._call("cuMemFreeHost", buf.ptr)

    def copy_async(self, va: int, buf: HostBuffer, offset: int, nbytes: int) -> None:
        with self.b._use(self.gpu) as g:
            self.b._call("cuMemcpyHtoDAsync", va, buf.ptr + offset, nbytes, g.stream)

    def record(self, reuse: Any = None) -> Any:
        with self.b._use(self.gpu) as g:
            ev = reuse
            if ev is None:
                (ev,) = self.b._call("cuEventCreate", self.b._event_flags)
            self.b._call("cuEventRecord", ev, g.stream)
            return ev

    def wait(self, event: Any) -> None:
        with self.b._use(self.gpu):
            self.b._call("cuEventSynchronize", event)

    def destroy(self, event: Any) -> None:
        with self.b._use(self.gpu):
            self.b._call("cuEventDestroy", event)


class CudaBackend:
    """:class:`~warmserve_agent.memory.MemoryBackend` over the CUDA driver VMM API."""

    name = "cuda"

    def __init__(
        self,
        *,
        driver: Any = None,
        page_bytes: int = PAGE_BYTES,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        staging_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging_depth: int = DEFAULT_DEPTH,
        staging_readers: int = DEFAULT_READERS,
    ) -> None:
        self._drv = import_driver(driver) if driver is None or isinstance(driver, str) else driver
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        self.page_bytes = page_bytes
        self.reserve_bytes = reserve_bytes
        self._staging = (staging_chunk_bytes, staging_depth, staging_readers)
        self._lock = threading.Lock()  # guards the dict only; each GPU has its own lock
        self._gpus: dict[int, _Gpu] = {}
        drv = self._drv
        self._event_flags = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._stream_flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        init_driver(drv)

    # ---- driver plumbing -----------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> tuple[Any, ...]:
        return checked(self._drv, name, *args)

    def _gpu(self, gpu: int) -> _Gpu:
        try:
            return self._gpus[gpu]
        except KeyError:
            raise CudaError(f"gpu {gpu} is not open in this process") from None

    @contextlib.contextmanager
    def _use(self, gpu: int) -> Iterator[_Gpu]:
        """Hold ``gpu``'s lock with its primary context current in this thread (driver calls
        need one, and torch may have made another device's context current; note §7.2)."""
        g = self._gpu(gpu)
        with g.lock:
            self._call("cuCtxSetCurrent", g.ctx)
            yield g

    def _location(self, obj: Any, dev: Any) -> None:
        drv = self._drv
        obj.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        obj.location.id = int(dev)

    # ---- MemoryBackend -------------------------------------------------------------------
    def open_gpu(self, gpu: int, memory_bytes: int) -> int:
        """Create ``gpu``'s page pool: ``min(memory_bytes, free - reserve_bytes)`` of pages."""
        drv = self._drv
        with self._lock:
            if gpu in self._gpus:
                raise CudaError(f"gpu {gpu} is already open")
        (dev,) = self._call("cuDeviceGet", gpu)
        (ctx,) = self._call("cuDevicePrimaryCtxRetain", dev)
        g = _Gpu(dev, ctx)
        with self._lock:
            self._gpus[gpu] = g
        try:
            with self._use(gpu):
                self._create_pool(gpu, g, memory_bytes)
                desc = drv.CUmemAccessDesc()
                self._location(desc, dev)
                desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                g.access = desc
                (g.stream,) = self._call("cuStreamCreate", self._stream_flags)
            return len(g.handles)
        except BaseException:
            self._release_gpu(gpu)
            raise

    def _create_pool(self, gpu: int, g: _Gpu, memory_bytes: int) -> None:
        drv = self._drv
        P = self.page_bytes
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._location(prop, g.dev)
        (gran,) = self._call(
            "cuMemGetAllocationGranularity",
            prop,
            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        if P % int(gran):
            raise CudaError(
                f"gpu {gpu}: page size {P} is not a multiple of the allocation granularity "
                f"{int(gran)}"
            )
        free, total = (int(x) for x in self._call("cuMemGetInfo"))
        budget = min(memory_bytes, free - self.reserve_bytes)
        n = max(0, budget) // P
        if n < 1:
            raise CudaError(
                f"gpu {gpu}: {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB leaves no "
                f"room for a page pool after the {self.reserve_bytes / 2**30:.2f} GiB reserve "
                "(--gpu-reserve); free GPU memory or lower the reserve"
            )
        t0 = time.perf_counter()
        reserve_pages = -(-self.reserve_bytes // P)
        for i in range(n):
            try:
                (h,) = self._call("cuMemCreate", P, prop, 0)
            except CudaError as exc:
                if exc.result != drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                    raise
                # Someone else took memory meanwhile: keep the pool smaller and give the
                # reserve back (the engine needs it), rather than fail the agent.
                keep = max(0, i - reserve_pages)
                for h in g.handles[keep:]:
                    self._call("cuMemRelease", h)
                del g.handles[keep:]
                log.warning(
                    "event=pool_shrunk gpu=%d planned_pages=%d pages=%d reason=out_of_memory",
                    gpu,
                    n,
                    keep,
                )
                if keep < 1:
                    raise CudaError(
                        f"gpu {gpu}: out of memory after {i} pages; nothing left for a pool "
                        f"beyond the {self.reserve_bytes / 2**30:.2f} GiB reserve",
                        exc.result,
                    ) from None
                break
            g.handles.append(h)
        g.info = {
            "free_bytes": free,
            "total_bytes": total,
            "reserve_bytes": self.reserve_bytes,
            "pages": len(g.handles),
        }
        log.info(
            "event=pool_created gpu=%d pages=%d pool_gib=%.2f free_gib=%.2f reserve_gib=%.2f "
            "seconds=%.2f",
            gpu,
            len(g.handles),
            len(g.handles) * P / 2**30,
            free / 2**30,
            self.reserve_bytes / 2**30,
            time.perf_counter() - t0,
        )

    def pool_info(self, gpu: int) -> dict[str, int]:
        """Free/total memory seen when the pool was sized, the reserve and the page count."""
        return dict(self._gpu(gpu).info)

    def reserve(self, gpu: int, size: int) -> int:
        with self._use(gpu):
            (ptr,) = self._call("cuMemAddressReserve", size, self.page_bytes, 0, 0)
            return int(ptr)

    def free_reservation(self, gpu: int, va: int, size: int) -> None:
        with self._use(gpu):
            self._call("cuMemAddressFree", va, size)

    def map(self, gpu: int, va: int, ppages: Sequence[int]) -> None:
        if not ppages:
            return
        P = self.page_bytes
        with self._use(gpu) as g:
            done = 0
            try:
                for i, p in enumerate(ppages):
                    self._call("cuMemMap", va + i * P, P, 0, g.handles[p], 0)
                    done += 1
                self._call("cuMemSetAccess", va, len(ppages) * P, [g.access], 1)
            except CudaError:
                for i in range(done):
                    self._call("cuMemUnmap", va + i * P, P)
                raise

    def unmap(self, gpu: int, va: int, npages: int) -> None:
        P = self.page_bytes
        with self._use(gpu) as g:
            # Copies still in flight may target these pages: drain the stream first.
            self._call("cuStreamSynchronize", g.stream)
            for i in range(npages):
                self._call("cuMemUnmap", va + i * P, P)

    def _ring(self, gpu: int) -> StagingRing:
        g = self._gpu(gpu)
        with g.lock:
            if g.ring is None:
                chunk, depth, readers = self._staging
                g.ring = StagingRing(
                    _CudaCopyTarget(self, gpu), chunk_bytes=chunk, depth=depth, readers=readers
                )
            return g.ring

    def load_ranges(self, gpu: int, ranges: Sequence[tuple[int, str, int, int]]) -> int:
        """Copy file ranges ``(va, path, offset, nbytes)`` to the GPU through the pinned
        staging ring; returns a ticket for :meth:`wait_loaded` (copies may be in flight)."""
        ring = self._ring(gpu)
        event = ring.load([FileRange(*r) for r in ranges])
        g = self._gpu(gpu)
        with g.lock:
            ticket = g.next_ticket
            g.next_ticket += 1
            g.tickets[ticket] = event
        return ticket

    def wait_loaded(self, gpu: int, ticket: int) -> None:
        with self._use(gpu) as g:
            event = g.tickets.pop(ticket, None)
            if event is None:
                raise CudaError(f"gpu {gpu}: unknown load ticket {ticket}")
            try:
                self._call("cuEventSynchronize", event)
            finally:
                self._call("cuEventDestroy", event)

    def staging_bytes(self, gpu: int) -> int:
        """Pinned host memory this GPU's staging ring holds."""
        ring = self._gpu(gpu).ring
        return 0 if ring is None else ring.host_bytes

    def torch_view(self, gpu: int, va: int, nbytes: int) -> Any:
        """A ``torch.uint8`` CUDA tensor over ``[va, va + nbytes)`` of this process's mappings
        on ``gpu`` (no copy): what an engine in this worker builds its parameters and KV cache
        from (``slot_tensors``; engines look for this method on the backend)."""
        from warmserve_agent.slot_tensors import cuda_bytes

        self.sync(gpu)  # weights still in flight must land before anyone reads through torch
        return cuda_bytes(va, nbytes, gpu)

    def write(self, gpu: int, va: int, data: memoryview | bytes) -> None:
        src = data if isinstance(data, bytes | bytearray) else bytes(data)
        with self._use(gpu) as g:
            # Synchronous copies run on the legacy stream, which does not wait for our
            # non-blocking stream: order them after any load in flight.
            self._call("cuStreamSynchronize", g.stream)
            self._call("cuMemcpyHtoD", va, src, len(src))

    def sync(self, gpu: int) -> None:
        with self._use(gpu) as g:
            self._call("cuStreamSynchronize", g.stream)

    def read(self, gpu: int, va: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        with self._use(gpu) as g:
            self._call("cuStreamSynchronize", g.stream)
            self._call("cuMemcpyDtoH", out, va, nbytes)
        return bytes(out)

    def _release_gpu(self, gpu: int) -> None:
        """Free everything of one GPU in dependency order: copies drained, staging buffers
        and events freed, stream destroyed, handles released, and only then the context."""
        g = self._gpus.get(gpu)
        if g is None:
            return
        try:
            with self._use(gpu):
                if g.stream is not None:
                    self._call("cuStreamSynchronize", g.stream)
                if g.ring is not None:
                    g.ring.close()
                    g.ring = None
                for ev in g.tickets.values():
                    self._call("cuEventDestroy", ev)
                g.tickets.clear()
                if g.stream is not None:
                    self._call("cuStreamDestroy", g.stream)
                    g.stream = None
                for h in g.handles:
                    self._call("cuMemRelease", h)
                g.handles.clear()
        finally:
            self._call("cuDevicePrimaryCtxRelease", g.dev)
            with self._lock:
                self._gpus.pop(gpu, None)

    def close(self) -> None:
        for gpu in list(self._gpus):
            self._release_gpu(gpu)
