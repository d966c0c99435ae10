"""The cuda backend's driver call sequences, against a recording fake of ``cuda.bindings.driver``.

This is a unit test of the page-table logic and the order of VMM calls (pre-created handles,
map page by page then one batched cuMemSetAccess, unmap after draining copies, rollback on a
failed map).  It makes no claim about real GPUs; the backend is validated on a GPU later.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from warmserve_agent.backends import cuda as cuda_mod
from warmserve_agent.backends.cuda import CudaBackend, CudaError
from warmserve_agent.memory import MemoryManager

P = 2 * 1024 * 1024


class FakeDriver:
    """Just enough of the driver module: records calls and emulates VMM semantics."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_VALUE = 1

    class CUmemAllocationType:
        CU_MEM_ALLOCATION_TYPE_PINNED = 1

    class CUmemLocationType:
        CU_MEM_LOCATION_TYPE_DEVICE = 1

    class CUmemAllocationGranularity_flags:
        CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0

    class CUmemAccess_flags:
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3

    class CUmemAllocationProp:
        def __init__(self) -> None:
            self.type = None
            self.location = SimpleNamespace(type=None, id=None)

    class CUmemAccessDesc:
        def __init__(self) -> None:
            self.flags = None
            self.location = SimpleNamespace(type=None, id=None)

    def __init__(self, fail_map_at: int | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.handles: dict[int, bytearray] = {}
        self.maps: dict[int, int] = {}  # va page -> handle
        self.access: set[int] = set()  # va pages with access
        self.next_va = 1 << 40
        self.fail_map_at = fail_map_at
        self.map_calls = 0

    def _rec(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def cuInit(self, flags: int) -> tuple[int]:
        self._rec("cuInit", flags)
        return (0,)

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return (0, b"CUDA_ERROR_OUT_OF_MEMORY" if err == 2 else b"CUDA_ERROR_X")

    def cuDeviceGet(self, i: int) -> tuple[int, int]:
        self._rec("cuDeviceGet", i)
        return (0, i)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, str]:
        self._rec("cuDevicePrimaryCtxRetain", dev)
        return (0, f"ctx{dev}")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[int]:
        self._rec("cuDevicePrimaryCtxRelease", dev)
        return (0,)

    def cuCtxSetCurrent(self, ctx: str) -> tuple[int]:
        self._rec("cuCtxSetCurrent", ctx)
        return (0,)

    def cuMemGetAllocationGranularity(self, prop: Any, flag: int) -> tuple[int, int]:
        assert prop.type == 1 and prop.location.type == 1
        self._rec("cuMemGetAllocationGranularity", flag)
        return (0, P)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[int, int]:
        self._rec("cuMemCreate", size)
        h = len(self.handles) + 1
        self.handles[h] = bytearray(size)
        return (0, h)

    def cuMemRelease(self, h: int) -> tuple[int]:
        self._rec("cuMemRelease", h)
        assert h not in self.maps.values(), "released a handle that is still mapped"
        return (0,)

    def cuStreamCreate(self, flags: int) -> tuple[int, str]:
        self._rec("cuStreamCreate", flags)
        return (0, "stream")

    def cuStreamSynchronize(self, s: str) -> tuple[int]:
        self._rec("cuStreamSynchronize", s)
        return (0,)

    def cuStreamDestroy(self, s: str) -> tuple[int]:
        self._rec("cuStreamDestroy", s)
        return (0,)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple[int, int]:
        self._rec("cuMemAddressReserve", size, align)
        va = self.next_va
        self.next_va += size + (1 << 30)
        return (0, va)

    def cuMemAddressFree(self, va: int, size: int) -> tuple[int]:
        self._rec("cuMemAddressFree", va, size)
        return (0,)

    def cuMemMap(self, va: int, size: int, off: int, h: int, flags: int) -> tuple[int]:
        self._rec("cuMemMap", va, size, h)
        self.map_calls += 1
        if self.fail_map_at is not None and self.map_calls == self.fail_map_at:
            return (2,)
        assert size == P and va % P == 0 and va // P not in self.maps
        self.maps[va // P] = h
        return (0,)

    def cuMemSetAccess(self, va: int, size: int, descs: list[Any], n: int) -> tuple[int]:
        self._rec("cuMemSetAccess", va, size)
        assert descs[0].flags == 3 and n == 1
        for v in range(va // P, (va + size) // P):
            assert v in self.maps, "set access on an unmapped page"
            self.access.add(v)
        return (0,)

    def cuMemUnmap(self, va: int, size: int) -> tuple[int]:
        self._rec("cuMemUnmap", va, size)
        assert size == P, "a mapping is one page; unmap must match it"
        del self.maps[va // P]
        self.access.discard(va // P)
        return (0,)

    def _touch(self, va: int, n: int):
        pos = 0
        while pos < n:
            v, off = divmod(va + pos, P)
            assert v in self.access, f"access to page {v} without mapping/access"
            k = min(P - off, n - pos)
            yield self.handles[self.maps[v]], off, pos, k
            pos += k

    def cuMemcpyHtoD(self, dst: int, src: bytes, n: int) -> tuple[int]:
        self._rec("cuMemcpyHtoD", dst, n)
        for buf, off, pos, k in self._touch(dst, n):
            buf[off : off + k] = src[pos : pos + k]
        return (0,)

    def cuMemcpyDtoH(self, dst: bytearray, src: int, n: int) -> tuple[int]:
        self._rec("cuMemcpyDtoH", src, n)
        for buf, off, pos, k in self._touch(src, n):
            dst[pos : pos + k] = buf[off : off + k]
        return (0,)


def make(drv: FakeDriver, pages: int = 8) -> MemoryManager:
    mm = MemoryManager(CudaBackend(driver=drv, page_bytes=P))
    mm.add_gpu(0, pages * P)
    return mm


def test_open_gpu_precreates_one_handle_per_page() -> None:
    drv = FakeDriver()
    make(drv, pages=8)
    names = drv.names()
    assert names[:4] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    assert names.count("cuMemCreate") == 8
    assert names.index("cuMemGetAllocationGranularity") < names.index("cuMemCreate")


def test_map_then_one_set_access_and_roundtrip() -> None:
    drv = FakeDriver()
    mm = make(drv)
    mm.create_slot("s", [0])
    drv.calls.clear()
    mm.map_range("s", 0, 3)
    assert drv.names() == ["cuCtxSetCurrent", "cuMemMap", "cuMemMap", "cuMemMap", "cuMemSetAccess"]
    va = mm.va_base("s", 0)
    assert drv.calls[-1][1] == (va, 3 * P)
    data = bytes(range(251)) * 30000  # ~7.5 MB would overflow 3 pages; trim to fit
    data = data[: 2 * P + 12345]
    mm.write("s", 0, 10, data)
    assert mm.read("s", 0, 10, len(data)) == data
    mm.check()


def test_unmap_drains_stream_and_unmaps_page_by_page() -> None:
    drv = FakeDriver()
    mm = make(drv)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 4)
    drv.calls.clear()
    assert mm.destroy_slot("s") == 4
    names = drv.names()
    assert names.index("cuStreamSynchronize") < names.index("cuMemUnmap")
    assert names.count("cuMemUnmap") == 4
    assert names[-1] == "cuMemAddressFree"
    assert not drv.maps
    mm.check()


def test_failed_map_rolls_back() -> None:
    drv = FakeDriver(fail_map_at=3)
    mm = make(drv)
    mm.create_slot("s", [0])
    with pytest.raises(CudaError, match="cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY"):
        mm.map_range("s", 0, 4)
    assert not drv.maps, "pages mapped before the failure must be unmapped"
    assert mm.free_pages(0) == 8 and mm.mapped_count("s", 0) == 0
    mm.check()


def test_pinned_host_memory_uses_async_copies() -> None:
    drv = FakeDriver()
    mm = make(drv)
    backend = mm.backend
    calls: list[tuple[Any, ...]] = []

    def host_alloc(n: int, flags: int) -> tuple[int, int]:
        import ctypes

        buf = (ctypes.c_ubyte * n)()
        calls.append(("alloc", buf))
        return (0, ctypes.addressof(buf))

    def copy_async(dst: int, src: int, n: int, stream: str) -> tuple[int]:
        calls.append(("async", dst, src, n))
        return (0,)

    drv.cuMemHostAlloc = host_alloc  # type: ignore[attr-defined]
    drv.cuMemFreeHost = lambda p: (0,)  # type: ignore[attr-defined]
    drv.cuMemcpyHtoDAsync = copy_async  # type: ignore[attr-defined]
    view = backend.alloc_host(1000)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 1)
    mm.write("s", 0, 0, view[100:200])
    kind, dst, src, n = calls[-1]
    assert kind == "async" and n == 100 and dst == mm.va_base("s", 0)
    import ctypes

    assert src == ctypes.addressof(calls[0][1]) + 100
    mm.write("s", 0, 0, b"pageable")  # not pinned: synchronous copy
    assert drv.names()[-1] == "cuMemcpyHtoD"
    mm.close()
    assert not drv.maps
    assert drv.names().count("cuMemRelease") == 8


def test_missing_cuda_python_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def fake_import(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("cuda"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(CudaError, match=r"pip install 'warmserve\[cuda\]'"):
        cuda_mod.import_driver()
