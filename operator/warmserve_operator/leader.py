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
(default 10 s; with the default 5 s poll a handover completes within 15 s), not kopf's peering
lifetime (issue 16 measured 52.9 s); and two replicas never both hold it: every write carries
the read ``resourceVersion``, so a conflicting write loses.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

PRIORITY_ANNOTATION = "warmserve.io/priority"
PREEMPT_ANNOTATION = "warmserve.io/preempt-by"
DEFAULT_LEASE_S = 10.0


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


def _micro(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _unix(value: Any) -> float:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()
    if not value:
        return 0.0
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


async def hold_lease(
    coord: Any,
    api_exception: type[Exception],
    run: Callable[..., Any],
    namespace: str,
    name: str,
    me: str,
    priority: int,
    duration_s: float,
    manager: str,
) -> bool:
    """One round of :func:`next_lease` against the Lease ``namespace/name`` (``coord``: a
    ``CoordinationV1Api``; ``run``: runs a blocking client call off the event loop)."""
    from kubernetes import client

    try:
        obj = await run(coord.read_namespaced_lease, name, namespace)
    except api_exception as exc:
        if getattr(exc, "status", None) != 404:
            raise
        obj = None
    rec = None
    if obj is not None:
        ann = obj.metadata.annotations or {}
        rec = LeaseRecord(
            obj.spec.holder_identity or "",
            _unix(obj.spec.renew_time),
            float(obj.spec.lease_duration_seconds or duration_s),
            int(ann.get(PRIORITY_ANNOTATION, "0") or 0),
            ann.get(PREEMPT_ANNOTATION, ""),
            obj.metadata.resource_version or "",
        )
    now = dt.datetime.now(dt.UTC).timestamp()
    leader, write = next_lease(rec, me, priority, now, duration_s)
    if write is None:
        return leader
    body = client.V1Lease(
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=namespace,
            resource_version=write.resource_version or None,
            annotations={
                PRIORITY_ANNOTATION: str(write.priority),
                PREEMPT_ANNOTATION: write.preempt_by,
            },
            labels={"app.kubernetes.io/managed-by": manager},
        ),
        spec=client.V1LeaseSpec(
            holder_identity=write.holder,
            lease_duration_seconds=int(max(write.duration_s, 1)),
            renew_time=_micro(write.renew_s) if write.holder else None,
        ),
    )
    try:
        if obj is None:
            await run(coord.create_namespaced_lease, namespace, body)
        else:
            await run(coord.replace_namespaced_lease, name, namespace, body)
    except api_exception as exc:
        if getattr(exc, "status", None) in (404, 409):
            return False  # another replica wrote first: it leads this round
        raise
    return leader
