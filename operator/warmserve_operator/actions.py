"""Agent actions the reconciler decides on, with deterministic request ids.

Decisions are plain values so they can be tested without gRPC, logged, and turned into
Kubernetes Events.  Request ids are derived from *what* is done and the agent state it was
decided from (agent id + generation): a restarted operator that sees the same agent state
decides the same action with the same id, and the agent's idempotency table answers it without
doing the work twice.  A different agent state gives a different id, so a later legitimate
repeat (e.g. prewarming the same model onto the same GPUs after an eviction) is not swallowed.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from warmserve.policy.cluster import ReplicaKind

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


@dataclass(frozen=True, slots=True)
class Prewarm:
    node: str
    model: str
    gpus: tuple[int, ...]
    layers: int  # 0 = all
    kind: ReplicaKind
    rank: int
    score: float
    request_id: str
    owner: str = ""  # the owning ModelDeployment's UID, recorded on the slot by the agent


@dataclass(frozen=True, slots=True)
class Evict:
    node: str
    model: str
    slot_id: str
    gpus: tuple[int, ...]
    reason: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Activate:
    node: str
    model: str
    gpus: tuple[int, ...]
    slot_id: str  # "" = cold start (or let the agent find the resident slot)
    hit: bool
    evicts: tuple[str, ...]  # slot ids of other models the start evicts
    request_id: str
    owner: str = ""  # recorded on the instance and its slot


@dataclass(frozen=True, slots=True)
class BeginGrace:
    node: str
    model: str
    instance_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class EndInstance:
    node: str
    model: str
    instance_id: str
    evict_weights: bool
    reason: str
    request_id: str


Action = Prewarm | Evict | Activate | BeginGrace | EndInstance


def describe(action: Action) -> str:
    """One line a person reads in logs and Events."""
    if isinstance(action, Prewarm):
        layers = "all layers" if action.layers == 0 else f"first {action.layers} layers"
        return (
            f"prewarm {action.kind.value} replica #{action.rank} (score {action.score:.3g}) of "
            f"{action.model} on {action.node} GPUs {list(action.gpus)} ({layers})"
        )
    if isinstance(action, Evict):
        where = f"{action.node} GPUs {list(action.gpus)}"
        return f"evict {action.model} slot {action.slot_id} on {where}: {action.reason}"
    if isinstance(action, Activate):
        how = f"prewarm hit on slot {action.slot_id}" if action.hit else "cold start"
        ev = f", evicting {len(action.evicts)} other slot(s)" if action.evicts else ""
        return f"start {action.model} on {action.node} GPUs {list(action.gpus)} ({how}{ev})"
    if isinstance(action, BeginGrace):
        return f"drain {action.model} instance {action.instance_id} on {action.node} (grace period)"
    return f"end {action.model} instance {action.instance_id} on {action.node}: {action.reason}"
