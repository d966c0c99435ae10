"""Proactive prewarming: how much of a grace instance's KV memory may be lent (§4.1, Eq. 1).

For a grace-period instance with R requests in flight, max batch C, KV capacity M and K bytes
of KV in use, the memory to keep reserved for its own KV cache is

    Reservation Target = max(M * R / C, K + M / C)                        (Eq. 1)

the larger of the share its requests would use at average size and what they use now plus one
average request's worth of headroom.  Everything above the target (rounded down to whole
2 MiB pages, since memory moves between slots page by page) may be lent to prewarm other models.

Deviation: the target is capped at M (the formula can exceed M when K is close to M, and a
reservation larger than the cache is meaningless); lendable memory is therefore never negative.
"""

from __future__ import annotations

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
