"""Which replica runs the loop: a ``coordination.k8s.io/v1`` Lease (issue 11, issue 16).

The loop used to read kopf's internal ``ClusterKopfPeering`` status; now it holds a standard
Lease in the operator's namespace (the one ``kubectl get lease`` shows, like every controller
built on client-go).  kopf's peering still pauses kopf's own handlers on non-leaders; the two
agree because both prefer the live replica with the highest priority.

The rule (:func:`next_lease`, pure, unit-tested):

* no Lease, an empty holder or an expired one (``renewTime + leaseDurationSeconds`` in the
  past): take it;
* held by us: renew it — unless a live replica with a higher priority asked for it
  (``warmserve.io/preempt-by``), then release it (the asker takes it on its next poll);
* held by a live replica with a lower priority: ask it to hand over (``preempt-by``);
* otherwise: wait.

So a replacement with a lower priority than a dead leader waits at most one lease duration
(default 15 s) — not kopf's peering lifetime (issue 16: 52.9 s) — and two replicas never both
hold it: every write carries the read ``resourceVersion``; a conflicting write loses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PRIORITY_ANNOTATION = "warmserve.io/priority"
PREEMPT_ANNOTATION = "warmserve.io/preempt-by"
DEFAULT_LEASE_S = 15.0


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str
    renew_s: float  # unix seconds of the last renewal
    duration_s: float
    priority: int = 0
    preempt_by: str = ""
    resource_version: str = ""

    def expired(self, now: float) -> bool:
        return not self.holder or self.renew_s + self.duration_s < now


def next_lease(
    rec: LeaseRecord | None, me: str, priority: int, now: float, duration_s: float
) -> tuple[bool, LeaseRecord | None]:
    """(leader after writing, the record to write or ``None`` for no write)."""
    mine = LeaseRecord(me, now, duration_s, priority)
    if rec is None:
        return True, mine
    if rec.holder == me:
        if rec.preempt_by and rec.preempt_by != me:
            return False, replace(rec, holder="", preempt_by="")
        return True, replace(mine, resource_version=rec.resource_version)
    if rec.expired(now):
        return True, replace(mine, resource_version=rec.resource_version)
    if priority > rec.priority and rec.preempt_by != me:
        return False, replace(rec, preempt_by=me)
    return False, None
