"""The loop's Lease (``coordination.k8s.io/v1``): the pure rule of one round (:func:`next_lease`,
:func:`released`) and its reads and writes against the API (:func:`hold_lease`,
:func:`release_lease`).  Why the rule is what it is, the fence and the fencing tokens:
:mod:`.leader`, which runs these rounds.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from warmserve.api.agent.fencing import fencing_token

PRIORITY_ANNOTATION = "warmserve.io/priority"
PREEMPT_ANNOTATION = "warmserve.io/preempt-by"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str
    renew_s: float  # unix seconds of the last renewal
    duration_s: float
    priority: int = 0
    preempt_by: str = ""
    resource_version: str = ""
    transitions: int = 0  # spec.leaseTransitions: the holder's term
    created_s: int = 0  # metadata.creationTimestamp (unix seconds; 0: not created yet)

    @property
    def token(self) -> int:
        """The fencing token of the term this record names (:func:`fencing_token`)."""
        return fencing_token(self.created_s, self.transitions)

    def expired(self, now: float) -> bool:
        return not self.holder or self.renew_s + self.duration_s < now


def next_lease(
    rec: LeaseRecord | None, me: str, priority: int, now: float, duration_s: float
) -> tuple[bool, LeaseRecord | None]:
    """(leader after writing, the record to write or ``None`` for no write).  A write that
    starts a term (the Lease was not live and ours) increments ``transitions``."""
    mine = LeaseRecord(me, now, duration_s, priority)
    if rec is None:
        return True, replace(mine, transitions=1)
    new_term = replace(
        mine,
        resource_version=rec.resource_version,
        transitions=rec.transitions + 1,
        created_s=rec.created_s,
    )
    if rec.holder == me:
        if rec.preempt_by and rec.preempt_by != me:
            return False, replace(rec, holder="", preempt_by="")
        if not rec.expired(now):  # a renewal: the same term
            return True, replace(new_term, transitions=rec.transitions)
        return True, new_term
    if rec.expired(now):
        return True, new_term
    if priority > rec.priority and rec.preempt_by != me:
        return False, replace(rec, preempt_by=me)
    return False, None


def released(rec: LeaseRecord | None, me: str) -> LeaseRecord | None:
    """The record a replica that stops writes (client-go's ``ReleaseOnCancel``): the Lease
    emptied if it is still ours, so a standby takes it on its next round instead of waiting for
    it to expire; ``None`` (no write) if another replica holds it or there is none."""
    if rec is None or rec.holder != me:
        return None
    return replace(rec, holder="", preempt_by="")


def _micro(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _unix(value: Any) -> float:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()
    if not value:
        return 0.0
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True, slots=True)
class LeaseTarget:
    """Where a replica's Lease rounds go: ``coord``, a ``CoordinationV1Api``; ``run``, runs a
    blocking client call off the event loop; ``api_exception``, the client's error type; the
    Lease ``namespace/name``; ``manager``, the ``managed-by`` label it carries."""

    coord: Any
    api_exception: type[Exception]
    run: Callable[..., Any]
    namespace: str
    name: str
    manager: str


async def hold_lease(
    target: LeaseTarget,
    me: str,
    priority: int,
    duration_s: float,
    before_release: Callable[[], None] = lambda: None,
) -> tuple[bool | None, int]:
    """One round of :func:`next_lease` against the Lease: (whether we hold it, the fencing
    token of the Lease's term after the round).  None: our write lost a conflict, so who holds
    it is unknown until the next round."""
    obj, rec = await _read_lease(target, duration_s)
    now = dt.datetime.now(dt.UTC).timestamp()
    leader, write = next_lease(rec, me, priority, now, duration_s)
    if write is None:
        return leader, rec.token if rec is not None else 0
    if rec is not None and rec.holder == me and not write.holder:
        before_release()  # stop acting before the asker can take it
    created = await _write_lease(target, obj, write)
    if created is None:
        # Another replica wrote first: a higher priority asking us to hand over (we still hold
        # it) or a taker of an expired Lease (our deadline passed before that).
        return None, 0
    return leader, replace(write, created_s=created).token


async def release_lease(target: LeaseTarget, me: str, duration_s: float) -> bool:
    """Empty the Lease if it is still ours (:func:`released`); True if it was written."""
    obj, rec = await _read_lease(target, duration_s)
    write = released(rec, me)
    if write is None:
        return False
    return await _write_lease(target, obj, write) is not None


async def _read_lease(target: LeaseTarget, duration_s: float) -> tuple[Any, LeaseRecord | None]:
    t = target
    try:
        obj = await t.run(t.coord.read_namespaced_lease, t.name, t.namespace)
    except t.api_exception as exc:
        if getattr(exc, "status", None) != 404:
            raise
        return None, None
    ann = obj.metadata.annotations or {}
    return obj, LeaseRecord(
        obj.spec.holder_identity or "",
        _unix(obj.spec.renew_time),
        float(obj.spec.lease_duration_seconds or duration_s),
        int(ann.get(PRIORITY_ANNOTATION, "0") or 0),
        ann.get(PREEMPT_ANNOTATION, ""),
        obj.metadata.resource_version or "",
        int(getattr(obj.spec, "lease_transitions", 0) or 0),
        _created(obj),
    )


def _created(obj: Any) -> int:
    """``metadata.creationTimestamp`` in unix seconds (0: unknown)."""
    ts = getattr(getattr(obj, "metadata", None), "creation_timestamp", None)
    return int(_unix(ts)) if ts else 0


async def _write_lease(target: LeaseTarget, obj: Any, write: LeaseRecord) -> int | None:
    """Create or replace (with the read ``resourceVersion``); the written Lease's creation time
    (unix seconds); None: another replica wrote first (404/409)."""
    from kubernetes import client

    t = target
    body = client.V1Lease(
        metadata=client.V1ObjectMeta(
            name=t.name,
            namespace=t.namespace,
            resource_version=write.resource_version or None,
            annotations={
                PRIORITY_ANNOTATION: str(write.priority),
                PREEMPT_ANNOTATION: write.preempt_by,
            },
            labels={"app.kubernetes.io/managed-by": t.manager},
        ),
        spec=client.V1LeaseSpec(
            holder_identity=write.holder,
            lease_duration_seconds=int(max(write.duration_s, 1)),
            renew_time=_micro(write.renew_s) if write.holder else None,
            lease_transitions=write.transitions,
        ),
    )
    try:
        if obj is None:
            out = await t.run(t.coord.create_namespaced_lease, t.namespace, body)
        else:
            out = await t.run(t.coord.replace_namespaced_lease, t.name, t.namespace, body)
    except t.api_exception as exc:
        if getattr(exc, "status", None) in (404, 409):
            return None
        raise
    return _created(out) or write.created_s
