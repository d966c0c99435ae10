"""How many Kubernetes Events the operator may post: a token bucket and a bounded backlog.

Events are best effort.  A burst beyond the budget (1,000 deployments placed at once) must not
compete with status writes for the API server, so condition Events over the budget are dropped
(the caller counts them), while lifecycle Events (``Accepted``, ``SpecChanged``) wait in a
backlog and go out as the budget refills.  Pure bookkeeping over a caller's clock readings; no
I/O.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class EventBudget(Generic[T]):
    """``rate`` Events per second at most, in bursts of up to ``burst``; ``backlog`` queued
    Events at most (the oldest is dropped to make room)."""

    def __init__(self, now: float, rate: float, burst: float, backlog: int) -> None:
        if rate <= 0 or burst < 1 or backlog < 1:
            raise ValueError(
                f"event budget needs rate > 0, burst >= 1, backlog >= 1; got {rate}, {burst}, "
                f"{backlog}"
            )
        self.rate = rate
        self.burst = burst
        self.limit = backlog
        self._tokens = float(burst)
        self._refilled = now
        self._queue: deque[T] = deque()

    def take(self, now: float) -> bool:
        """Spend one token if there is one (refilled at ``rate`` since the last reading)."""
        self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def queue(self, item: T) -> bool:
        """Queue ``item``; False when the backlog was full and its oldest Event was dropped."""
        dropped = len(self._queue) >= self.limit
        if dropped:
            self._queue.popleft()
        self._queue.append(item)
        return not dropped

    def drain(self, now: float) -> list[T]:
        """The queued Events the budget allows now, oldest first (removed from the backlog)."""
        out = []
        while self._queue and self.take(now):
            out.append(self._queue.popleft())
        return out

    def __len__(self) -> int:
        return len(self._queue)
