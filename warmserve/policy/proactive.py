"""Proactive prewarming: how much of a grace instance's KV memory may be lent (§4.1, Eq. 1).

For a grace-period instance with R requests in flight, max batch C, KV capacity M and K bytes
of KV in use, the memory to keep reserved for its own KV cache is

    Reservation Target = max(M * R / C, K + M / C)                        (Eq. 1)

the larger of the share its requests would use at average size and what they use now plus one
average request's worth of headroom.  Everything above the target (rounded down to whole
2 MiB pages, since memory moves between slots page by page) may be lent to prewarm other models.

Deviation: the target is capped at M (the formula can exceed M when K is close to M, and a
reservation larger than the cache is meaningless); lendable memory is therefore never negative.

Growing lent KV back (the agent, on a request that needs more KV than a grace instance kept):
:func:`grace_reservation` adds the waiting requests' need to Eq. 1, and :func:`reclaim_layers`
picks the prewarmed layers to evict for it.  The simulator uses Eq. 1 only (its grace instances
get no new requests), so its results do not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from warmserve.policy.cluster import PAGE_BYTES, PolicyInputError


def reservation_target(running: int, max_batch: int, kv_capacity: int, kv_used: int) -> int:
    """Eq. 1, in bytes, capped at the KV capacity M."""
    if max_batch < 1:
        raise PolicyInputError(f"max_batch (C) must be >= 1, got {max_batch}")
    if running < 0 or kv_capacity < 0 or kv_used < 0:
        raise PolicyInputError("running (R), kv_capacity (M) and kv_used (K) must be >= 0")
    if kv_used > kv_capacity:
        raise PolicyInputError(f"kv_used {kv_used} exceeds kv_capacity {kv_capacity}")
    per_request = kv_capacity / max_batch
    target = max(kv_capacity * min(running, max_batch) / max_batch, kv_used + per_request)
    return int(min(target, kv_capacity))


def lendable_bytes(
    running: int, max_batch: int, kv_capacity: int, kv_used: int, page_bytes: int = PAGE_BYTES
) -> int:
    """KV memory above the reservation target, in whole pages, that prewarming may borrow."""
    if page_bytes < 1:
        raise PolicyInputError("page_bytes must be >= 1")
    surplus = kv_capacity - reservation_target(running, max_batch, kv_capacity, kv_used)
    return max(surplus, 0) // page_bytes * page_bytes


def grace_reservation(
    running: int,
    max_batch: int,
    kv_capacity: int,
    kv_used: int,
    kv_wanted: int = 0,
    kv_kept: int = 0,
) -> int:
    """The KV a grace instance keeps: Eq. 1, or more when requests wait for KV it lent.

    Eq. 1 assumes a grace instance gets no new requests; one that still arrives (routing lag)
    and finds ``kv_wanted`` bytes too few in the ``kv_kept`` bytes the instance kept raises the
    reservation to ``kv_kept + kv_wanted``, so the lent KV grows back (§4.1: too little KV
    "forcing the eviction of the recently loaded weights").  Capped at M like Eq. 1; Eq. 1
    itself when nothing waits."""
    if kv_wanted < 0 or kv_kept < 0:
        raise PolicyInputError(f"kv_wanted and kv_kept must be >= 0, got {kv_wanted}, {kv_kept}")
    target = reservation_target(running, max_batch, kv_capacity, kv_used)
    if kv_wanted == 0:
        return target
    return int(min(max(target, kv_kept + kv_wanted), kv_capacity))


@dataclass(frozen=True)
class Borrower:
    """A prewarm slot on a grace instance's GPUs, holding pages the instance lent.

    ``pages_by_layers[n]`` is the pages (per GPU) the slot holds with its first ``n`` layers,
    for ``n`` up to the layers it holds or loads; ``gpus`` its GPU group."""

    slot: str
    gpus: frozenset[int]
    pages_by_layers: tuple[int, ...]


def reclaim_layers(
    short: Mapping[int, int], borrowers: Sequence[Borrower]
) -> list[tuple[str, int]]:
    """Which prewarmed layers to evict so every GPU ``g`` gets ``short[g]`` pages back.

    ``borrowers`` are in admission order.  The most recently admitted goes first — the paper
    names "the eviction of the recently loaded weights" as the price of lending too much — and
    from its last layer backwards, so what stays of it is still a valid partial prewarm (a
    prefix of layers, §4.1); a borrower on no short GPU is left alone.  Returns ``(slot, layers
    kept)`` per borrower touched, in eviction order, stopping as soon as no GPU is short (it
    may be short still if the borrowers hold too little)."""
    left = {g: n for g, n in short.items() if n > 0}
    plan: list[tuple[str, int]] = []
    for b in reversed(borrowers):
        if not any(left.get(g, 0) > 0 for g in b.gpus):
            continue
        if not b.pages_by_layers:
            continue
        top = len(b.pages_by_layers) - 1
        held = b.pages_by_layers[top]
        keep = top
        while keep > 0 and any(left.get(g, 0) > held - b.pages_by_layers[keep] for g in b.gpus):
            keep -= 1
        freed = held - b.pages_by_layers[keep]
        if keep == top or freed <= 0:
            continue
        for g in b.gpus:
            if g in left:
                left[g] -= freed
        plan.append((b.slot, keep))
        if all(n <= 0 for n in left.values()):
            break
    return plan
