"""CUDA VMM backend: prewarm slots on real GPUs through the CUDA driver API (cuda-python).

Implements :class:`~warmserve_agent.memory.MemoryBackend` with the driver's virtual memory
management calls (WarmServe §4.2; vllm-integration note §7):

* ``open_gpu``: retain the device's primary context (shared with torch, note §7.2 "context
  pitfall") and **pre-create one physical handle per page** with ``cuMemCreate`` — creating
  handles costs ~200 µs each, so doing it once at start and recycling handles keeps prewarm,
  activation and lending to ``cuMemMap`` (~1.5 µs) + one batched ``cuMemSetAccess``.
* ``reserve``/``free_reservation``: ``cuMemAddressReserve``/``cuMemAddressFree`` of a whole
  GPU's worth of virtual space per slot.
* ``map``: ``cuMemMap`` page by page, then one ``cuMemSetAccess`` over the contiguous range
  (a mapping has no access until set).  A failure part-way unmaps what this call mapped, so a
  refused map changes nothing.
* ``unmap``: ``cuMemUnmap`` page by page — the driver cannot unmap a sub-range of a mapping and
  our mappings are one page each, so per-page is always legal.
* ``write``: ``cuMemcpyHtoDAsync`` on a per-GPU stream when the source is pinned host memory
  (``alloc_host``), so the loader's next ``cuMemMap`` overlaps the copy in flight (the §4.2
  map/copy pipeline); ``sync`` waits for the stream.  Pageable sources use ``cuMemcpyHtoD``.

``cuda-python`` is imported lazily (it is not installed in CI).  Tests inject a recording fake
driver module to check the call sequences; that is a unit test of the page-table logic, not a
GPU claim.  Validation on a GPU is a later issue (note §8.4).

Ownership: the CUDA context that holds these mappings belongs to the process that created them,
so on a GPU node this backend must live in the GPU's worker process (the engine reads the slot
by virtual address).  Nothing survives that process.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from warmserve.policy.cluster import PAGE_BYTES


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


def import_driver() -> ModuleType:
    """The cuda-python driver module (13.x ``cuda.bindings.driver``; 12.x fallback)."""
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
        except ImportError as exc:
            raise CudaError(
                "the cuda backend needs cuda-python: pip install 'warmserve[cuda]' "
                "(or run with --simulate-gpus)"
            ) from exc
    return driver


class _PinnedBuffer:
    """Host memory from cuMemHostAlloc exposed as a writable memoryview."""

    def __init__(self, backend: CudaBackend, nbytes: int) -> None:
        self._backend = backend
        self.nbytes = nbytes
        (self.ptr,) = backend._call("cuMemHostAlloc", nbytes, 0)
        self.view = memoryview((ctypes.c_ubyte * nbytes).from_address(int(self.ptr))).cast("B")

    def free(self) -> None:
        if self.ptr:
            self.view.release()
            self._backend._call("cuMemFreeHost", self.ptr)
            self.ptr = 0


class CudaBackend:
    """:class:`~warmserve_agent.memory.MemoryBackend` over the CUDA driver VMM API."""

    name = "cuda"

    def __init__(self, *, driver: Any = None, page_bytes: int = PAGE_BYTES) -> None:
        self._drv = driver if driver is not None else import_driver()
        self.page_bytes = page_bytes
        self._lock = threading.RLock()
        self._ctx: dict[int, Any] = {}
        self._dev: dict[int, Any] = {}
        self._handles: dict[int, list[Any]] = {}
        self._access: dict[int, Any] = {}
        self._stream: dict[int, Any] = {}
        self._pinned: dict[int, _PinnedBuffer] = {}  # id(view) -> buffer
        self._call("cuInit", 0)

    # ---- driver plumbing -----------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> tuple[Any, ...]:
        ret = getattr(self._drv, name)(*args)
        err, rest = ret[0], tuple(ret[1:])
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise CudaError(f"{name} failed: {self._err_name(err)}")
        return rest

    def _err_name(self, err: Any) -> str:
        try:
            _, s = self._drv.cuGetErrorName(err)
            return s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # pragma: no cover - best effort for the message only
            return str(err)

    def _use(self, gpu: int) -> None:
        """Make ``gpu``'s primary context current in this thread (driver calls need one)."""
        self._call("cuCtxSetCurrent", self._ctx[gpu])

    def _location(self, obj: Any, dev: Any) -> None:
        drv = self._drv
        obj.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        obj.location.id = int(dev)

    # ---- MemoryBackend -------------------------------------------------------------------
    def open_gpu(self, gpu: int, memory_bytes: int) -> int:
        drv = self._drv
        with self._lock:
            (dev,) = self._call("cuDeviceGet", gpu)
            (ctx,) = self._call("cuDevicePrimaryCtxRetain", dev)
            self._dev[gpu], self._ctx[gpu] = dev, ctx
            self._use(gpu)
            prop = drv.CUmemAllocationProp()
            prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            self._location(prop, dev)
            (gran,) = self._call(
                "cuMemGetAllocationGranularity",
                prop,
                drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            if self.page_bytes % int(gran):
                raise CudaError(
                    f"gpu {gpu}: page size {self.page_bytes} is not a multiple of the "
                    f"allocation granularity {int(gran)}"
                )
            n = memory_bytes // self.page_bytes
            handles = []
            try:
                for _ in range(n):
                    (h,) = self._call("cuMemCreate", self.page_bytes, prop, 0)
                    handles.append(h)
            except CudaError:
                for h in handles:
                    self._call("cuMemRelease", h)
                raise
            self._handles[gpu] = handles
            desc = drv.CUmemAccessDesc()
            self._location(desc, dev)
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access[gpu] = desc
            (self._stream[gpu],) = self._call("cuStreamCreate", 0)
            return n

    def reserve(self, gpu: int, size: int) -> int:
        with self._lock:
            self._use(gpu)
            (ptr,) = self._call("cuMemAddressReserve", size, self.page_bytes, 0, 0)
            return int(ptr)

    def free_reservation(self, gpu: int, va: int, size: int) -> None:
        with self._lock:
            self._use(gpu)
            self._call("cuMemAddressFree", va, size)

    def map(self, gpu: int, va: int, ppages: Sequence[int]) -> None:
        if not ppages:
            return
        P = self.page_bytes
        with self._lock:
            self._use(gpu)
            handles = self._handles[gpu]
            done = 0
            try:
                for i, p in enumerate(ppages):
                    self._call("cuMemMap", va + i * P, P, 0, handles[p], 0)
                    done += 1
                self._call("cuMemSetAccess", va, len(ppages) * P, [self._access[gpu]], 1)
            except CudaError:
                for i in range(done):
                    self._call("cuMemUnmap", va + i * P, P)
                raise

    def unmap(self, gpu: int, va: int, npages: int) -> None:
        P = self.page_bytes
        with self._lock:
            self._use(gpu)
            # Copies still in flight may target these pages: drain the stream first.
            self._call("cuStreamSynchronize", self._stream[gpu])
            for i in range(npages):
                self._call("cuMemUnmap", va + i * P, P)

    def alloc_host(self, nbytes: int) -> memoryview:
        """Pinned host memory (for the weight store's host copies; enables async copies)."""
        with self._lock:
            buf = _PinnedBuffer(self, nbytes)
            self._pinned[id(buf.view)] = buf
            return buf.view

    def _pinned_ptr(self, data: memoryview | bytes) -> int | None:
        """Device-visible address of ``data`` if it lies inside a pinned buffer, else None."""
        if not isinstance(data, memoryview) or data.readonly or data.nbytes == 0:
            return None
        addr = ctypes.addressof(ctypes.c_char.from_buffer(data))
        for buf in self._pinned.values():
            if int(buf.ptr) <= addr and addr + data.nbytes <= int(buf.ptr) + buf.nbytes:
                return addr
        return None

    def write(self, gpu: int, va: int, data: memoryview | bytes) -> None:
        n = len(memoryview(data).cast("B"))
        with self._lock:
            self._use(gpu)
            ptr = self._pinned_ptr(data)
            if ptr is not None:
                self._call("cuMemcpyHtoDAsync", va, ptr, n, self._stream[gpu])
            else:
                self._call("cuMemcpyHtoD", va, bytes(data), n)

    def sync(self, gpu: int) -> None:
        with self._lock:
            self._use(gpu)
            self._call("cuStreamSynchronize", self._stream[gpu])

    def read(self, gpu: int, va: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        with self._lock:
            self._use(gpu)
            self._call("cuStreamSynchronize", self._stream[gpu])
            self._call("cuMemcpyDtoH", out, va, nbytes)
        return bytes(out)

    def close(self) -> None:
        with self._lock:
            for gpu, handles in self._handles.items():
                self._use(gpu)
                self._call("cuStreamSynchronize", self._stream[gpu])
                self._call("cuStreamDestroy", self._stream[gpu])
                for h in handles:
                    self._call("cuMemRelease", h)
                self._call("cuDevicePrimaryCtxRelease", self._dev[gpu])
            self._handles.clear()
            for buf in list(self._pinned.values()):
                buf.free()
            self._pinned.clear()
