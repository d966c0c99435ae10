"""Page tables over the simulated backend: mapping, promises, invariants, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmserve_agent.backends.simulated import PhysicalReader, SimulatedBackend
from warmserve_agent.memory import MemoryManager, OutOfPages, PageTableError

P = 4096


@pytest.fixture
def mm(tmp_path: Path):
    m = MemoryManager(SimulatedBackend(tmp_path / "g", page_bytes=P))
    m.add_gpu(0, 16 * P)
    m.add_gpu(1, 16 * P)
    yield m
    m.close()
    assert not (tmp_path / "g").exists(), "simulated GPU files must be removed on close"


def test_map_write_read_roundtrip_and_shared_file(mm: MemoryManager, tmp_path: Path) -> None:
    mm.create_slot("s", [0, 1])
    mm.map_range("s", 0, 3)
    data = bytes(range(256)) * 40  # crosses page boundaries
    mm.write("s", 1, 100, data)
    assert mm.read("s", 1, 100, len(data)) == data
    # Another process would read the same bytes through the physical page list.
    reader = PhysicalReader(tmp_path / "g" / "gpu1.mem", P)
    assert reader.read(mm.physical_pages("s", 1, 0, 3), 100, len(data)) == data
    reader.close()
    mm.check()


def test_no_page_mapped_twice_and_free_on_destroy(mm: MemoryManager) -> None:
    mm.create_slot("a", [0])
    mm.create_slot("b", [0])
    mm.map_range("a", 0, 10)
    mm.map_range("b", 0, 6)
    assert mm.free_pages(0) == 0
    assert set(mm.physical_pages("a", 0, 0, 10)).isdisjoint(mm.physical_pages("b", 0, 0, 6))
    with pytest.raises(OutOfPages, match="gpu 0: 1 pages needed"):
        mm.map_range("b", 6, 1)
    mm.check()
    assert mm.destroy_slot("a") == 10
    assert mm.free_pages(0) == 10
    mm.check()


def test_refusals_change_nothing(mm: MemoryManager) -> None:
    mm.create_slot("a", [0, 1])
    mm.create_slot("x", [1])
    mm.map_range("x", 0, 10)  # GPU 1 has 6 pages left
    before = (mm.free_pages(0), mm.free_pages(1))
    with pytest.raises(OutOfPages):
        mm.map_range("a", 0, 8)  # fits GPU 0, not GPU 1: all-or-nothing
    assert (mm.free_pages(0), mm.free_pages(1)) == before
    assert mm.mapped_count("a", 0) == 0
    mm.map_range("a", 0, 2)
    with pytest.raises(PageTableError, match="already mapped"):
        mm.map_range("a", 1, 2)
    with pytest.raises(PageTableError, match="not mapped"):
        mm.write("a", 0, 2 * P - 1, b"xy")
    mm.check()


def test_promise_reserves_pages_for_lazy_mapping(mm: MemoryManager) -> None:
    mm.create_slot("load", [0])
    mm.promise("load", 12)
    assert mm.available_pages(0) == 4 and mm.free_pages(0) == 16
    mm.create_slot("other", [0])
    with pytest.raises(OutOfPages):
        mm.map_range("other", 0, 5)
    mm.map_range("other", 0, 4)
    assert mm.ensure_mapped("load", 5) == 5  # consumes the promise
    assert mm.promised("load") == 7
    mm.check()
    mm.release_promise("load")
    assert mm.available_pages(0) == 7
    mm.check()


def test_unmap_tail_returns_pages(mm: MemoryManager) -> None:
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 3)
    assert mm.map_all_free("s", 3) == 13
    assert mm.free_pages(0) == 0
    assert mm.unmap_range("s", 10, 100) == 6
    assert mm.mapped_prefix("s", 0) == 10 and mm.free_pages(0) == 6
    mm.check()


def test_check_detects_corruption(mm: MemoryManager) -> None:
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 2)
    mm._gpus[0].free.append(mm.physical_pages("s", 0, 0, 1)[0])  # simulate a bug
    with pytest.raises(PageTableError):
        mm.check()


def test_sparse_backing_does_not_cost_ram(tmp_path: Path) -> None:
    b = SimulatedBackend(tmp_path / "big", page_bytes=2 * 1024**2)
    n = b.open_gpu(0, 80 * 1024**3)
    assert n == 40960
    st = (tmp_path / "big" / "gpu0.mem").stat()
    assert st.st_size == 80 * 1024**3 and st.st_blocks * 512 < 1024**2
    b.close()
