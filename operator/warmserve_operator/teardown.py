"""Deleting a ModelDeployment: the finalizer's work.

Called from the kopf delete handler; the handler retries while anything is left, so the object
goes only once nothing of it remains on any agent.  Only what the agents recorded with the
deployment's UID is touched (a duplicate owns nothing).  Serving instances drain through a
grace period first (the agent refuses to end a serving instance) and end once idle or after
``max_grace_s``: a deletion finishes within the grace period plus a few retries.  An agent the
loop declared lost is skipped: what it still holds has no live owner once the deployment is
gone, and orphan removal ends it when the agent is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from warmserve.api.crd import ModelDeploymentSpec
from warmserve.control.decisions import EndGrace

from .act import Actor, call
from .actions import action, describe
from .agents import AgentPool, AgentPort
from .identity import teardown as teardown_decisions
from .observe import NodeRuntime, Observer
from .ports import KubePort
from .snapshot import AgentCallError, NodeSnapshot


class Reconciler(Protocol):
    """What the teardown uses of the loop (:class:`.reconciler.Reconciler`)."""

    cfg: Any
    kube: KubePort
    agents: AgentPool
    actor: Actor
    observer: Observer
    clock: Callable[[], float]
    deleting: dict[str, float]
    grace_started: dict[str, float]

    def note_grace(self, snap: NodeSnapshot, now: float) -> set[str]: ...


log = logging.getLogger("warmserve.operator")


async def teardown(rec: Reconciler, md: ModelDeploymentSpec, timeout_s: float = 30.0) -> list[str]:
    """Remove what ``md`` owns; return what is left (empty: done)."""
    uid = md.uid
    rec.deleting[uid] = math.inf
    # Let prewarms/starts of this deployment already in flight land first, so none finishes
    # after the teardown and leaves a slot behind.
    deadline = rec.clock() + timeout_s
    while rec.clock() < deadline and rec.actor.pending_of(uid):
        await asyncio.sleep(0.1)
    await rec.observer.load_nodes()
    left: list[str] = []
    max_grace = rec.cfg.autoscaler.max_grace_s
    for rt in list(rec.observer.nodes.values()):
        if rt.lost:
            continue
        client = rec.agents.get(rt.spec.name, rt.spec.address)
        try:
            left += await _node(rec, uid, rt, client, timeout_s, max_grace)
        except (AgentCallError, TimeoutError, OSError) as exc:
            left.append(f"{rt.spec.name}: agent unreachable ({exc})")
    if not left:
        try:
            await rec.kube.delete_history(uid)
        except Exception as exc:
            log.warning("event=history_delete_failed model=%s error=%r", md.model, str(exc))
        rec.deleting[uid] = rec.clock()
    return left


async def _node(
    rec: Reconciler,
    uid: str,
    rt: NodeRuntime,
    client: AgentPort,
    timeout_s: float,
    max_grace: float,
) -> list[str]:
    """A few rounds on one agent: drain, end when idle or grace over, evict slots."""
    name = rt.spec.name
    still: list[str] = []
    for _round in range(3):
        snap = await asyncio.wait_for(client.describe(), timeout=timeout_s)
        rt.snap = snap
        now = rec.clock()
        rec.note_grace(snap, now)
        decisions, still = teardown_decisions(uid, {name: snap}, now, rec.grace_started, max_grace)
        if not decisions:
            break
        for d in decisions:
            if not rec.kube.leading():  # the leader fence (.leader): kopf retries the handler
                still.append(f"{describe(d)}: this replica does not hold the loop's Lease")
                continue
            try:
                if isinstance(d, EndGrace):
                    rec.actor.ended.add(d.instance_id)
                await call(client, action(d, snap))
                log.info("event=teardown_action detail=%r", describe(d))
            except AgentCallError as exc:
                if exc.code != "NOT_FOUND":
                    still.append(f"{describe(d)}: {exc}")
    return still
