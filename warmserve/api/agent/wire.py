"""One home for the agent API's enums and their policy-side values.

The protobuf enums of ``warmserve.agent.v1`` (``WorkerState``, ``SlotState``,
``InstancePhase``) map to :class:`~warmserve.policy.cluster.WorkerState`,
:class:`SlotState` and :class:`~warmserve.policy.cluster.InstancePhase` here and nowhere
else: the agent's service encodes with these tables, the operator and ``warmserve agent
inspect`` decode with them.  ``UNSPECIFIED`` decodes to the safe default (idle, unknown,
starting).
"""

from __future__ import annotations

from enum import StrEnum

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve.policy.cluster import InstancePhase, WorkerState


class SlotState(StrEnum):
    """A prewarm slot's state, as the agent reports it."""

    UNKNOWN = "unknown"
    LOADING = "loading"  # weights being copied in
    READY = "ready"  # the requested layers are resident
    ACTIVE = "active"  # the serving instance's slot (weights + KV cache)
    FAILED = "failed"  # loading failed; evict it


WORKER_TO_PB = {
    WorkerState.IDLE: pb.WORKER_STATE_IDLE,
    WorkerState.UNIVERSAL: pb.WORKER_STATE_UNIVERSAL,
    WorkerState.DEDICATED: pb.WORKER_STATE_DEDICATED,
    WorkerState.GRACE: pb.WORKER_STATE_GRACE,
}
SLOT_TO_PB = {
    SlotState.LOADING: pb.SLOT_STATE_LOADING,
    SlotState.READY: pb.SLOT_STATE_READY,
    SlotState.ACTIVE: pb.SLOT_STATE_ACTIVE,
    SlotState.FAILED: pb.SLOT_STATE_FAILED,
}
PHASE_TO_PB = {
    InstancePhase.STARTING: pb.INSTANCE_PHASE_STARTING,
    InstancePhase.SERVING: pb.INSTANCE_PHASE_SERVING,
    InstancePhase.GRACE: pb.INSTANCE_PHASE_GRACE,
}
PB_TO_WORKER = {v: k for k, v in WORKER_TO_PB.items()}
PB_TO_SLOT = {v: k for k, v in SLOT_TO_PB.items()}
PB_TO_PHASE = {v: k for k, v in PHASE_TO_PB.items()}


def worker_state(value: int) -> WorkerState:
    return PB_TO_WORKER.get(value, WorkerState.IDLE)


def slot_state(value: int) -> SlotState:
    return PB_TO_SLOT.get(value, SlotState.UNKNOWN)


def instance_phase(value: int) -> InstancePhase:
    return PB_TO_PHASE.get(value, InstancePhase.STARTING)
