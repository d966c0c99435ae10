"""The slot memory an engine reads: a read racing close must not touch unmapped memory.

The agent's loader thread verifies new layers (``SlotMemory.read``) while node shutdown may stop
the engine (``SlotMemory.close``, an ``munmap``); before the lock, the read went on into the
unmapped range and the agent died with SIGSEGV (seen in CI, tests/agent/test_agent_grpc.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from warmserve_agent.engines import slotmem
from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryError
from warmserve_agent.engines.spec import SlotRegion

PAGE = 4096


def _slot(tmp_path: Path) -> SlotMemory:
    f = tmp_path / "gpu0.mem"
    f.write_bytes(bytes(range(256)) * (4 * PAGE // 256))
    region = SlotRegion(
        gpu=0,
        va=0,
        page_bytes=PAGE,
        weight_bytes=2 * PAGE,
        kv_bytes=PAGE,
        host_file=str(f),
        ppages=(3, 1, 2),
    )
    return SlotMemory(region)


def test_reads_the_slots_pages_in_virtual_order(tmp_path: Path) -> None:
    mem = _slot(tmp_path)
    assert mem.read(0, 4) == bytes([0, 1, 2, 3])  # physical page 3 starts like every page
    assert mem.read(PAGE - 2, 4) == bytes([254, 255, 0, 1])  # across the page boundary
    with pytest.raises(SlotMemoryError, match="outside the slot"):
        mem.read(3 * PAGE - 1, 2)
    mem.close()


def test_a_read_after_close_is_refused_not_remapped(tmp_path: Path) -> None:
    mem = _slot(tmp_path)
    mem.read(0, 8)
    mem.close()
    with pytest.raises(SlotMemoryError, match="closed"):
        mem.read(0, 8)
    mem.close()  # idempotent


def test_close_waits_for_a_read_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mem = _slot(tmp_path)
    mem.read(0, 1)  # map now, so the read below is only the copy
    entered, release = threading.Event(), threading.Event()

    def slow_copy(addr: int, n: int) -> bytes:  # stands for a long copy of a big tensor
        entered.set()
        assert release.wait(10)
        return b"x" * n  # never touches the address: on the old code it is unmapped by now

    monkeypatch.setattr(slotmem.ctypes, "string_at", slow_copy)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(mem.read(0, 16)))
    reader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=mem.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close unmapped the slot while a read was copying from it"
    release.set()
    reader.join(10)
    closer.join(10)
    assert got == [b"x" * 16] and not closer.is_alive()
    with pytest.raises(SlotMemoryError, match="closed"):
        mem.read(0, 1)


def test_a_slot_whose_page_table_is_gone_is_a_typed_engine_error(tmp_path: Path) -> None:
    """An engine built over a slot evicted meanwhile (its page table removed) gets
    ``SlotGone``, an ``EngineError`` (no traceback logged as a failed build), not a bare
    ``FileNotFoundError``."""
    from warmserve_agent.engine import EngineError
    from warmserve_agent.engines.slotmem import SlotGone

    f = tmp_path / "gpu0.mem"
    f.write_bytes(bytes(4 * PAGE))
    region = SlotRegion(
        gpu=0,
        va=0,
        page_bytes=PAGE,
        weight_bytes=2 * PAGE,
        kv_bytes=PAGE,
        host_file=str(f),
        ppages=(3, 1, 2),
        page_table=str(tmp_path / "gpu0-0.pt"),  # removed with the slot
    )
    mem = SlotMemory(region, partial=True)
    with pytest.raises(SlotGone, match="page table is gone") as e:
        mem.host_mapping()
    assert isinstance(e.value, EngineError) and isinstance(e.value, SlotMemoryError)
    mem.close()
