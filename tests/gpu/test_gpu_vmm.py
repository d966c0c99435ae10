"""CUDA backend contracts on the device (or the fake driver): pool sizing, VMM, the pinned ring,
the non-blocking stream, and a property test of the page tables against the device's bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from warmserve_agent.backends.cuda import CudaBackend
from warmserve_agent.memory import MemoryManager

pytestmark = pytest.mark.gpu

P = 2 * 1024**2
MiB = 1024**2


def _free(backend: CudaBackend, driver: Any) -> int:
    with backend._use(0):
        err, free, _total = driver.cuMemGetInfo()
    assert err == driver.CUresult.CUDA_SUCCESS
    return int(free)


def test_pool_is_sized_from_free_memory_minus_the_reserve(driver: Any) -> None:
    reserve = 256 * MiB
    b = CudaBackend(driver=driver, page_bytes=P, reserve_bytes=reserve)
    mm = MemoryManager(b)
    mm.add_gpus({0: 1 << 50})  # ask for everything: free memory decides
    info = b.pool_info(0)
    pool = info["pages"] * P
    assert info["free_bytes"] - reserve - P < pool <= info["free_bytes"] - reserve
    assert _free(b, driver) >= reserve - 64 * MiB  # the reserve is still there for an engine
    mm.close()


def test_copy_stream_is_non_blocking(driver: Any) -> None:
    b = CudaBackend(driver=driver, page_bytes=P, reserve_bytes=64 * MiB)
    MemoryManager(b).add_gpu(0, 4 * P)
    with b._use(0) as g:
        err, flags = driver.cuStreamGetFlags(g.stream)
    assert err == driver.CUresult.CUDA_SUCCESS
    assert int(flags) & int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
    b.close()


def test_ring_loads_equal_file_bytes_and_pinned_memory_is_bounded_and_freed(
    driver: Any, tmp_path: Path
) -> None:
    b = CudaBackend(
        driver=driver,
        page_bytes=P,
        reserve_bytes=64 * MiB,
        staging_chunk_bytes=MiB,
        staging_depth=3,
    )
    mm = MemoryManager(b)
    mm.add_gpu(0, 64 * P)
    before = _free(b, driver)
    f = tmp_path / "w.bin"
    data = os.urandom(40 * MiB + 123)
    f.write_bytes(data)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 24)
    for k in range(4):  # several loads reuse the ring; pinned memory stays at its size
        off = k * 1000 + 7
        mm.wait_loaded(0, mm.load("s", 0, [(off, str(f), 5 * k, len(data) - 5 * k)]))
        assert b.staging_bytes(0) == 3 * MiB
        assert mm.read("s", 0, off, len(data) - 5 * k) == data[5 * k :]
    mm.destroy_slot("s")
    assert _free(b, driver) >= before - 16 * MiB  # no device memory kept by the loads
    mm.close()  # ring freed before the context is released (the fake checks the order)
    again = MemoryManager(CudaBackend(driver=driver, page_bytes=P, reserve_bytes=64 * MiB))
    again.add_gpu(0, 4 * P)  # the GPU reopens cleanly after a full close
    again.close()


class SlotMachine(RuleBasedStateMachine):
    """Random map/unmap/load/write/read/destroy on three slots; the bytes read back from the
    device must equal what was last written to every still-mapped byte."""

    driver: Any = None
    weights: Path = Path()

    def __init__(self) -> None:
        super().__init__()
        self.mm = MemoryManager(
            CudaBackend(
                driver=self.driver,
                page_bytes=P,
                reserve_bytes=0,
                staging_chunk_bytes=256 * 1024,
                staging_depth=2,
            )
        )
        self.mm.add_gpu(0, 24 * P)
        self.file = self.weights.read_bytes()
        self.known: dict[str, dict[int, int]] = {}  # slot -> {byte offset: value}
        self.mapped: dict[str, int] = {}  # slot -> mapped prefix pages

    def teardown(self) -> None:
        self.mm.close()

    @rule(name=st.sampled_from(["a", "b", "c"]))
    def create(self, name: str) -> None:
        if name not in self.mapped:
            self.mm.create_slot(name, [0])
            self.mapped[name] = 0
            self.known[name] = {}

    @rule(name=st.sampled_from(["a", "b", "c"]), n=st.integers(1, 6))
    def grow(self, name: str, n: int) -> None:
        if name in self.mapped and self.mm.available_pages(0) >= n:
            self.mm.map_range(name, self.mapped[name], n)
            self.mapped[name] += n

    @rule(name=st.sampled_from(["a", "b", "c"]), n=st.integers(1, 6))
    def shrink(self, name: str, n: int) -> None:
        if self.mapped.get(name):
            n = min(n, self.mapped[name])
            self.mapped[name] -= n
            self.mm.unmap_range(name, self.mapped[name], n)
            cut = self.mapped[name] * P
            self.known[name] = {k: v for k, v in self.known[name].items() if k < cut}

    @rule(name=st.sampled_from(["a", "b", "c"]), data=st.data())
    def load(self, name: str, data: st.DataObject) -> None:
        if not self.mapped.get(name):
            return
        size = self.mapped[name] * P
        n = data.draw(st.integers(1, min(size, len(self.file))))
        off = data.draw(st.integers(0, size - n))
        foff = data.draw(st.integers(0, len(self.file) - n))
        self.mm.wait_loaded(0, self.mm.load(name, 0, [(off, str(self.weights), foff, n)]))
        kept = {k: v for k, v in self.known[name].items() if not off <= k < off + n}
        self.known[name] = kept
        for i in range(0, n, 4099):  # sample the bytes we will check (keeps the model small)
            self.known[name][off + i] = self.file[foff + i]
        self.known[name][off + n - 1] = self.file[foff + n - 1]

    @rule(name=st.sampled_from(["a", "b", "c"]), data=st.data())
    def write(self, name: str, data: st.DataObject) -> None:
        if not self.mapped.get(name):
            return
        size = self.mapped[name] * P
        blob = data.draw(st.binary(min_size=1, max_size=512))
        off = data.draw(st.integers(0, size - len(blob)))
        self.mm.write(name, 0, off, blob)
        for i, v in enumerate(blob):
            self.known[name][off + i] = v

    @rule(name=st.sampled_from(["a", "b", "c"]))
    def destroy(self, name: str) -> None:
        if name in self.mapped:
            self.mm.destroy_slot(name)
            del self.mapped[name], self.known[name]

    @invariant()
    def bytes_match(self) -> None:
        for name, known in self.known.items():
            if not known:
                continue
            lo, hi = min(known), max(known) + 1
            got = self.mm.read(name, 0, lo, hi - lo)
            bad = [k for k, v in known.items() if got[k - lo] != v]
            assert not bad, f"slot {name}: {len(bad)} bytes differ, first at {bad[0]}"

    @invariant()
    def tables_consistent(self) -> None:
        self.mm.check()


def test_page_tables_and_device_bytes_agree(driver: Any, mode: str, tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(3 * P))
    SlotMachine.driver, SlotMachine.weights = driver, weights
    run_state_machine_as_test(
        SlotMachine,
        settings=settings(
            max_examples=12 if mode == "real" else 6,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
