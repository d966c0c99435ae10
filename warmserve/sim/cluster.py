"""Mutable simulator state: GPUs, prewarm replicas and serving instances with their engines.

The policy works on immutable snapshots; the simulator keeps the mutable truth here and reports
it as an :class:`warmserve.control.observation.Observation` (:mod:`warmserve.sim.executor`),
from which the control layer builds the snapshot with the same rule as for the operator.

Continuous batching without per-token events
--------------------------------------------
An instance's decode progress is a *virtual step counter* ``V``: it advances at ``1/step_s`` per
second while the instance decodes and stands still while it runs a prefill (prefill-first
without chunking, vLLM V0's default: the decoding requests wait for the prefill iteration).
A request that joins the decode batch at ``V0`` with ``n`` output tokens (the first comes from
the prefill) finishes when ``V`` reaches ``V0 + n - 1``.  ``step_s`` is
``engine.decode_step_s(batch, kv_tokens)`` re-evaluated at every membership change (a join or a
finish), so between two changes the batch advances analytically and the simulator needs one
event per change, not per token.  The error is that KV growth between two changes does not
lengthen the steps (KV reads are a small part of a step at these sizes; see docs/simulator.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warmserve.policy.cluster import InstancePhase, ReplicaKind, WorkerState

if TYPE_CHECKING:
    from warmserve.control.observation import InstanceObs

STARTING, SERVING, GRACE, STOPPED = "starting", "serving", "grace", "stopped"
PHASE = {
    STARTING: InstancePhase.STARTING,
    SERVING: InstancePhase.SERVING,
    GRACE: InstancePhase.GRACE,
}


class Req:
    """One request while it is alive in the simulation (created at arrival, dropped from
    memory once served or dropped: runs stream)."""

    __slots__ = (
        "assigned",
        "delayed",
        "drop",
        "finish",
        "first",
        "inp",
        "m",
        "out",
        "rid",
        "t",
    )

    def __init__(self, rid: int, t: float, m: int, inp: int, out: int) -> None:
        self.rid = rid
        self.t = t
        self.m = m
        self.inp = inp
        self.out = out
        self.assigned = -1.0
        self.first = -1.0
        self.finish = -1.0
        self.drop: str | None = None
        self.delayed = False  # waited for its instance's start (metrics: delayed by a start)


@dataclass(eq=False)
class SimReplica:
    """Prewarmed (or cached) weights of one model on a GPU group, possibly still loading.

    Loading runs at the host→GPU link rate from ``t_begin`` (after the start-up profile's fixed
    load set-up, which ends at ``t_begin``); ``layers_at(t)`` is how many leading layers are
    resident then (whole layers only: a layer is usable once all of it is in).
    ``sid`` is its slot id (what decisions name); ``priority`` the kind/rank/score a rule outside
    the controller gave it (SLLM-GPU's cache), else ``None``.
    """

    model: str
    node: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    layers_target: int
    t_begin: float
    per_layer_s: float
    lender: SimInstance | None = None  # grace instance whose KV memory holds it (§4.1)
    sid: str = ""
    priority: tuple[ReplicaKind, int, float] | None = None
    kept: bool = False  # the weights a stopped instance left behind (§4.1)

    def layers_at(self, t: float) -> int:
        if t < self.t_begin:
            return 0
        if self.per_layer_s <= 0:
            return self.layers_target
        return min(self.layers_target, int((t - self.t_begin) / self.per_layer_s + 1e-9))

    @property
    def t_done(self) -> float:
        return self.t_begin + self.layers_target * self.per_layer_s


@dataclass(eq=False)
class SimInstance:
    """A serving instance and its continuous-batching engine state (module docstring)."""

    iid: int
    model: str
    midx: int
    node: str
    gpus: tuple[int, ...]
    engine: Any  # H3b's EngineModel
    timer: Any  # its warmserve.sim.perf.StepTimer
    max_batch: int
    kv_cap_tokens: int
    kv_bytes_per_token: float
    t_start: float
    ready_at: float
    full_at: float  # all layers resident (decode needs them all)
    hit: bool
    slowdown: float = 1.0  # >1 when sharing compute (MuxServe colocation)
    phase: str = STARTING
    grace_since: float = 0.0
    # engine state
    v: float = 0.0
    t_last: float = 0.0
    step_s: float = 0.0  # 0: not decoding
    prefill_end: float = -1.0  # >= 0 while a prefill runs
    prefill_batch: list[Req] = field(default_factory=list)
    pending: deque[Req] = field(default_factory=deque)
    running: list[tuple[float, int, Req]] = field(default_factory=list)  # heap (target V, rid, r)
    n_assigned: int = 0
    kv_reserved: int = 0  # prompt + output tokens of every assigned request (admission)
    sum_in_running: int = 0
    sum_v0_running: float = 0.0
    version: int = 0
    lent: list[SimReplica] = field(default_factory=list)
    served: int = 0
    # GPU sharing (MuxServe, Prism): instances on the same GPUs and the configuration factor of
    # warmserve.sim.sharing (None: the constant ``slowdown`` applies).
    peers: list[SimInstance] = field(default_factory=list)
    config_slowdown: float | None = None
    prefill_config_slowdown: float | None = None  # None: config_slowdown
    last_request_s: float = 0.0  # last assignment (Prism's idle rule)
    # its last report to the controller (warmserve.sim.executor.instance_obs), reused while equal
    last_obs: InstanceObs | None = field(default=None, repr=False)

    @property
    def busy(self) -> bool:
        """Running a prefill or decoding: it then slows down the instances it shares GPUs with."""
        return self.prefill_end >= 0 or bool(self.running)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.iid}"

    def free_slot(self, need_tokens: int) -> bool:
        return (
            self.n_assigned < self.max_batch
            and self.kv_reserved + need_tokens <= self.kv_usable_tokens
        )

    @property
    def kv_usable_tokens(self) -> int:
        if not self.lent:  # the common case, asked per dispatched request
            return self.kv_cap_tokens
        lent_bytes = sum(r.bytes_per_gpu for r in self.lent) * len(self.gpus)
        return self.kv_cap_tokens - int(lent_bytes / self.kv_bytes_per_token)

    def kv_tokens_now(self) -> float:
        """Tokens held in the KV cache now (prompts plus tokens generated so far)."""
        decoding = self.sum_in_running + len(self.running) * self.v - self.sum_v0_running
        return max(decoding, 0.0)

    def settle(self, t: float) -> None:
        """Advance the decode counter to ``t``."""
        if self.step_s > 0 and t > self.t_last:
            self.v += (t - self.t_last) / self.step_s
        self.t_last = max(self.t_last, t)


class SimCluster:
    """GPUs (per node), the replicas on them and the instances holding them."""

    def __init__(self, nodes: int, gpus_per_node: int, hbm_bytes: int) -> None:
        self.node_names = [f"node-{i}" for i in range(nodes)]
        self.gpus_per_node = gpus_per_node
        self.hbm_bytes = hbm_bytes
        self.holder: dict[tuple[str, int], SimInstance] = {}
        self.replicas: list[SimReplica] = []
        self.by_sid: dict[str, SimReplica] = {}
        self._next_sid = 0
        self.link_free: dict[tuple[str, int], float] = {
            (n, g): 0.0 for n in self.node_names for g in range(gpus_per_node)
        }
        self.generation = 0  # bumped whenever an instance takes or frees a GPU

    @property
    def total_gpus(self) -> int:
        return len(self.node_names) * self.gpus_per_node

    def replica_bytes(self) -> dict[tuple[str, int], int]:
        used: dict[tuple[str, int], int] = {}
        for r in self.replicas:
            for g in r.gpus:
                used[(r.node, g)] = used.get((r.node, g), 0) + r.bytes_per_gpu
        return used

    def gpu_state(self, node: str, g: int, has_replica: bool) -> WorkerState:
        inst = self.holder.get((node, g))
        if inst is not None:
            return WorkerState.GRACE if inst.phase == GRACE else WorkerState.DEDICATED
        return WorkerState.UNIVERSAL if has_replica else WorkerState.IDLE

    def counts(self) -> dict[str, int]:
        """GPUs per worker state (for the timeline)."""
        # gpu_state's rule counted per state without visiting every GPU (asked at every start
        # and stop: 1,024 GPUs at scale): held GPUs are grace or dedicated, GPUs
        # with a replica and no holder universal, the rest idle
        out = {s.value: 0 for s in WorkerState}
        holder = self.holder
        grace = sum(1 for inst in holder.values() if inst.phase == GRACE)
        out[WorkerState.GRACE.value] = grace
        out[WorkerState.DEDICATED.value] = len(holder) - grace
        with_replica = {(r.node, g) for r in self.replicas for g in r.gpus}
        universal = sum(1 for k in with_replica if k not in holder)
        out[WorkerState.UNIVERSAL.value] = universal
        out[WorkerState.IDLE.value] = self.total_gpus - len(holder) - universal
        return out

    def add_replica(self, r: SimReplica) -> SimReplica:
        self._next_sid += 1
        r.sid = f"slot-{self._next_sid}"
        self.replicas.append(r)
        self.by_sid[r.sid] = r
        return r

    def replica(self, sid: str) -> SimReplica | None:
        return self.by_sid.get(sid)

    def remove_replica(self, r: SimReplica, t: float) -> None:
        """Drop a replica; a load still in flight gives its remaining link time back."""
        self.replicas.remove(r)
        self.by_sid.pop(r.sid, None)
        if r.lender is not None and r in r.lender.lent:
            r.lender.lent.remove(r)
        if t < r.t_done:
            for g in r.gpus:
                key = (r.node, g)
                if self.link_free[key] <= r.t_done + 1e-9:
                    freed = r.t_done - max(t, r.t_begin)
                    self.link_free[key] = max(t, self.link_free[key] - freed)
