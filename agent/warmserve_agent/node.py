"""The node agent's core: GPU worker states, prewarm slots, instances (WarmServe §4, Fig. 5-6).

:class:`NodeCore` is the synchronous, thread-safe state machine behind the gRPC service.  It owns
the page tables (:class:`~warmserve_agent.memory.MemoryManager`), the weight store and one engine
per serving instance, and enforces the worker lifecycle of Figure 5::

    idle ──prewarm──▶ universal ──activate──▶ dedicated ──grace──▶ grace ──end──▶ universal | idle
      └──────────────── activate (cold start) ──────▶┘               └─prewarm (lent memory)─┘

Every call validates everything before it changes anything, so a refused call leaves the node as
it was; refusals raise :class:`~warmserve_agent.node_records.Refusal` with a gRPC status name and
a message a person can act on.  The core is built in layers, one module per concept of the paper
(each call's memory rules, §4.2, are in its module's docstring):

* :mod:`~warmserve_agent.node_records`: worker, slot and instance records; refusals.
* :mod:`~warmserve_agent.node_state`: shared state, events, validation, Figure 5 transitions,
  slot nesting (evict-aware placement, §5.2).
* :mod:`~warmserve_agent.grace_lending`: grace workers and Eq. 1 lending (proactive prewarming).
* :mod:`~warmserve_agent.prewarm_slots`: prewarm admission, loader threads, eviction.
* :mod:`~warmserve_agent.activation`: prewarm hits and cold starts, the engine spec.
* this module: worker and GPU failures (Figure 5's crash edges), invariants, shutdown.
"""

from __future__ import annotations

import contextlib
import logging

from warmserve.policy.cluster import InstancePhase, WorkerState
from warmserve_agent.activation import Activation

log = logging.getLogger("warmserve.agent.node")  # one logger for the whole node core


class NodeCore(Activation):
    """State machine of one node's GPUs (see module docstring)."""

    # ---- failures --------------------------------------------------------------------------
    def worker_died(self, gpu: int) -> str | None:
        """The worker process of ``gpu`` died: drop the instance it hosted (if any)."""
        with self._lock:
            iid = self.gpus[gpu].instance_id
            inst = self.instances.get(iid)
            if inst is None:
                return None
            self._abort_instance(inst, f"worker process of GPU {gpu} died")
            return iid

    def gpu_lost(self, gpu: int) -> tuple[list[str], list[str]]:
        """The memory of ``gpu`` died with its worker (memory owned by workers): drop every
        instance and slot touching it.  Returns (instance ids, slot ids) dropped.  The GPU
        refuses requests (UNAVAILABLE) until :meth:`gpu_restored`."""
        with self._lock:
            self.gpus[gpu].available = False
            lost_insts = []
            for inst in list(self.instances.values()):
                if gpu not in inst.gpus:
                    continue
                self.instances.pop(inst.instance_id)
                for g in inst.gpus:
                    self.gpus[g].instance_id = ""
                with contextlib.suppress(Exception):  # its engine may live on the dead worker
                    inst.engine.stop()
                lost_insts.append(inst.instance_id)
                self._emit("instance_removed", inst.instance_id, f"GPU {gpu}'s worker died")
            touched = [s for s in self.slots.values() if gpu in s.gpus]
            for s in touched:
                s.cancel.set()
            for s in touched:
                if s.loader is not None:
                    s.loader.join()
            dropped = self.mm.drop_gpu(gpu)
            affected = {gpu}
            for sid in dropped:
                slot = self.slots.pop(sid)
                affected.update(slot.gpus)
                self._emit("slot_removed", sid, f"GPU {gpu}'s memory was lost with its worker")
            # A lost instance's slot touched ``gpu``, so its GPUs are all in ``affected``.
            for g in sorted(affected):
                if not self.gpus[g].instance_id:  # GPUs still serving keep their state
                    self._transition([g], self._rest_state(g), crash=True)
            log.warning(
                "event=gpu_memory_lost gpu=%d instances=%s slots=%s", gpu, lost_insts, dropped
            )
            return lost_insts, dropped

    def gpu_restored(self, gpu: int) -> None:
        """A new worker owns ``gpu``: open an empty page pool and accept requests again."""
        with self._lock:
            self.mm.reopen_gpu(gpu)
            self.gpus[gpu].memory_bytes = self.mm.num_pages(gpu) * self.page
            self.gpus[gpu].available = True
            self._emit("gpu", str(gpu), "worker replaced; memory reset")

    # ---- introspection ---------------------------------------------------------------------
    def check(self) -> None:
        """Invariants beyond the page tables (tests call this after every step)."""
        with self._lock:
            self.mm.check()
            for g, rec in self.gpus.items():
                slots = [s for s in self.slots.values() if g in s.gpus]
                inst = self.instances.get(rec.instance_id)
                if rec.state == WorkerState.IDLE:
                    assert not slots and inst is None, f"gpu {g} idle but holds something"
                elif rec.state == WorkerState.UNIVERSAL:
                    assert slots and inst is None, f"gpu {g} universal without slots"
                elif rec.state == WorkerState.DEDICATED:
                    assert inst is not None and inst.phase != InstancePhase.GRACE
                    assert [s.slot_id for s in slots] == [inst.slot_id], f"gpu {g}: extra slots"
                else:
                    assert inst is not None and inst.phase == InstancePhase.GRACE
            for inst in self.instances.values():
                slot = self.slots[inst.slot_id]
                for g in inst.gpus:
                    assert (
                        self.mm.mapped_prefix(slot.slot_id, g) >= inst.weight_pages + inst.kv_pages
                    )
                    assert (
                        self.mm.mapped_count(slot.slot_id, g) == inst.weight_pages + inst.kv_pages
                    )

    def shutdown(self) -> None:
        with self._lock:
            for inst in list(self.instances.values()):
                with contextlib.suppress(Exception):
                    inst.engine.stop()
            for slot in self.slots.values():
                slot.cancel.set()
            for slot in self.slots.values():
                if slot.loader is not None:
                    slot.loader.join(10)
