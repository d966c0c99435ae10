"""Actions: the controller's decisions, each made into one agent call with all it needs.

A decision (:mod:`warmserve.control.decisions`, shared with the simulator) says *what* to do;
an :class:`Action` adds what the operator's call needs to do it: the deterministic request id
(:func:`.identity.request_id`, from the snapshot the decision was made on), the owning
deployment's UID, engine, engine arguments and model source, and whether the node must fetch the
model first.  :func:`actions` builds them from one poll's :class:`~.context.PollContext`, so
the dispatch (:func:`.act.call`) looks nothing up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from warmserve.api.crd import ModelDeploymentSpec
from warmserve.control.decisions import Decision, Drain, EndGrace, Evict, Prewarm, Start

from .context import PollContext
from .identity import gpus_str, request_id
from .ports import ObjRef, md_ref
from .snapshot import NodeSnapshot

VERB = {Start: "activate", Drain: "grace", EndGrace: "end", Prewarm: "prewarm", Evict: "evict"}


def subject(d: Decision) -> str:
    if isinstance(d, Drain | EndGrace):
        return d.instance_id
    if isinstance(d, Evict):
        return d.slot_id
    return gpus_str(d.gpus)


def rid(d: Decision, snap: NodeSnapshot | None) -> str:
    agent_id, gen = (snap.agent_id, snap.generation) if snap else ("", 0)
    return request_id(VERB[type(d)], d.model, d.node, subject(d), agent_id, gen)


def describe(d: Decision) -> str:
    """One line a person reads in logs and Events."""
    where = f"{d.node} GPUs {list(d.gpus)}"
    if isinstance(d, Prewarm):
        layers = "all layers" if d.layers == 0 else f"first {d.layers} layers"
        return (
            f"prewarm {d.kind.value} replica #{d.rank} (score {d.score:.3g}) of {d.model} on "
            f"{where} ({layers})"
        )
    if isinstance(d, Evict):
        return f"evict {d.model} slot {d.slot_id} on {where}: {d.reason}"
    if isinstance(d, Start):
        how = f"prewarm hit on slot {d.slot_id}" if d.hit else "cold start"
        ev = f", evicting {len(d.evicts)} other slot(s)" if d.evicts else ""
        return f"start {d.model} on {where} ({how}{ev})"
    if isinstance(d, Drain):
        return f"drain {d.model} instance {d.instance_id} on {d.node} (grace period)"
    return f"end {d.model} instance {d.instance_id} on {d.node}: {d.reason}"


@dataclass(frozen=True, slots=True)
class Action:
    """One agent call.  ``owner``/``about``: the deployment that owns the decision's model (its
    UID for the agent's records, its object for Events; empty for what no deployment owns);
    ``engine``/``engine_args``/``source``: that deployment's, for a start or a prewarm;
    ``fetching``: a start with a source on a node whose store lacks the model."""

    decision: Decision
    request_id: str
    owner: str = ""
    about: ObjRef | None = None
    engine: str = ""
    engine_args: tuple[str, ...] = ()
    source: str = ""
    fetching: bool = False

    @property
    def node(self) -> str:
        return self.decision.node

    @property
    def verb(self) -> str:
        return VERB[type(self.decision)]


def action(
    d: Decision, snap: NodeSnapshot | None, owner: ModelDeploymentSpec | None = None
) -> Action:
    """``d`` as a call to the agent whose snapshot is ``snap``, for ``owner``."""
    if owner is None or not owner.uid:
        return Action(d, rid(d, snap))
    return Action(
        d,
        rid(d, snap),
        owner.uid,
        md_ref(owner.namespace, owner.name, owner.uid),
        owner.engine,
        owner.engine_args,
        owner.source,
        isinstance(d, Start)
        and bool(owner.source)
        and (snap is None or d.model not in snap.models),
    )


def actions(decisions: Iterable[Decision], ctx: PollContext) -> list[Action]:
    """The poll's decisions as actions; a prewarm or start of a model no deployment owns, or
    whose owner is being torn down, is left out."""
    out = []
    for d in decisions:
        owner = ctx.owner_of(d.model)
        acts_for = owner.uid if owner is not None else ""
        if isinstance(d, Prewarm | Start) and (not acts_for or acts_for in ctx.deleting):
            continue
        out.append(action(d, ctx.snap_of(d.node), owner))
    return out
