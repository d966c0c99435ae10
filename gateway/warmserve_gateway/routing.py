"""Which serving instance gets a request: least outstanding requests, with room (pure).

An instance has *room* while the requests this gateway replica has outstanding there are fewer
than the deployment's ``maxBatchSize`` (B of Eq. 5-6: what one instance serves at once).
Among instances with room the one with the fewest outstanding requests wins (the simulator's
gateway uses the same rule, :mod:`warmserve.sim.core`); ties are broken at random so that
several gateway replicas, which do not see each other's counts, spread their requests.  An
instance that just failed (refused a connection, or sent no first byte within the time-to-first-
byte limit) is *ejected* for a moment: it gets nothing until then.  Consecutive failures double
the moment (:meth:`Endpoint.ejection_s`, like Envoy's outlier detection), so a hung engine is
not handed a request, and a client a full time-to-first-byte wait, every few seconds.

Deviation from a global least-outstanding rule: each replica counts only its own requests, so
with R replicas an instance may get up to R·B at once; the engine then queues the surplus
itself (and reports it as waiting, which the operator counts as load either way).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from yarl import URL


@dataclass(slots=True)
class Endpoint:
    """One serving instance of a model, as this gateway replica sees it."""

    instance_id: str
    url: str  # engine base URL, e.g. http://10.0.0.7:41234
    outstanding: int = 0  # requests this replica forwarded there and not yet finished
    ejected_until: float = 0.0  # monotonic time before which it gets no new request
    failures: int = 0  # consecutive failures (reset by an answer)
    _urls: dict[str, URL] = field(default_factory=dict, repr=False)

    def target(self, path_qs: str) -> URL:
        """``url + path_qs`` as a parsed URL, cached per path (parsing costs per request)."""
        u = self._urls.get(path_qs)
        if u is None:
            if len(self._urls) > 64:
                self._urls.clear()
            u = self._urls[path_qs] = URL(self.url + path_qs, encoded=True)
        return u

    def ejection_s(self, base_s: float, max_s: float) -> float:
        """Count one more failure; how long it ejects: ``base_s`` doubled per consecutive
        failure, at most ``max(max_s, base_s)``."""
        self.failures += 1
        return min(max(max_s, base_s), base_s * 2.0 ** min(self.failures - 1, 30))


def has_room(ep: Endpoint, max_batch: int, now: float) -> bool:
    return ep.outstanding < max_batch and ep.ejected_until <= now


def pick(
    endpoints: Iterable[Endpoint],
    max_batch: int,
    now: float,
    avoid: frozenset[str] = frozenset(),
    rand: Callable[[], float] = random.random,
) -> Endpoint | None:
    """The endpoint with room and the fewest outstanding requests (random among equals), or
    ``None`` when none has room.  Endpoints in ``avoid`` (instance ids) are taken only when no
    other has room (a retry goes elsewhere when it can)."""
    best: Endpoint | None = None
    best_key = (2, 0, 0.0)
    for ep in endpoints:
        if not has_room(ep, max_batch, now):
            continue
        key = (1 if ep.instance_id in avoid else 0, ep.outstanding, rand())
        if best is None or key < best_key:
            best, best_key = ep, key
    return best
