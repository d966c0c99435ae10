"""Load a model's layers from the weight store into a slot, tensor by tensor (WarmServe §4, §4.2).

The loader maps the slot's pages lazily, just ahead of each copy, from the pages promised to the
slot at admission (``MemoryManager.promise``): the §4.2 pipeline in which a page is mapped and
its copy is issued at once, so mapping latency hides behind the transfers (with the ``cuda``
backend copies from pinned memory are asynchronous on a stream; ``sync`` drains it at the end of
each layer, before the layer is reported resident).

Layers are loaded in order, so "resident layers = N" always means the first N layers; loading can
stop at any N and resume later (the rest of a partially prewarmed model loads while the instance
already serves).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
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
        """Bytes per second over the whole group."""
        return 0.0 if self.seconds <= 0 else self.bytes_loaded / self.seconds


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
    Raises :class:`LoadCancelled` if ``cancel`` is set between tensors.
    """
    if len(gpus) != layout.tp:
        raise ValueError(f"layout is for {layout.tp} GPUs, got {len(gpus)}")
    t0 = time.perf_counter()
    loaded = 0
    sync = getattr(mm.backend, "sync", None)
    page = mm.page_bytes
    for layer in range(start_layer, end_layer):
        for pl in layout.layer_placements(layer):
            if cancel is not None and cancel.is_set():
                raise LoadCancelled(slot_id)
            host = store.host_view(pl.tensor)
            for rank, gpu in enumerate(gpus):
                s, n = pl.shard(rank)
                if n == 0:
                    continue
                mm.ensure_mapped(slot_id, pages_for(pl.slot_offset + n, page))
                mm.write(slot_id, gpu, pl.slot_offset, host[s : s + n])
            loaded += pl.shard_bytes
        if sync is not None:
            for gpu in gpus:
                sync(gpu)
        if on_layer is not None:
            on_layer(layer + 1, loaded, time.perf_counter() - t0)
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
            _, n = pl.shard(rank)
            data = read(rank, pl.slot_offset, n)
            if hashlib.blake2b(data, digest_size=16).digest() != digests_by_rank[rank][i]:
                bad.append(f"{pl.tensor.name}[rank {rank}]")
    return bad
