"""Who owns what on the agents, request ids, and removing what a deployment no longer owns.

* **Ownership**: what belongs to a deployment is what the agents recorded with
  its *UID* as owner (``SlotView.owner`` / ``InstanceView.owner``, set by the Prewarm/Activate
  calls), never what merely has the same model name: a ``DuplicateModel`` deployment owns
  nothing, so deleting it touches nothing.  Slots and instances without an owner (made before
  owners existed) belong to whichever deployment serves their model.
* **Request ids** are deterministic (:func:`request_id`): a restarted operator that sees the
  same agent state decides the same call with the same id, and the agent's idempotency table
  answers it without doing the work twice; a changed agent state gives a new id.
* **Removal drains**: the agent refuses ``EndInstance`` for a serving instance,
  so orphan removal and teardown ``BeginGrace`` first and end the instance (evicting its
  weights) once it is idle or its grace is over (:func:`removal`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from enum import StrEnum

from warmserve.control.decisions import Decision, Drain, EndGrace, Evict
from warmserve.policy.cluster import InstancePhase

from .snapshot import InstanceView, NodeSnapshot

_BAD = re.compile(r"[^A-Za-z0-9._:-]")
MAX_ID = 128


def request_id(
    verb: str, model: str, node: str, subject: str, agent_id: str, generation: int
) -> str:
    """A request id in the agent's charset ``[A-Za-z0-9._:-]``, at most 128 chars, deterministic."""
    raw = f"{verb}:{model}:{node}:{subject}:{agent_id}:{generation}"
    clean = _BAD.sub("_", raw)
    if len(clean) <= MAX_ID:
        return clean
    digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return f"{clean[: MAX_ID - 17]}-{digest}"


def gpus_str(gpus: tuple[int, ...]) -> str:
    return "g" + ".".join(str(g) for g in gpus)


class Ownership(StrEnum):
    MINE = "mine"  # the model's current owner deployment's (or legacy, unowned)
    FOREIGN = "foreign"  # another live deployment's (e.g. one being deleted): hands off
    ORPHAN = "orphan"  # no live deployment owns it: remove


def ownership(
    model: str, owner: str, owners: Mapping[str, str] | None, live: AbstractSet[str]
) -> Ownership:
    """Whose a slot/instance of ``model`` with agent-recorded ``owner`` UID is.

    ``owners``: model -> UID of the deployment that serves it now (``None``: by model name
    only); ``live``: UIDs of every listed deployment (also duplicates and those being deleted).
    """
    if owners is None or not owner:  # by model name (legacy: no owner recorded)
        return Ownership.MINE if owners is None or model in owners else Ownership.ORPHAN
    if owners.get(model) == owner:
        return Ownership.MINE
    return Ownership.FOREIGN if owner in live else Ownership.ORPHAN


def removal(
    node: str,
    inst: InstanceView,
    reason: str,
    now_s: float,
    grace_started_s: Mapping[str, float],
    max_grace_s: float,
) -> list[Decision]:
    """Remove an instance the way the agent allows: serving -> Drain; grace -> EndGrace
    (evicting its weights) once no request is left or ``max_grace_s`` has passed since its grace
    began (the agent's record, else this operator's first sight); starting -> nothing yet."""
    if inst.phase == InstancePhase.SERVING:
        return [Drain(inst.model, node, inst.gpus, inst.instance_id, reason)]
    if inst.phase != InstancePhase.GRACE:
        return []
    started = inst.grace_started_unix or grace_started_s.get(inst.instance_id, now_s)
    if inst.load > 0 and now_s - started < max_grace_s:
        return []
    return [EndGrace(inst.model, node, inst.gpus, inst.instance_id, reason, evict_weights=True)]


def orphans(
    snaps: Mapping[str, NodeSnapshot],
    owners: Mapping[str, str],
    live: AbstractSet[str],
    now_s: float,
    grace_started_s: Mapping[str, float],
    max_grace_s: float,
) -> list[Decision]:
    """What no listed deployment owns, to remove: failed or orphaned slots, orphan instances
    (through grace), slots naming GPUs the agent does not report, duplicate slots."""
    out: list[Decision] = []
    for node in sorted(snaps):
        snap = snaps[node]
        valid = {g.index for g in snap.gpus}
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for s in sorted(snap.slots, key=lambda s: (s.model, s.gpus, s.slot_id)):
            if s.state == "active":
                continue
            why = ""
            if not s.gpus or not set(s.gpus) <= valid:
                why = "slot names GPUs the agent does not report"
            elif s.state == "failed":
                why = "loading failed"
            elif ownership(s.model, s.owner, owners, live) == Ownership.ORPHAN:
                why = "no ModelDeployment owns this slot"
            elif (s.model, s.gpus) in seen:
                why = "duplicate slot of the same model on the same GPUs"
            seen.add((s.model, s.gpus))
            if why:
                out.append(Evict(s.model, node, s.gpus, s.slot_id, why))
        for inst in snap.instances:
            bad_gpus = not inst.gpus or not set(inst.gpus) <= valid
            if bad_gpus or ownership(inst.model, inst.owner, owners, live) == Ownership.ORPHAN:
                out += removal(
                    node,
                    inst,
                    "no ModelDeployment owns this instance",
                    now_s,
                    grace_started_s,
                    max_grace_s,
                )
    return out


def teardown(
    owner: str,
    snaps: Mapping[str, NodeSnapshot],
    now_s: float,
    grace_started_s: Mapping[str, float],
    max_grace_s: float,
) -> tuple[list[Decision], list[str]]:
    """What deleting the deployment with UID ``owner`` must do now, and what is still there.

    Only slots and instances the agents recorded with this owner are touched (never by model
    name: a duplicate deployment owns nothing).  The second list names everything present, for
    the finalizer's "waiting for ..." message.
    """
    out: list[Decision] = []
    left: list[str] = []
    if not owner:
        return out, left
    for name in sorted(snaps):
        snap = snaps[name]
        for inst in snap.instances:
            if inst.owner != owner:
                continue
            out += removal(
                name, inst, "ModelDeployment deleted", now_s, grace_started_s, max_grace_s
            )
            left.append(
                f"instance {inst.instance_id} of {inst.model} on {name} ({inst.phase.value}, "
                f"{inst.load} request(s) in flight)"
            )
        for s in snap.slots:
            if s.owner == owner and s.state != "active":
                out.append(Evict(s.model, name, s.gpus, s.slot_id, "ModelDeployment deleted"))
                left.append(f"slot {s.slot_id} of {s.model} on {name}")
    return out, left
