"""The node agent's core: GPU worker states, prewarm slots, instances (WarmServe §4, Fig. 5-6).

:class:`NodeCore` is the synchronous, thread-safe state machine behind the gRPC service.  It owns
the page tables (:class:`~warmserve_agent.memory.MemoryManager`), the weight store and one engine
per serving instance, and enforces the worker lifecycle of Figure 5::

    idle ──prewarm──▶ universal ──activate──▶ dedicated ──grace──▶ grace ──end──▶ universal | idle
      └──────────────── activate (cold start) ──────▶┘               └─prewarm (lent memory)─┘

Every call validates everything before it changes anything, so a refused call leaves the node as
it was; refusals raise :class:`~warmserve_agent.node_records.Refusal` with a gRPC status name and
a message a person can act on.  The core is a facade over collaborators, one per concept of the
paper (each call's memory rules, §4.2, are in its module's docstring), that it builds and wires::

    NodeCore ─┬─▶ Activator ──▶ Prewarmer ──▶ GraceLender ─┐
              └──────────────────────────────────────────────┴─▶ NodeState ─▶ records, memory

* :mod:`~warmserve_agent.node_state`: the records, the lock, events, checks, Figure 5
  transitions, slot nesting (evict-aware placement, §5.2).
* :mod:`~warmserve_agent.grace_lending`: grace workers and Eq. 1 lending (proactive prewarming).
* :mod:`~warmserve_agent.prewarm_slots`: prewarm admission, loader threads, eviction.
* :mod:`~warmserve_agent.activation`: prewarm hits and cold starts, their stage timings.
* :mod:`~warmserve_agent.prepared_engines`: a slot's engine built while it waits, the engine spec.
* :mod:`~warmserve_agent.kv_pager`: the page-table work kept off the critical path (KV ranges
  mapped in the background, given-up pages unmapped in the background), shared by the above;
  :mod:`~warmserve_agent.engine_events`: the socket engines report request completions on.
* this module: the facade, worker and GPU failures (Figure 5's crash edges), invariants,
  shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from warmserve.engine_args import DEFAULT_POLICY, EngineArgPolicy
from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.activation import Activator, EngineSettings
from warmserve_agent.engine_events import EventListener
from warmserve_agent.engines import DEFAULT_ENGINE
from warmserve_agent.grace_lending import GraceLender
from warmserve_agent.kv_pager import KvMapping, KvPager
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node_records import (
    EngineFactory,
    Event,
    EventKind,
    GpuRec,
    InstanceRec,
    SlotRec,
)
from warmserve_agent.node_state import NodeState
from warmserve_agent.prepared_engines import EnginePreparer
from warmserve_agent.prewarm_slots import Prewarmer
from warmserve_agent.store import WeightStore

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


class NodeCore:
    """State machine of one node's GPUs (see module docstring)."""

    def __init__(
        self,
        mm: MemoryManager,
        store: WeightStore,
        gpu_memory: dict[int, int],
        engine_factory: EngineFactory,
        *,
        node_name: str = "node",
        engine_host: str = "127.0.0.1",
        advertise_host: str = "",
        traces: tuple[str, float] = ("", 1.0),
        engines: Sequence[str] = (DEFAULT_ENGINE,),
        default_engine: str = "",
        engine_policy: EngineArgPolicy = DEFAULT_POLICY,
        kv_background: bool = True,
        kv_pager_thread: bool = True,
        rank_workers: bool = True,
    ) -> None:
        # The engine settings are checked before any GPU is opened.
        self.engine_settings = EngineSettings(
            engine_factory,
            tuple(engines),
            default_engine,
            engine_policy,
            engine_host,
            advertise_host,
            traces,
            rank_workers,
        )
        self.state = NodeState(mm, store, gpu_memory, node_name=node_name)
        # KV page-table work off the critical path (kv_background=False: the synchronous
        # baseline, bench/agent_bench.py), and the socket engines report completions on
        self.pager = KvPager(mm, thread=kv_pager_thread)  # False: driven by hand (tests)
        self.state.kick_unmap = self.pager.kick
        self.lender = GraceLender(self.state, self.pager)
        try:
            self.events: EventListener | None = EventListener(self.lender.on_events)
        except OSError as exc:  # no writable temp dir: lending falls back to the slow timer
            log.warning("event=engine_events_unavailable err=%s", exc)
            self.events = None
        self.prewarmer = Prewarmer(self.state, self.lender)
        self.lender.restart_loader = self.prewarmer.start_loader
        self.preparer = EnginePreparer(self.state, self.engine_settings)
        self.state.on_slot_gone = self.preparer.forget
        self.activator = Activator(
            self.state,
            self.prewarmer,
            self.engine_settings,
            self.preparer,
            KvMapping(self.pager, kv_background, self.events.address if self.events else ""),
        )

    # ---- the records, read by the service, metrics and tests -------------------------------
    @property
    def mm(self) -> MemoryManager:
        return self.state.mm

    @property
    def store(self) -> WeightStore:
        return self.state.store

    @property
    def node_name(self) -> str:
        return self.state.node_name

    @property
    def page(self) -> int:
        return self.state.page

    @property
    def gpus(self) -> dict[int, GpuRec]:
        return self.state.gpus

    @property
    def slots(self) -> dict[str, SlotRec]:
        return self.state.slots

    @property
    def instances(self) -> dict[str, InstanceRec]:
        return self.state.instances

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def lock(self) -> threading.RLock:
        """Orders every change of the records (the fetcher takes it to install or evict)."""
        return self.state.lock

    @property
    def activation_log(self) -> list[tuple[bool, float]]:
        return self.activator.activation_log

    @property
    def on_instance_ended(self) -> Callable[[tuple[int, ...]], None] | None:
        return self.lender.on_instance_ended

    @on_instance_ended.setter
    def on_instance_ended(self, fn: Callable[[tuple[int, ...]], None] | None) -> None:
        self.lender.on_instance_ended = fn

    # ---- events ----------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        return self.state.subscribe(fn)

    def emit(self, kind: EventKind, subject: str, message: str = "") -> None:
        """Publish an event that happened outside the core (e.g. a worker was replaced)."""
        self.state.emit(kind, subject, message)

    # ---- the operations (each collaborator takes the lock itself) --------------------------
    def check_gpus(self, gpus: Iterable[int]) -> tuple[int, ...]:
        """The sorted group, or a Refusal; changes nothing (a check before a long fetch)."""
        with self.state.lock:
            return self.state.check_gpus(gpus)

    def models_in_use(self) -> set[str]:
        return self.state.models_in_use()

    def prewarm(
        self,
        model: str,
        gpus: Iterable[int],
        layers: int = 0,
        owner: str = "",
        engine: str = "",
        engine_args: Sequence[str] = (),
    ) -> SlotRec:
        """Prewarm, and have the slot's worker prepare ``engine`` (default: the node's) with
        ``engine_args`` for it (checked like Activate's, before anything changes)."""
        name = self.activator.check_engine(engine, engine_args)
        group = list(gpus)
        if len(group) > 1:
            with self.state.lock:
                layout = self.state.model_layout(model, len(self.state.check_gpus(group)))
            self.activator.check_tp(name, layout)
        slot = self.prewarmer.prewarm(model, group, layers, owner)
        self.preparer.want(slot, name, engine_args)
        return slot

    def evict(self, slot_id: str) -> tuple[SlotRec, int]:
        out = self.prewarmer.evict(slot_id)
        self.preparer.kick()  # its worker may prepare another slot's engine now
        return out

    def worker_replaced(self, gpu: int) -> None:
        """``gpu`` has a new worker: whatever was prepared (or failed) in the old one is
        forgotten, and waiting slots get their engines prepared in the new one."""
        self.preparer.worker_lost(gpu)
        self.preparer.kick()

    def check_engine(self, engine: str, args: Sequence[str]) -> str:
        return self.activator.check_engine(engine, args)

    def activate(
        self,
        model: str,
        gpus: Iterable[int],
        slot_id: str = "",
        engine: str = "",
        engine_args: Sequence[str] = (),
        owner: str = "",
    ) -> tuple[InstanceRec, list[str]]:
        return self.activator.activate(model, gpus, slot_id, engine, engine_args, owner)

    def begin_grace(self, instance_id: str) -> InstanceRec:
        return self.lender.begin_grace(instance_id)

    def end_instance(self, instance_id: str, evict_weights: bool = False) -> InstanceRec:
        inst = self.lender.end_instance(instance_id, evict_weights)
        with self.state.lock:
            slot = self.state.slots.get(inst.slot_id)
            if slot is not None:  # weights kept: the next hit gets a prepared engine again
                self.preparer.want(slot, inst.engine_name, inst.engine_args)
            self.preparer.kick()
        return inst

    def engine_stats(self, inst: InstanceRec) -> Any:
        """The instance's engine stats, kept as ``last_stats`` (stages noted on the way)."""
        return self.activator.refresh_stats(inst)

    def lendable(self, instance_ids: Sequence[str] = ()) -> list[dict[str, Any]]:
        return self.lender.lendable(instance_ids)

    def refresh_grace_all(self) -> None:
        self.lender.refresh_all()

    def kv_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no KV range grows and no given-up page waits to be unmapped."""
        return self.pager.idle(timeout)

    # ---- failures --------------------------------------------------------------------------
    def worker_died(self, gpu: int) -> str | None:
        """The worker process of ``gpu`` died: drop the instance it hosted (if any)."""
        state: NodeState = self.state
        with state.lock:
            self.preparer.worker_lost(gpu)
            iid = state.gpus[gpu].instance_id
            inst = state.instances.get(iid)
            if inst is None:
                return None
            self.activator.abort_instance(inst, f"worker process of GPU {gpu} died")
            return iid

    def gpu_lost(self, gpu: int) -> tuple[list[str], list[str]]:
        """The memory of ``gpu`` died with its worker (memory owned by workers): drop every
        instance and slot touching it.  Returns (instance ids, slot ids) dropped.  The GPU
        refuses requests (UNAVAILABLE) until :meth:`gpu_restored`."""
        state: NodeState = self.state
        with state.lock:
            state.gpus[gpu].available = False
            self.preparer.worker_lost(gpu)
            lost_insts = []
            for inst in list(state.instances.values()):
                if gpu not in inst.gpus:
                    continue
                state.instances.pop(inst.instance_id)
                for g in inst.gpus:
                    state.gpus[g].instance_id = ""
                with contextlib.suppress(Exception):  # its engine may live on the dead worker
                    inst.engine.stop()
                if inst.kv is not None:
                    inst.kv.release_all()
                lost_insts.append(inst.instance_id)
                state.emit(EventKind.INSTANCE_REMOVED, inst.instance_id, f"GPU {gpu}'s worker died")
            touched = [s for s in state.slots.values() if gpu in s.gpus]
            for s in touched:
                s.cancel.set()
            for s in touched:
                if s.loader is not None:
                    s.loader.join()
            dropped = state.mm.drop_gpu(gpu)
            affected = {gpu}
            for sid in dropped:
                slot = state.slots.pop(sid)
                self.preparer.forget(sid)  # an engine prepared in another GPU's worker
                affected.update(slot.gpus)
                state.emit(
                    EventKind.SLOT_REMOVED, sid, f"GPU {gpu}'s memory was lost with its worker"
                )
            # A lost instance's slot touched ``gpu``, so its GPUs are all in ``affected``.
            for g in sorted(affected):
                if not state.gpus[g].instance_id:  # GPUs still serving keep their state
                    state.transition([g], state.rest_state(g), crash=True)
            log.warning(
                "event=gpu_memory_lost gpu=%d instances=%s slots=%s", gpu, lost_insts, dropped
            )
            return lost_insts, dropped

    def gpu_restored(self, gpu: int) -> None:
        """A new worker owns ``gpu``: open an empty page pool and accept requests again."""
        state: NodeState = self.state
        with state.lock:
            state.mm.reopen_gpu(gpu)
            state.gpus[gpu].memory_bytes = state.mm.num_pages(gpu) * state.page
            state.gpus[gpu].available = True
            state.emit(EventKind.GPU, str(gpu), "worker replaced; memory reset")

    # ---- introspection ---------------------------------------------------------------------
    def check(self) -> None:
        """Invariants beyond the page tables (tests call this after every step)."""
        state: NodeState = self.state
        mm: MemoryManager = state.mm
        with state.lock:
            mm.check()
            for g, rec in state.gpus.items():
                slots = [s for s in state.slots.values() if g in s.gpus]
                inst = state.instances.get(rec.instance_id)
                if rec.state == WorkerState.IDLE:
                    assert not slots and inst is None, f"gpu {g} idle but holds something"
                elif rec.state == WorkerState.UNIVERSAL:
                    assert slots and inst is None, f"gpu {g} universal without slots"
                elif rec.state == WorkerState.DEDICATED:
                    assert inst is not None and inst.phase != InstancePhase.GRACE
                    assert [s.slot_id for s in slots] == [inst.slot_id], f"gpu {g}: extra slots"
                else:
                    assert inst is not None and inst.phase == InstancePhase.GRACE
            for inst in state.instances.values():
                slot = state.slots[inst.slot_id]
                for g in inst.gpus:
                    assert mm.mapped_prefix(slot.slot_id, g) >= inst.weight_pages
                    live = mm.live_vpages(slot.slot_id, g)
                    assert len(live) == inst.weight_pages + inst.kv_pages, f"gpu {g}: {live}"
                assert inst.kv is not None
                inst.kv.check()  # granted blocks touch mapped pages only

    def shutdown(self) -> None:
        state: NodeState = self.state
        if self.events is not None:
            self.events.close()
        with state.lock:
            for inst in list(state.instances.values()):
                with contextlib.suppress(Exception):
                    inst.engine.stop()
            for sid in list(self.preparer.wanted) + list(self.preparer.prepared):
                self.preparer.forget(sid)  # a build under way is cancelled, a built one dropped
            for slot in state.slots.values():
                slot.cancel.set()
            for slot in state.slots.values():
                if slot.loader is not None:
                    slot.loader.join(10)
        self.pager.close()
