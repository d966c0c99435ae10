"""How the core reaches an instance's engine: in a GPU worker process, or in this process.

Both hosts implement the same :class:`~warmserve_agent.engine.Engine` protocol as the engines
themselves, so ``NodeCore`` never knows where an engine runs.  :class:`WorkerEngine` is the
production path: the engine (chosen by ``spec.engine`` from the registry in
``warmserve_agent.engines``) runs in the pooled worker process of the group's first GPU (rank 0
hosts the HTTP endpoint; the other GPUs' workers stay attached to their GPUs as the paper's
per-GPU actors).  :class:`InProcessEngine` runs the engine in the agent process; the property
tests use it to drive thousands of steps without starting processes.

Prepared engines: a host made for a prewarm slot builds that slot's engine in the background
(``prepare``: returns at once; ``prepared(wait_s)`` reports how far it got, a
:class:`~warmserve_agent.engines.spec.PreparedReport`; ``drop_prepared`` tears it down when the
slot goes); the activation of that slot calls ``start`` on the same host, which uses the prepared
engine if it was built for the same spec (``EngineSpec.prepared_key``) and builds one otherwise.
``process_taken_at`` (``time.perf_counter()``) is when the host's process was ready for the
instance: a pooled worker's at once, a fresh one's once started.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

from warmserve_agent.engine import Engine, WeightsMismatch
from warmserve_agent.engines import engine_info
from warmserve_agent.engines.prepared import PreparedEngine
from warmserve_agent.engines.spec import EngineSpec, EngineStats, PreparedReport, PreparedState
from warmserve_agent.worker import WorkerHandle, WorkerPool, timeout_for_bytes

log = logging.getLogger("warmserve.agent")

PREPARED_POLL_S = 0.05
# How long rank 0 of a tensor-parallel engine that lost a rank gets to stop before its process
# is ended (a graceful stop of the tiny test model takes ~1-3 s on a loaded 2-core VM).
TP_LOST_STOP_S = 10.0


class InProcessEngine:
    """Engine protocol over an engine in this process (tests, ``use_workers=False``)."""

    def __init__(self, gpus: Sequence[int] = ()) -> None:
        self.gpus = tuple(gpus)
        self.engine: Engine | None = None
        self._prepared: PreparedEngine | None = None
        self.process_taken_at = time.perf_counter()

    def prepare(self, spec: EngineSpec) -> None:
        if self._prepared is not None or self.engine is not None:
            raise RuntimeError("this host already holds an engine")
        self._prepared = PreparedEngine(engine_info(spec.engine).create(), spec)

    def prepared(self, wait_s: float = 0.0) -> PreparedReport:
        if self._prepared is None:
            return PreparedReport(PreparedState.NONE)
        return self._prepared.report(wait_s)

    def drop_prepared(self) -> None:
        prep, self._prepared = self._prepared, None
        if prep is not None:
            prep.drop()

    def start(self, spec: EngineSpec) -> str:
        self.process_taken_at = time.perf_counter()
        prep, self._prepared = self._prepared, None
        self.engine = prep.claim(spec) if prep is not None else None
        if self.engine is None:
            self.engine = engine_info(spec.engine).create()
        return self.engine.start(spec)

    def _eng(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("engine not started")
        return self.engine

    def layers_ready(self, n: int) -> None:
        self._eng().layers_ready(n)

    def set_kv_capacity(self, nbytes: int) -> int:
        return self._eng().set_kv_capacity(nbytes)

    def stats(self) -> EngineStats:
        return self._eng().stats()

    def stop(self) -> None:
        self.drop_prepared()
        if self.engine is not None:
            self.engine.stop()


class WorkerEngine:
    """Engine protocol over the engine in the worker process of ``gpus[0]``.

    When the slot is given by virtual address (memory owned by the workers) and the engine
    checks its own rank's bytes (``EngineInfo.verifies_slot``: the simulated engine), each other
    rank's shard is verified by that rank's own worker — only it can read its GPU — before the
    engine starts and whenever more layers land."""

    start_timeout_s = 600.0  # a real engine builds (and on a GPU compiles) within this

    def __init__(self, pool: WorkerPool, gpus: Sequence[int]) -> None:
        self.pool = pool
        self.gpus = tuple(gpus)
        self.worker = pool.worker(self.gpus[0])
        self._spec: EngineSpec | None = None
        self._layers = 0
        self._prepared_slot = ""
        self.process_taken_at = time.perf_counter()  # a pooled worker: running already

    def _ranks(self, spec: EngineSpec | None) -> list[tuple[int, WorkerHandle]]:
        """The other ranks' workers of a tensor-parallel engine hosted rank by rank
        (``engines/vllm/tp_executor.py``); none for TP 1 or an engine that verifies only."""
        if spec is None or not spec.tp_peers:
            return []
        return [(r, self.pool.worker(g)) for r, g in enumerate(self.gpus) if r]

    def prepare(self, spec: EngineSpec) -> None:
        """The worker builds ``spec``'s engine on a thread of its own; returns at once.  The
        other ranks listen first: rank 0's build forms their process group (prewarm time)."""
        self._spec = spec
        for r, w in self._ranks(spec):
            w.call("prepare_rank", spec=spec, rank=r)
        self.worker.call("prepare_engine", spec=spec)
        self._prepared_slot = spec.slot_id

    def prepared(self, wait_s: float = 0.0) -> PreparedReport:
        """The worker's prepared engine for our slot, polled until it is built or ``wait_s``
        passed (short calls: the pipe stays free for the loader's memory operations)."""
        deadline = time.monotonic() + wait_s
        while True:
            if not self._prepared_slot:
                return PreparedReport(PreparedState.NONE)
            rep: PreparedReport = self.worker.call("prepared_state", slot_id=self._prepared_slot)
            if rep.state != PreparedState.PREPARING or time.monotonic() >= deadline:
                return rep
            time.sleep(PREPARED_POLL_S)

    def drop_prepared(self) -> None:
        slot, self._prepared_slot = self._prepared_slot, ""
        if slot and self.worker.alive() and self._rank_lost():
            # a build still running with a rank gone waits in a collective forever; a built
            # one is idle and drops
            try:
                rep = self.worker.call("prepared_state", slot_id=slot, timeout_s=5.0)
                if rep.state == PreparedState.PREPARING:
                    raise TimeoutError("still building")
                self.worker.call("drop_prepared", slot_id=slot, timeout_s=TP_LOST_STOP_S)
            except Exception:
                self._end_rank0("its prepared engine's build lost a rank")
        elif slot and self.worker.alive():
            with contextlib.suppress(Exception):  # a worker dying meanwhile took it along
                self.worker.call("drop_prepared", slot_id=slot)
        if slot:
            self._stop_ranks(slot)

    def _rank_lost(self) -> bool:
        return any(not w.alive() for _, w in self._ranks(self._spec))

    def _end_rank0(self, why: str) -> None:
        """Rank 0's process cannot be trusted to stop: a collective whose peer died never
        returns (vLLM's CPU shared-memory all-reduce spins on the peer's flag; NCCL waits
        likewise).  End it: the worker monitor replaces it as any dead worker (with memory in
        the workers, its GPU's other slots go with it)."""
        log.warning(
            "event=tp_rank0_killed gpu=%d pid=%d why=%s", self.gpus[0], self.worker.pid, why
        )
        self.worker.kill()

    def _stop_ranks(self, slot_id: str) -> None:
        """Tear the other ranks down (rank 0's teardown closed their links, ending the group),
        then unlink the group's shared-memory names: vLLM unlinks them only when a rank's process
        exits (never, for a killed one), so a worker killed later — an agent's shutdown stops
        workers that do not exit in time — would leave them in ``/dev/shm``.  The ranks' own
        mappings stay valid until their processes drop them."""
        ranks = self._ranks(self._spec)
        for _, w in ranks:
            if w.alive():
                with contextlib.suppress(Exception):
                    w.call("stop_rank", timeout_s=90.0, slot_id=slot_id)
        if ranks:
            from warmserve_agent.engines.vllm.tp_executor import remove_group_shm

            remove_group_shm(slot_id)

    def _verify_remote(self, start: int, end: int) -> None:
        spec = self._spec
        assert spec is not None
        if not engine_info(spec.engine).verifies_slot:
            return  # rank 0 is not checked either (EngineInfo.verifies_slot)
        for rank, region in enumerate(spec.regions):
            if region.host_file or region.local:
                continue
            tensors = [
                (f"{t.name}[rank {rank}]", t.offset, t.shard_len[rank], spec.digests[rank][i])
                for i, t in enumerate(spec.tensors)
                if start <= t.layer < end
            ]
            # Hashing reads every byte back from the GPU: the timeout grows with the shard.
            bad = self.pool.worker(self.gpus[rank]).call(
                "verify",
                timeout_s=timeout_for_bytes(sum(t[2] for t in tensors)),
                va=region.va,
                tensors=tensors,
            )
            if bad:
                raise WeightsMismatch(
                    f"weights in the slot differ from the store for {len(bad)} tensors "
                    f"(first: {bad[0]}); evict the slot and prewarm again",
                    tensors=bad,
                )

    def start(self, spec: EngineSpec) -> str:
        self._spec = spec
        self._layers = spec.layers_resident
        self._verify_remote(0, self._layers)
        # the simulated engine verifies rank 0's bytes; vLLM builds its engine (minutes on a
        # loaded CPU, compilation on a GPU): the larger of the two bounds
        local = sum(t.shard_len[0] for t in spec.tensors)
        timeout = max(self.start_timeout_s, 60 + timeout_for_bytes(local))
        self._prepared_slot = ""  # the worker uses (or drops) its prepared engine now
        ranks = self._ranks(spec)
        for r, w in ranks:  # idempotent when prepared at prewarm (the group exists already)
            w.call("prepare_rank", spec=spec, rank=r)
            w.call("start_rank", spec=spec)
        endpoint = str(self.worker.call("start_engine", timeout_s=timeout, spec=spec))
        for _, w in ranks:  # built only now (no prepared engine): the KV mapped so far
            w.call("rank_kv", slot_id=spec.slot_id, nbytes=spec.kv_capacity_bytes // spec.tp_size)
        return endpoint

    def layers_ready(self, n: int) -> None:
        if n > self._layers:
            self._verify_remote(self._layers, n)
        assert self._spec is not None
        layer_bytes = sum(t.shard_len[0] for t in self._spec.tensors if self._layers <= t.layer < n)
        for _, w in self._ranks(self._spec):  # every rank's gate opens before rank 0 runs it
            w.call("rank_layers_ready", slot_id=self._spec.slot_id, n=n)
        # A WeightsMismatch in the worker arrives as one (worker_errors).
        self.worker.call("layers_ready", timeout_s=timeout_for_bytes(layer_bytes), n=n)
        self._layers = max(self._layers, n)

    def set_kv_capacity(self, nbytes: int) -> int:
        ranks = self._ranks(self._spec)
        if not ranks:
            return int(self.worker.call("set_kv_capacity", nbytes=nbytes))
        assert self._spec is not None
        sid, tp = self._spec.slot_id, self._spec.tp_size
        # A raise: every other rank maps and zeroes its pages before rank 0 hands the blocks
        # out; a lowering: rank 0 keeps what is in use, then the ranks give up the rest.
        for _, w in ranks:
            if nbytes // tp > int(w.call("rank_kv", slot_id=sid, nbytes=-1)):
                w.call("rank_kv", slot_id=sid, nbytes=nbytes // tp)
        kept = int(self.worker.call("set_kv_capacity", nbytes=nbytes))
        for _, w in ranks:
            w.call("rank_kv", slot_id=sid, nbytes=kept // tp)
        return kept

    def stats(self) -> EngineStats:
        return self.worker.call("stats")

    def stop(self) -> None:
        try:
            self.drop_prepared()
            if self.worker.alive() and self._rank_lost():
                try:  # idle between steps it stops; inside a step's collective it never returns
                    self.worker.call("stop_engine", timeout_s=TP_LOST_STOP_S)
                except Exception:
                    self._end_rank0("a rank died under its serving engine")
            elif self.worker.alive():
                self.worker.call("stop_engine", timeout_s=60.0)
        finally:
            # also when rank 0's worker died under the call (an agent's shutdown: the signal
            # reaches the workers too): the group's names are ours to unlink either way
            if self._spec is not None and self._spec.tp_peers:
                self._stop_ranks(self._spec.slot_id)


class FreshWorkerEngine(WorkerEngine):
    """Baseline without pooling: start a new worker process for each instance (what a system
    without pre-started per-GPU workers pays).  Used by ``bench/agent_bench.py``."""

    def __init__(self, gpus: Sequence[int], engines: tuple[str, ...] = ("simulated",)) -> None:
        from warmserve_agent.worker import WorkerHandle

        self.gpus = tuple(gpus)
        self._handle_cls = WorkerHandle
        self._engines = engines
        self.worker = None  # type: ignore[assignment]
        self._prepared_slot = ""
        self.process_taken_at = 0.0

    def start(self, spec: EngineSpec) -> str:
        self.worker = self._handle_cls(engines=self._engines)
        self.worker.wait_ready(timeout_s=300)
        self.worker.call("bind", gpu=self.gpus[0])
        self.process_taken_at = time.perf_counter()
        return super().start(spec)

    def stop(self) -> None:
        if self.worker is not None:
            super().stop()
            self.worker.stop()
