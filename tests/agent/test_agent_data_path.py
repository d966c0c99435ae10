"""The weight data path: file ranges -> staging ring -> slot, in the process owning the memory.

* With memory owned by the GPU workers, weights never cross the worker pipe: only
  ``(address, file, offset, length)`` descriptors do, measured on the pipe.
* The complete GPU path — ``CudaBackend`` inside worker processes, pinned ring, non-blocking
  stream, the engine verifying its slot by virtual address — runs here against the fake driver
  (``warmserve_agent.fake_cuda``, imported by the workers), so every driver misuse it models
  fails.
* The staging ring's planning and its errors.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import PAGE, MiB
from warmserve_agent.backends.staging import (
    FileRange,
    LoadError,
    StagingRing,
    SyncCopyTarget,
    copy_runs,
    plan_chunks,
)
from warmserve_agent.backends.workers import WorkerMemoryBackend
from warmserve_agent.engine_host import WorkerEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.store import WeightStore
from warmserve_agent.worker import WorkerPool, timeout_for_bytes


class PipeMeter:
    """Counts what the agent pickles onto each worker's pipe, per command/memory op."""

    def __init__(self, pool: WorkerPool) -> None:
        self.bytes: Counter[str] = Counter()
        for g in pool.gpus:
            conn = pool.worker(g).conn
            real = conn.send

            def send(obj: Any, real: Any = real) -> None:
                cmd, kwargs = obj
                key = f"mem.{kwargs['op']}" if cmd == "mem" else cmd
                self.bytes[key] += len(pickle.dumps(obj))
                real(obj)

            conn.send = send  # type: ignore[method-assign]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def _core(pool: WorkerPool, backend: WorkerMemoryBackend, model_root: Path, mem: int) -> NodeCore:
    return NodeCore(
        MemoryManager(backend),
        WeightStore(model_root),
        dict.fromkeys(pool.gpus, mem),
        lambda group: WorkerEngine(pool, group),
        node_name="dp",
    )


def test_weights_do_not_cross_the_worker_pipe(tmp_path: Path, model_root: Path) -> None:
    pool = WorkerPool([0, 1], spares=0)
    pool.start()
    backend = WorkerMemoryBackend(pool, "simulated", PAGE, directory=str(tmp_path / "mem"))
    core = _core(pool, backend, model_root, 4 * MiB)
    try:
        meter = PipeMeter(pool)
        slot = core.prewarm("alpha", [0, 1])
        slot.loader.join()
        assert slot.state == "ready", slot.message
        weights = slot.layout.model.weight_bytes
        assert "mem.write" not in meter.bytes
        assert meter.bytes["mem.load_ranges"] > 0
        # Descriptors only: a few hundred bytes per tensor against ~0.5 MB of weights.
        assert meter.total < 0.1 * weights, (meter.total, weights, meter.bytes)
        store = core.store
        for p in slot.layout.placements:
            for rank, g in enumerate((0, 1)):
                s, n = p.shard(rank)
                got = core.mm.read(slot.slot_id, g, p.slot_offset, n)
                assert got == bytes(store.host_view(p.tensor)[s : s + n])
        core.check()
    finally:
        core.shutdown()
        core.mm.close()
        pool.close()


def test_cuda_backend_in_workers_end_to_end_with_the_fake_driver(
    tmp_path: Path, model_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prewarm (TP=2) and activate through ``CudaBackend`` in each worker: file ranges read by
    the workers into pinned rings, async copies, the engine verifying both ranks by address."""
    import json
    import urllib.request

    monkeypatch.setenv("WARMSERVE_FAKE_CUDA_DEVICES", "2")
    monkeypatch.setenv("WARMSERVE_FAKE_CUDA_MEM", str(64 * MiB))
    pool = WorkerPool([0, 1], spares=0)
    pool.start()
    backend = WorkerMemoryBackend(
        pool,
        "cuda",
        2 * MiB,
        driver="warmserve_agent.fake_cuda:DRIVER",
        reserve_bytes=8 * MiB,
        staging_chunk_bytes=64 * 1024,
        staging_depth=3,
    )
    core = _core(pool, backend, model_root, 64 * MiB)
    try:
        assert [core.mm.num_pages(g) for g in (0, 1)] == [28, 28]  # (64 - 8) MiB / 2 MiB
        meter = PipeMeter(pool)
        slot = core.prewarm("alpha", [0, 1])
        slot.loader.join()
        assert slot.state == "ready", slot.message
        assert "mem.write" not in meter.bytes
        assert [backend.staging_bytes(g) for g in (0, 1)] == [3 * 64 * 1024] * 2
        inst, _ = core.activate("alpha", [0, 1])
        assert inst.prewarm_hit
        req = urllib.request.Request(
            inst.endpoint + "/v1/completions",
            data=json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2
        core.begin_grace(inst.instance_id)
        core.end_instance(inst.instance_id, evict_weights=True)
        core.check()
    finally:
        core.shutdown()
        core.mm.close()  # each worker closes its backend: rings, stream, handles, context
        pool.close()


def test_plan_chunks_splits_and_packs_in_order() -> None:
    rs = [FileRange(1000, "a", 0, 10), FileRange(2000, "a", 10, 25), FileRange(5000, "b", 0, 3)]
    chunks = plan_chunks(rs, 16)
    flat = [(p.va, p.file_off, p.nbytes) for c in chunks for p in c]
    assert flat == [(1000, 0, 10), (2000, 10, 6), (2006, 16, 16), (2022, 32, 3), (5000, 0, 3)]
    assert all(sum(p.nbytes for p in c) <= 16 for c in chunks)
    assert [[p.buf_off for p in c] for c in chunks] == [[0, 10], [0], [0, 3]]
    # Contiguous on both sides: one copy.
    assert copy_runs(chunks[2]) == [(2022, 0, 3), (5000, 3, 3)]
    merged = plan_chunks([FileRange(0, "a", 0, 8), FileRange(8, "a", 100, 8)], 64)
    assert copy_runs(merged[0]) == [(0, 0, 16)]


def test_ring_reports_unreadable_and_truncated_files(tmp_path: Path) -> None:
    got: dict[int, bytes] = {}
    ring = StagingRing(
        SyncCopyTarget(lambda va, view: got.__setitem__(va, bytes(view))),
        chunk_bytes=4096,
        depth=2,
    )
    f = tmp_path / "w"
    f.write_bytes(b"x" * 100)
    with pytest.raises(LoadError, match="cannot read weights"):
        ring.load([FileRange(0, str(tmp_path / "missing"), 0, 10)])
    with pytest.raises(LoadError, match="file ends at byte 100"):
        ring.load([FileRange(0, str(f), 50, 80)])
    ring.load([FileRange(7, str(f), 90, 10)])
    assert got == {7: b"x" * 10}
    ring.close()
    assert os.path.exists(f)


def test_timeouts_grow_with_the_bytes() -> None:
    assert timeout_for_bytes(0) == 60
    assert timeout_for_bytes(70 * 10**9) == pytest.approx(760)  # 70 GB: not cut at 30 s


def test_closing_memory_a_worker_never_opened_is_a_no_op() -> None:
    """The agent may stop between a worker's replacement and its ``mem_init`` (the monitor's
    ``gpu_restored`` is cancelled): closing that GPU's memory must not fail the shutdown (it
    raised "memory backend not initialised" in CI); any other operation still refuses."""
    from warmserve_agent.worker import WorkerError

    pool = WorkerPool([0], spares=0)
    pool.start()
    try:
        backend = WorkerMemoryBackend(pool, "simulated", PAGE, directory="/nonexistent")
        backend.close()
        with pytest.raises(WorkerError, match=r"not initialised \(mem_init\)"):
            backend.reserve(0, PAGE)
    finally:
        pool.close()
