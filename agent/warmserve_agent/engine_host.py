"""How the core reaches an instance's engine: in a GPU worker process, or in this process.

:class:`WorkerEngine` is the production path: the engine runs in the worker process of the
group's first GPU (rank 0 hosts the HTTP endpoint; the other GPUs' workers stay attached to
their GPUs as the paper's per-GPU actors).  :class:`InProcessEngine` runs the same
:class:`~warmserve_agent.engine.SimulatedEngine` in the agent process; the property tests use it
to drive thousands of steps without starting processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from warmserve_agent.engine import SimulatedEngine, WeightsMismatch
from warmserve_agent.worker import WorkerPool, timeout_for_bytes


class InProcessEngine:
    """InstanceEngine over a SimulatedEngine in this process."""

    def __init__(self, gpus: Sequence[int] = ()) -> None:
        self.gpus = tuple(gpus)
        self.engine = SimulatedEngine()

    def start(self, spec: dict[str, Any]) -> str:
        return self.engine.start(spec)["endpoint"]

    def layers_ready(self, n: int) -> None:
        bad = self.engine.layers_ready(n)
        if bad:
            raise WeightsMismatch(f"weights differ from the store: {bad[:3]}")

    def set_kv_capacity(self, nbytes: int) -> int:
        return self.engine.set_kv_capacity(nbytes)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def stop(self) -> None:
        self.engine.stop()


class WorkerEngine:
    """InstanceEngine whose engine lives in the worker process of ``gpus[0]``.

    When the slot is given by virtual address (memory owned by the workers), each other rank's
    shard is verified by that rank's own worker — only it can read its GPU — before the engine
    starts and whenever more layers land."""

    def __init__(self, pool: WorkerPool, gpus: Sequence[int]) -> None:
        self.pool = pool
        self.gpus = tuple(gpus)
        self.worker = pool.worker(self.gpus[0])
        self._spec: dict[str, Any] = {}
        self._layers = 0

    def _verify_remote(self, start: int, end: int) -> None:
        spec = self._spec
        for rank, w in enumerate(spec["weights"]):
            if "va" not in w or w.get("local"):
                continue
            tensors = [
                (
                    f"{t['name']}[rank {rank}]",
                    t["offset"],
                    t["shard_len"][rank],
                    spec["digests"][rank][i],
                )
                for i, t in enumerate(spec["tensors"])
                if start <= t["layer"] < end
            ]
            # Hashing reads every byte back from the GPU: the timeout grows with the shard.
            bad = self.pool.worker(self.gpus[rank]).call(
                "verify",
                timeout_s=timeout_for_bytes(sum(t[2] for t in tensors)),
                va=w["va"],
                tensors=tensors,
            )
            if bad:
                raise WeightsMismatch(
                    f"weights in the slot differ from the store for {len(bad)} tensors "
                    f"(first: {bad[0]}); evict the slot and prewarm again"
                )

    def start(self, spec: dict[str, Any]) -> str:
        self._spec = spec
        self._layers = spec["layers_resident"]
        self._verify_remote(0, self._layers)
        local = sum(t["shard_len"][0] for t in spec["tensors"])  # the engine verifies rank 0
        timeout = 60 + timeout_for_bytes(local)
        return self.worker.call("start_engine", timeout_s=timeout, spec=spec)["endpoint"]

    def layers_ready(self, n: int) -> None:
        if n > self._layers:
            self._verify_remote(self._layers, n)
        layer_bytes = sum(
            t["shard_len"][0] for t in self._spec["tensors"] if self._layers <= t["layer"] < n
        )
        bad = self.worker.call("layers_ready", timeout_s=timeout_for_bytes(layer_bytes), n=n)
        self._layers = max(self._layers, n)
        if bad:
            raise WeightsMismatch(f"weights differ from the store: {bad[:3]}")

    def set_kv_capacity(self, nbytes: int) -> int:
        return int(self.worker.call("set_kv_capacity", nbytes=nbytes))

    def stats(self) -> dict[str, Any]:
        return self.worker.call("stats")

    def stop(self) -> None:
        if self.worker.alive():
            self.worker.call("stop_engine")


class FreshWorkerEngine(WorkerEngine):
    """Baseline without pooling: start a new worker process for each instance (what a system
    without pre-started per-GPU workers pays).  Used by ``bench/agent_bench.py``."""

    def __init__(self, gpus: Sequence[int]) -> None:
        from warmserve_agent.worker import WorkerHandle

        self.gpus = tuple(gpus)
        self._handle_cls = WorkerHandle
        self.worker = None  # type: ignore[assignment]

    def start(self, spec: dict[str, Any]) -> str:
        self.worker = self._handle_cls()
        self.worker.wait_ready(timeout_s=120)
        self.worker.call("bind", gpu=self.gpus[0])
        return super().start(spec)

    def stop(self) -> None:
        if self.worker is not None:
            super().stop()
            self.worker.stop()
