"""Load a model's layers from the weight store into a slot, layer by layer (WarmServe §4, §4.2).

The loader maps each layer's pages from the pages promised to the slot at admission
(``MemoryManager.promise``) and hands the memory owner **file ranges**, not bytes: the process
that owns the GPU's memory (its worker, or the agent) reads the safetensors ranges itself into
its staging ring and copies them (``MemoryBackend.load_ranges``).  One layer is
kept in flight: layer L+1 is mapped and issued before the loader waits for layer L's copies, so
mapping, file reads and copies overlap across layer boundaries (the §4.2 map/copy pipeline).

Layers are loaded in order, so "resident layers = N" always means the first N layers; loading can
stop at any N and resume later (the rest of a partially prewarmed model loads while the instance
already serves).  ``on_layer`` runs only after a layer's copies have landed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.store import SlotLayout, WeightStore


class LoadCancelled(Exception):
    """The slot was evicted (or the agent is stopping) while loading."""


@dataclass
class LoadReport:
    layers_loaded: int
    bytes_loaded: int  # per GPU
    seconds: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (per GPU)."""
        return 0.0 if self.seconds <= 0 else self.bytes_loaded / self.seconds


def layer_ranges(layout: SlotLayout, layer: int, rank: int) -> list[tuple[int, str, int, int]]:
    """``(slot offset, file, file offset, nbytes)`` of rank's shards of one layer's tensors (a
    row-parallel shard is one range per row, concatenated in the slot)."""
    out = []
    for pl in layout.layer_placements(layer):
        at = pl.slot_offset
        for s, n in pl.ranges(rank):
            if n:
                out.append((at, str(pl.tensor.file), pl.tensor.offset + s, n))
                at += n
    return out


def load_layers(
    mm: MemoryManager,
    store: WeightStore,
    slot_id: str,
    layout: SlotLayout,
    gpus: Sequence[int],
    start_layer: int,
    end_layer: int,
    *,
    cancel: threading.Event | None = None,
    on_layer: Callable[[int, int, float], None] | None = None,
) -> LoadReport:
    """Copy layers [start_layer, end_layer) of ``layout`` into ``slot_id`` on ``gpus``.

    ``on_layer(layers_resident, bytes_loaded_per_gpu, seconds)`` runs after each layer lands.
    Raises :class:`LoadCancelled` if ``cancel`` is set between layers; copies already issued
    are waited for first, so nothing is in flight into pages the caller may unmap.
    """
    if len(gpus) != layout.tp:
        raise ValueError(f"layout is for {layout.tp} GPUs, got {len(gpus)}")
    t0 = time.perf_counter()
    loaded = 0
    page = mm.page_bytes
    # Tensor-parallel ranks load concurrently (each GPU's owner reads its own shards).
    pool = ThreadPoolExecutor(len(gpus), thread_name_prefix="load") if len(gpus) > 1 else None
    pending: deque[tuple[int, int, list[tuple[int, int]]]] = deque()

    def issue(layer: int) -> list[tuple[int, int]]:
        def one(rank: int, gpu: int) -> tuple[int, int]:
            return gpu, mm.load(slot_id, gpu, layer_ranges(layout, layer, rank))

        if pool is None:
            return [one(0, gpus[0])]
        futs = [pool.submit(one, r, g) for r, g in enumerate(gpus)]
        done = [f.result() for f in futs if f.exception() is None]
        errors = [exc for f in futs if (exc := f.exception()) is not None]
        if errors:  # the ranks that did issue must land before the caller unmaps
            for gpu, ticket in done:
                with contextlib.suppress(Exception):
                    mm.wait_loaded(gpu, ticket)
            raise errors[0]
        return done

    def finish() -> None:
        nonlocal loaded
        layer, nbytes, tickets = pending.popleft()
        for gpu, ticket in tickets:
            mm.wait_loaded(gpu, ticket)
        loaded += nbytes
        if on_layer is not None:
            on_layer(layer + 1, loaded, time.perf_counter() - t0)

    try:
        for layer in range(start_layer, end_layer):
            if cancel is not None and cancel.is_set():
                raise LoadCancelled(slot_id)
            mm.ensure_mapped(slot_id, pages_for(layout.bytes_for_layers(layer + 1), page))
            nbytes = sum(pl.shard_bytes for pl in layout.layer_placements(layer))
            pending.append((layer, nbytes, issue(layer)))
            if len(pending) > 1:
                finish()
        while pending:
            finish()
    finally:
        for _, _, tickets in pending:  # an error or cancel: let issued copies land first
            for gpu, ticket in tickets:
                with contextlib.suppress(Exception):  # a dead worker has nothing in flight
                    mm.wait_loaded(gpu, ticket)
        if pool is not None:
            pool.shutdown(wait=True)
    return LoadReport(end_layer - start_layer, loaded, time.perf_counter() - t0)


def verify_layers(
    read: Callable[[int, int, int], bytes],
    layout: SlotLayout,
    digests_by_rank: Sequence[Sequence[bytes]],
    ranks: Sequence[int],
    upto_layer: int,
    from_layer: int = 0,
) -> list[str]:
    """Names of tensors in layers [from_layer, upto_layer) whose bytes differ from the digests.

    ``read(rank, offset, nbytes)`` reads the slot of ``rank``.  Used by the engine (it verifies
    the weights it was handed) and by agent recovery after a restart.
    """
    import hashlib

    bad = []
    for i, pl in enumerate(layout.placements):
        if not (from_layer <= pl.tensor.layer < upto_layer):
            continue
        for rank in ranks:
            data = read(rank, pl.slot_offset, pl.shard_len(rank))
            if hashlib.blake2b(data, digest_size=16).digest() != digests_by_rank[rank][i]:
                bad.append(f"{pl.tensor.name}[rank {rank}]")
    return bad
