"""KV ranges mapped in the background and unmapped asynchronously (WarmServe §4.2).

* :class:`KvGeometry` (pure): the pages blocks ``[0, t)`` need are exactly the first pages of
  its mapping order (brute force, hypothesis);
* the page tables' deferred unmapping: withdrawn pages count as available, are restored when
  their slot maps them again, and a map that needs them flushes them first;
* with the **recording fake CUDA driver**: the sequence of ``cuMemMap`` / ``cuMemSetAccess`` /
  ``cuMemUnmap`` calls against the capacity the engine was told, over time (one timeline):
  every page of every granted block is mapped with access before the grant, and no page is
  unmapped while a granted block touches it.  The engine double touches every page of its
  capacity through the device after each change, so the fake driver itself refuses an access
  to an unmapped page.  A negative control shows the timeline check catches the wrong order.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warmserve_agent.backends.cuda import CudaBackend
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engines.kv_geometry import KvGeometry
from warmserve_agent.fake_cuda import FakeDriver, replay_against_real
from warmserve_agent.kv_pager import KvPager
from warmserve_agent.kv_range import KvRange
from warmserve_agent.memory import MemoryManager, PageTableError

P = 2 * 1024 * 1024
MiB = 1024**2


# ---- geometry ------------------------------------------------------------------------------
@st.composite
def geometries(draw: st.DrawFn) -> tuple[KvGeometry, int, int]:
    page = draw(st.sampled_from([64, 256, 4096]))
    pages = draw(st.integers(1, 40))
    kv_bytes = pages * page
    nb = draw(st.integers(0, 30))
    segs = []
    for _ in range(draw(st.integers(1, 5))):
        if nb == 0:
            segs.append((draw(st.integers(0, kv_bytes)), draw(st.integers(1, 64))))
            continue
        stride = draw(st.integers(1, max(1, kv_bytes // nb)))
        off = draw(st.integers(0, kv_bytes - nb * stride))
        segs.append((off, stride))
    bb = draw(st.integers(1, 1 << 20))
    return KvGeometry(nb, bb, tuple(segs)), page, pages


@settings(max_examples=300)
@given(geometries(), st.data())
def test_blocks_need_exactly_a_prefix_of_the_mapping_order(
    case: tuple[KvGeometry, int, int], data: st.DataObject
) -> None:
    geo, page, pages = case
    geo.validate(pages * page)
    order, need = geo.page_order(page, pages)
    assert sorted(order) == list(range(pages)) and need == sorted(need)
    t = data.draw(st.integers(0, geo.num_blocks))
    touched = {
        (off + b * stride + i) // page
        for off, stride in geo.segments
        for b in range(t)
        for i in (0, stride - 1)
    } | {
        p
        for off, stride in geo.segments
        for b in range(t)
        for p in range((off + b * stride) // page, (off + (b + 1) * stride - 1) // page + 1)
    }
    k = sum(1 for b in need if b < t)
    assert set(order[:k]) == touched


def test_a_geometry_that_leaves_the_range_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves"):
        KvGeometry(10, 100, ((0, 100), (500, 100))).validate(1000)
    with pytest.raises(ValueError, match="segments"):
        KvGeometry(1, 1, ()).validate(10)
    with pytest.raises(ValueError, match="blocks"):
        KvGeometry(1, 0, ((0, 1),)).validate(10)
    KvGeometry(10, 100, ((0, 50), (500, 50))).validate(1000)


# ---- deferred unmapping in the page tables -------------------------------------------------
def test_withdrawn_pages_are_available_restorable_and_flushed_on_demand(tmp_path: Any) -> None:
    mm = MemoryManager(SimulatedBackend(tmp_path, page_bytes=4096))
    mm.add_gpu(0, 16 * 4096)
    mm.create_slot("a", [0])
    mm.map_range("a", 0, 10)
    assert mm.withdraw("a", range(6, 10)) == 4
    assert mm.free_pages(0) == 6 and mm.available_pages(0) == 10 and mm.pending_pages(0) == 4
    with pytest.raises(PageTableError, match="not mapped"):
        mm.read("a", 0, 7 * 4096, 1)  # nobody may touch a withdrawn page
    assert mm.map_pages("a", [8, 9, 10]) == 1  # 8, 9 restored as they were; 10 mapped
    assert mm.live_vpages("a", 0) == set(range(6)) | {8, 9, 10}
    mm.create_slot("b", [0])
    mm.map_range("b", 0, 7)  # needs the 2 still withdrawn pages: flushed first
    assert mm.pending_pages() == 0 and mm.free_pages(0) == 0
    mm.check()
    held = mm.retire_slot("b")
    assert held == 7 and not mm.has_slot("b") and mm.pending_pages(0) == 7
    mm.check()
    assert mm.flush() == 7 and mm.free_pages(0) == 7
    mm.check()
    mm.close()


# ---- the fake CUDA driver's timeline against the engine's capacity --------------------------
class DeviceEngine:
    """The KV side of an engine on device memory: after every capacity change it touches the
    first and last byte of every page its granted blocks occupy, through the driver (an access
    to a page that is not mapped with access rights is the fake driver's violation), and the
    change is recorded in the driver's call log, so the test reads one timeline."""

    def __init__(self, mm: MemoryManager, drv: FakeDriver, kv_va: int, geo: KvGeometry) -> None:
        self.mm, self.drv, self.kv_va, self.geo = mm, drv, kv_va, geo
        self.capacity = 0

    def pages(self, nbytes: int) -> set[int]:
        t = self.geo.blocks(nbytes)
        order, need = self.geo.page_order(P, 10**6 // P + 64)
        return {p for p, b in zip(order, need, strict=True) if b < t}

    def set_kv_capacity(self, nbytes: int) -> int:
        with self.drv._lock:
            self.drv.calls.append(("capacity", (nbytes,)))
        self.capacity = nbytes
        for p in sorted(self.pages(nbytes)):
            self.mm.backend.write(0, self.kv_va + p * P, b"k")
            self.mm.backend.write(0, self.kv_va + (p + 1) * P - 1, b"v")
        return nbytes


def timeline_violations(
    calls: list[tuple[str, tuple[Any, ...]]], kv_va: int, geo: KvGeometry
) -> list[str]:
    """Replay the driver calls and capacity changes; report every moment a granted block
    touched a page without a mapping and access, or a page was unmapped under one."""
    mapped: set[int] = set()
    access: set[int] = set()
    granted: set[int] = set()
    order, need = geo.page_order(P, 64)
    bad = []
    for name, args in calls:
        if name == "cuMemMap":
            mapped.add(int(args[0]))
        elif name == "cuMemSetAccess":
            va, size = int(args[0]), int(args[1])
            access.update(range(va, va + size, P))
        elif name == "cuMemUnmap":
            va = int(args[0])
            if va in granted:
                bad.append(f"unmapped {va:#x} while the engine may touch it")
            mapped.discard(va)
            access.discard(va)
        elif name == "capacity":
            t = geo.blocks(args[0])
            granted = {kv_va + p * P for p, b in zip(order, need, strict=True) if b < t}
            missing = granted - (mapped & access)
            if missing:
                bad.append(f"granted {t} blocks over {len(missing)} unmapped pages")
    return bad


def _layer_major(layers: int, pages_per_layer: int, blocks: int) -> KvGeometry:
    stride = pages_per_layer * P // blocks
    return KvGeometry(
        blocks, stride * layers, tuple((i * pages_per_layer * P, stride) for i in range(layers))
    )


def _setup(drv: FakeDriver) -> tuple[MemoryManager, int, KvGeometry]:
    mm = MemoryManager(CudaBackend(driver=drv, page_bytes=P, reserve_bytes=0))
    mm.add_gpu(0, 32 * P)
    mm.create_slot("s", [0])
    mm.map_range("s", 0, 2)  # weights
    geo = _layer_major(layers=4, pages_per_layer=6, blocks=12)  # vLLM-like, layer-major
    return mm, mm.va_base("s", 0) + 2 * P, geo


def test_capacity_never_runs_ahead_of_the_mapping_on_the_fake_driver() -> None:
    drv = FakeDriver(mem_bytes=64 * MiB)
    mm, kv_va, geo = _setup(drv)
    eng = DeviceEngine(mm, drv, kv_va, geo)
    kv = KvRange(mm, "s", 2, 24, 1, eng)
    kv.set_geometry(geo)
    mm.promise("s", 24)
    pager = KvPager(mm)
    pager.track(kv)  # maps in the background while "the engine starts"
    kv.ready()
    pager.track(kv)
    assert pager.idle(30)
    assert eng.capacity == geo.capacity(12) and kv.granted == 12
    # lending: capacity first, then the pages no kept block touches, unmapped in the background
    dropped = kv.shrink(3)
    assert dropped == 24 - 4 * 2  # 3 of 12 blocks keep 2 of every layer's 6 pages
    pager.kick()
    assert pager.idle(30)
    assert mm.free_pages(0) == 32 - 2 - 8
    # growing back: mapped before the capacity rises again
    kv.set_target(9)
    pager.track(kv)
    assert pager.idle(30)
    assert kv.granted == 9
    kv.check()
    # the engine stops: nothing may touch the KV any more, then it is unmapped
    eng.set_kv_capacity(0)
    kv.release_all()
    pager.kick()
    assert pager.idle(30)
    pager.close()
    mm.check()
    names = drv.names()
    assert names.count("capacity") >= 4 and "cuMemUnmap" in names
    assert not drv.violations
    assert timeline_violations(drv.calls, kv_va, geo) == []
    assert replay_against_real([c for c in drv.calls if c[0] != "capacity"]) == []
    mm.close()


def test_the_timeline_check_catches_an_unmap_under_a_granted_block() -> None:
    """Negative control: unmapping first and lowering the capacity after is caught."""
    drv = FakeDriver(mem_bytes=64 * MiB)
    mm, kv_va, geo = _setup(drv)
    eng = DeviceEngine(mm, drv, kv_va, geo)
    kv = KvRange(mm, "s", 2, 24, 1, eng)
    kv.set_geometry(geo)
    mm.promise("s", 24)
    kv.ready()
    kv.run_to_completion()
    mm.unmap_range("s", 2 + 5, 1)  # the wrong order: a page of layer 0's last blocks goes
    with pytest.raises(AssertionError, match="CUDA misuse"):
        eng.set_kv_capacity(geo.capacity(12))  # the engine touches it: the driver refuses
    assert any("unmapped" in v for v in timeline_violations(drv.calls, kv_va, geo))
    drv.violations.clear()
    mm.close()


def test_growth_and_lending_race_safely_with_the_pager_thread() -> None:
    """Shrinks and regrowths from another thread while the pager maps: the timeline holds."""
    drv = FakeDriver(mem_bytes=64 * MiB)
    mm, kv_va, geo = _setup(drv)
    eng = DeviceEngine(mm, drv, kv_va, geo)
    kv = KvRange(mm, "s", 2, 24, 1, eng)
    kv.set_geometry(geo)
    mm.promise("s", 24)
    pager = KvPager(mm)
    kv.ready()
    pager.track(kv)
    stop = threading.Event()

    def lender() -> None:
        for i in range(30):
            kv.shrink(i % 5)
            pager.kick()
            kv.set_target(12)
            pager.track(kv)

    t = threading.Thread(target=lender)
    t.start()
    t.join(60)
    stop.set()
    assert pager.idle(30)
    pager.close()
    kv.check()
    assert kv.granted == 12
    assert not drv.violations
    assert timeline_violations(drv.calls, kv_va, geo) == []
    mm.close()
