"""The cuda backend against the recording fake driver (``warmserve_agent.fake_cuda``).

The fake models contexts, free memory, VMM, asynchronous non-blocking streams, events and pinned
memory, so the tests below fail for code that would misbehave on a GPU (each behaviour the fake
checks has a negative control here showing it does).  Every recorded call is also replayed
against the real ``cuda.bindings`` argument checks.  None of this is a GPU measurement; the same
contracts run on a device with ``hack/gpu-check.sh``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from warmserve_agent.backends import cuda_driver as cuda_mod
from warmserve_agent.backends.cuda import CudaBackend, CudaError
from warmserve_agent.fake_cuda import FakeDriver, replay_against_real
from warmserve_agent.memory import MemoryManager

P = 2 * 1024 * 1024
MiB = 1024**2


def make(drv: FakeDriver, pages: int = 8, reserve: int = 0, **kw: Any) -> MemoryManager:
    mm = MemoryManager(CudaBackend(driver=drv, page_bytes=P, reserve_bytes=reserve, **kw))
    mm.add_gpu(0, pages * P)
    return mm


def test_pool_is_sized_from_free_memory_minus_the_reserve() -> None:
    # 64 MiB card, 10 MiB used by another process, 8 MiB reserve: 46 MiB -> 23 pages, although
    # the card's total (what the agent passes) would be 32 pages.
    drv = FakeDriver(mem_bytes=64 * MiB, used_by_others=10 * MiB)
    mm = make(drv, pages=32, reserve=8 * MiB)
    assert mm.num_pages(0) == 23
    assert drv.names().count("cuMemCreate") == 23
    names = drv.names()
    assert names.index("cuCtxSetCurrent") < names.index("cuMemGetInfo") < names.index("cuMemCreate")
    info = mm.backend.pool_info(0)
    want = {"free_bytes": 54 * MiB, "total_bytes": 64 * MiB, "reserve_bytes": 8 * MiB, "pages": 23}
    assert info == want
    # What is left on the device is the reserve: an engine can still allocate it.
    drv._tls.ctx = drv.primary[0]
    _, free, _ = drv.cuMemGetInfo()
    assert free == 8 * MiB
    mm.close()
    assert not drv.violations and not drv.handles


def test_a_reserve_larger_than_free_memory_is_a_clear_error_and_leaks_nothing() -> None:
    drv = FakeDriver(mem_bytes=16 * MiB, used_by_others=10 * MiB)
    backend = CudaBackend(driver=drv, page_bytes=P, reserve_bytes=8 * MiB)
    with pytest.raises(CudaError, match=r"--gpu-reserve"):
        MemoryManager(backend).add_gpu(0, 16 * MiB)
    assert not drv.handles and drv.ctxs[drv.primary[0]].refs == 0


def test_out_of_memory_while_creating_handles_shrinks_the_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Free memory says 27 pages fit, but another process takes memory after 20 handles: the
    # pool keeps 20 - 4 (the reserve, given back) instead of failing the agent.
    drv = FakeDriver(mem_bytes=64 * MiB, oom_after=20)
    with caplog.at_level(logging.WARNING, "warmserve.agent.cuda"):
        mm = make(drv, pages=32, reserve=8 * MiB)
    assert mm.num_pages(0) == 16 and len(drv.handles) == 16
    assert "event=pool_shrunk" in caplog.text
    mm.close()
    assert not drv.violations


def test_map_then_one_set_access_and_roundtrip() -> None:
    drv = FakeDriver()
    mm = make(drv)
    mm.create_slot("s", [0])
    drv.calls.clear()
    mm.map_range("s", 0, 3)
    assert drv.names() == ["cuCtxSetCurrent", "cuMemMap", "cuMemMap", "cuMemMap", "cuMemSetAccess"]
    va = mm.va_base("s", 0)
    assert drv.calls[-1][1][:2] == (va, 3 * P)
    data = (bytes(range(251)) * 30000)[: 2 * P + 12345]
    mm.write("s", 0, 10, data)
    assert mm.read("s", 0, 10, len(data)) == data
    mm.check()
    mm.close()
    assert not drv.violations


def test_copy_stream_is_non_blocking() -> None:
    drv = FakeDriver()
    mm = make(drv)
    (flags,) = [a[0] for n, a in drv.calls if n == "cuStreamCreate"]
    assert int(flags) == int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
    mm.close()


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


def _weights(tmp_path: Path, nbytes: int, name: str = "w.bin") -> Path:
    f = tmp_path / name
    f.write_bytes(os.urandom(nbytes))
    return f


def test_load_ranges_pipelines_through_a_small_ring(tmp_path: Path) -> None:
    """Many 4 KiB chunks through a 2-buffer ring: a buffer refilled before the copy that reads it
    ran would corrupt the slot (the fake runs copies late, at synchronisation)."""
    drv = FakeDriver()
    mm = make(drv, staging_chunk_bytes=4096, staging_depth=2, staging_readers=2)
    f = _weights(tmp_path, 3 * P)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 4)
    items = [(100, str(f), 0, P + 7), (P + 5000, str(f), P + 7, 2 * P - 7)]
    ticket = mm.load("s", 0, items)
    assert any(st.queue for st in drv.streams.values()), "copies are asynchronous"
    mm.wait_loaded(0, ticket)
    raw = f.read_bytes()
    assert mm.read("s", 0, 100, P + 7) == raw[: P + 7]
    assert mm.read("s", 0, P + 5000, 2 * P - 7) == raw[P + 7 :]
    asyncs = [a for n, a in drv.calls if n == "cuMemcpyHtoDAsync"]
    assert asyncs and all(a[3] is not None for a in asyncs)
    assert not [n for n in drv.names() if n == "cuMemcpyHtoD"], "no synchronous weight copies"
    mm.close()
    assert not drv.violations


def test_negative_control_a_ring_that_does_not_wait_corrupts_the_slot(tmp_path: Path) -> None:
    drv = FakeDriver()
    mm = make(drv, staging_chunk_bytes=4096, staging_depth=2, staging_readers=1)
    f = _weights(tmp_path, P)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 1)
    ring = mm.backend._ring(0)
    ring.target.wait = lambda event: None  # type: ignore[method-assign]
    mm.wait_loaded(0, mm.load("s", 0, [(0, str(f), 0, P)]))
    assert mm.read("s", 0, 0, P) != f.read_bytes()
    ring.target.wait = type(ring.target).wait.__get__(ring.target)  # type: ignore[method-assign]
    mm.close()


def test_negative_control_reading_without_draining_the_stream_sees_stale_bytes(
    tmp_path: Path,
) -> None:
    drv = FakeDriver()
    mm = make(drv)
    f = _weights(tmp_path, 4096)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 1)
    mm.load("s", 0, [(0, str(f), 0, 4096)])  # not waited for
    out = bytearray(4096)
    drv.cuMemcpyDtoH(out, mm.va_base("s", 0), 4096)  # legacy stream: does not wait
    assert bytes(out) == bytes(4096)
    assert mm.read("s", 0, 0, 4096) == f.read_bytes()  # the backend drains first
    mm.close()


def test_pinned_memory_lifetime(tmp_path: Path) -> None:
    """Allocated with the context current, bounded by the ring however many models load, and
    freed before the context is released."""
    drv = FakeDriver(mem_bytes=128 * MiB)
    mm = make(drv, pages=32, staging_chunk_bytes=64 * 1024, staging_depth=3)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 8)
    for i in range(12):  # many different "models"
        f = _weights(tmp_path, 1 * MiB, f"m{i}.bin")
        mm.wait_loaded(0, mm.load("s", 0, [(i * MiB, str(f), 0, MiB)]))
        assert drv.pinned_bytes() == 3 * 64 * 1024 == mm.backend.staging_bytes(0)
    allocs = [i for i, (n, _) in enumerate(drv.calls) if n == "cuMemHostAlloc"]
    assert len(allocs) == 3
    mm.close()
    names = drv.names()
    frees = [i for i, n in enumerate(names) if n == "cuMemFreeHost"]
    assert len(frees) == 3 and max(frees) < names.index("cuDevicePrimaryCtxRelease")
    assert not drv.host and not drv.violations
    # Negative controls: the fake refuses pinned memory without a context and reports a
    # context released under live pinned memory.
    drv2 = FakeDriver()
    assert drv2.cuMemHostAlloc(4096, 0)[0] == drv2.CUresult.CUDA_ERROR_INVALID_CONTEXT
    (dev,) = drv2.cuDeviceGet(0)[1:]
    (ctx,) = drv2.cuDevicePrimaryCtxRetain(dev)[1:]
    drv2.cuCtxSetCurrent(ctx)
    drv2.cuMemHostAlloc(4096, 0)
    with pytest.raises(AssertionError, match="released with 1 pinned"):
        drv2.cuDevicePrimaryCtxRelease(dev)


def test_gpus_open_in_parallel() -> None:
    """Each device's first cuMemCreate waits at a barrier for all four: opening them one after
    another (the old behaviour, shown as the negative control) cannot pass it."""
    drv = FakeDriver(devices=4, create_barrier=threading.Barrier(4, timeout=5))
    mm = MemoryManager(CudaBackend(driver=drv, page_bytes=P, reserve_bytes=0))
    mm.add_gpus(dict.fromkeys(range(4), 4 * P))
    assert [mm.num_pages(g) for g in range(4)] == [4, 4, 4, 4]
    mm.close()
    serial = FakeDriver(devices=2, create_barrier=threading.Barrier(2, timeout=0.5))
    mm2 = MemoryManager(CudaBackend(driver=serial, page_bytes=P, reserve_bytes=0))
    with pytest.raises(threading.BrokenBarrierError):
        for g in range(2):
            mm2.add_gpu(g, 4 * P)


def test_every_driver_call_passes_the_real_bindings_argument_checks(tmp_path: Path) -> None:
    import cuda.bindings  # noqa: F401  (a dev dependency: the real argument checks)

    drv = FakeDriver(devices=2, mem_bytes=64 * MiB)
    mm = MemoryManager(CudaBackend(driver=drv, page_bytes=P, reserve_bytes=MiB))
    mm.add_gpus({0: 64 * MiB, 1: 64 * MiB})
    f = _weights(tmp_path, P)
    mm.create_slot("s", [0, 1])
    mm.map_range("s", 0, 2)
    for g in (0, 1):
        mm.wait_loaded(g, mm.load("s", g, [(3, str(f), 0, P)]))
        mm.write("s", g, 0, b"abc")
        mm.backend.sync(g)
        assert mm.read("s", g, 3, 10) == f.read_bytes()[:10]
    mm.close()
    assert len(set(drv.names())) >= 20
    assert replay_against_real(drv.calls) == []
    # Negative control: an argument the real API refuses is caught.
    assert replay_against_real([("cuCtxSetCurrent", ("ctx0",))])


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


def test_missing_nvidia_driver_is_a_clear_error() -> None:
    import cuda.bindings  # noqa: F401

    if Path("/dev/nvidiactl").exists():  # a GPU machine: the real driver must just work
        CudaBackend().close()
        return
    with pytest.raises(CudaError, match=r"no usable NVIDIA driver.*--simulate-gpus"):
        CudaBackend()
