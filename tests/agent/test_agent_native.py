"""The native slot allocator builds without CUDA and allocates inside its region only."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmserve_agent.native import SlotAllocator, build

BASE = 0x7F00_0000_0000  # never dereferenced: the allocator only does address arithmetic


@pytest.fixture(scope="module")
def alloc(tmp_path_factory: pytest.TempPathFactory) -> SlotAllocator:
    lib = build(tmp_path_factory.mktemp("native"))
    assert lib.is_file() and build(lib.parent) == lib  # cached by source hash
    return SlotAllocator(lib)


def test_alloc_free_coalesce(alloc: SlotAllocator) -> None:
    dev = 1
    assert alloc.set_region(dev, BASE, 4096)
    a = alloc.malloc(100, dev)
    b = alloc.malloc(1000, dev)
    c = alloc.malloc(256, dev)
    assert (a, b, c) == (BASE, BASE + 256, BASE + 256 + 1024)
    assert alloc.used(dev) == 256 + 1024 + 256
    assert alloc.malloc(4096, dev) is None  # no room: NULL, torch raises OOM
    alloc.free(b, dev)
    alloc.free(a, dev)  # coalesces with b's block
    assert alloc.malloc(1280, dev) == BASE
    assert not alloc.set_region(dev, BASE, 8192), "refuse to move a region with live blocks"


def test_shrink_only_past_live_blocks(alloc: SlotAllocator) -> None:
    dev = 2
    assert alloc.set_region(dev, BASE, 1 << 20)
    p = alloc.malloc(600 * 1024, dev)
    assert not alloc.shrink(dev, 512 * 1024), "a live block reaches past the new end"
    assert alloc.shrink(dev, 700 * 1024)
    assert alloc.malloc(200 * 1024, dev) is None
    alloc.free(p, dev)
    assert alloc.shrink(dev, 64 * 1024)
    assert alloc.malloc(64 * 1024, dev) == BASE
    assert alloc.malloc(1, dev) is None


def test_bad_arguments(alloc: SlotAllocator) -> None:
    assert not alloc.set_region(99, BASE, 10)
    assert not alloc.set_region(3, BASE + 1, 4096), "base must be 256-byte aligned"
    assert alloc.malloc(16, 63) is None  # no region set
    assert alloc.malloc(0, 1) is None


def test_source_is_in_tree() -> None:
    from warmserve_agent import native

    assert Path(__file__).resolve().parents[2] / "agent/native/slot_allocator.c" == native.SOURCE
