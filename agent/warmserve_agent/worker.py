"""GPU worker processes and their supervisor (WarmServe §3-4: one long-lived actor per GPU).

Each GPU has one long-lived worker process that hosts the engine while the GPU is dedicated
(or in grace).  The agent talks to it over a ``multiprocessing`` pipe with a tiny request/answer
protocol: ``(command, kwargs)`` -> ``(Reply.OK, result)`` or ``(Reply.ERR, record)``, the record
a typed, versioned :class:`~warmserve_agent.worker_errors.WorkerFault` that the agent re-raises
as the exception the worker raised (:mod:`~warmserve_agent.worker_errors`).  Commands:
``ping``, ``bind`` (attach to a GPU), ``prepare_engine`` (build a prewarm slot's engine on a
thread, returning at once), ``prepared_state``, ``drop_prepared``, ``start_engine`` (an
:class:`~warmserve_agent.engines.spec.EngineSpec`; the engine class comes from the registry by
``spec.engine``; the engine prepared for the same slot and spec if there is one),
``layers_ready``, ``set_kv_capacity``, ``stats``, ``stop_engine``, ``exit``; for a
tensor-parallel engine's rank ``r >= 1`` (``engines/vllm/tp_executor.py``): ``prepare_rank``,
``start_rank``, ``rank_layers_ready``, ``rank_kv``, ``stop_rank``.

At most one engine lives in a worker at a time, serving or prepared
(:mod:`~warmserve_agent.engines.prepared`): one prepared for a slot waits there until that slot
is activated (it becomes the serving engine), evicted (``drop_prepared``), or the worker dies
(it dies with it; the agent forgets it).

Why pooled processes: starting a Python process and importing the engine's libraries takes far
longer than activating a slot, so the :class:`WorkerPool` keeps ``spares`` processes started and
imported.  The preload list follows the engines the agent serves (``engines.EngineInfo.preload``:
for ``vllm`` that is torch + vLLM + its OpenAI server, and CUDA initialisation on a GPU node).
A crashed worker (or one recycled after an instance ends) is replaced from the spares at once
and a new spare starts in the background.  ``bench/agent_bench.py`` measures the difference
(pooled activation vs a freshly started process).

A worker exits on its own when the agent's end of the pipe closes (agent crash or restart), so
no orphan engines keep serving after the agent is gone (see docs/agent.md, "Agent restart").

A worker is a fresh interpreter (``subprocess``, not ``multiprocessing``'s spawn, which would
hand it the agent's whole environment and command line) with an environment built from an
allowlist (:mod:`~warmserve_agent.worker_env`): offline, without the Hub token, cloud
credentials or the Kubernetes variables, so an engine never holds the agent's secrets.  The pipe
is one end of a socket pair passed as a file descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from warmserve_agent.worker_env import worker_environ
from warmserve_agent.worker_errors import Reply, WorkerError, WorkerFault

log = logging.getLogger("warmserve.agent.worker")

# What a worker process runs: ``_child_main`` with the pipe's descriptor and the engines.
_CHILD = "from warmserve_agent.worker import _child_main; _child_main()"


def timeout_for_bytes(
    nbytes: int, *, floor_s: float = 60.0, min_bytes_per_s: float = 100e6
) -> float:
    """Timeout of a worker call that moves or hashes ``nbytes``: a floor for
    the fixed costs plus the bytes at a deliberately slow rate (100 MB/s, well under disk reads,
    PCIe copies and blake2b), so a 70 GB model's verification is not cut off at 30 s while a
    hung worker is still noticed."""
    return floor_s + max(0, nbytes) / min_bytes_per_s


# ---- the worker process -------------------------------------------------------------------
def worker_main(conn: Connection, engines: tuple[str, ...] = ("simulated",)) -> None:
    """Entry point of a worker process (spawned).

    ``engines``: the engines this worker may host; their libraries are imported now, before any
    model is known (what makes a pooled worker faster than a fresh one, WarmServe §6)."""
    from warmserve_agent.engines import preload

    t0 = time.perf_counter()
    failed = preload(engines)
    for name, why in failed.items():
        log.warning("event=engine_preload_failed engine=%s err=%s", name, why)
    state: dict[str, Any] = {
        "gpu": None,
        "engine": None,
        "prepared": None,  # engines.prepared.PreparedEngine
        "rank": None,  # a tensor-parallel engine's rank >= 1 (tp_executor.VllmRank)
        "import_s": time.perf_counter() - t0,
        "engines": [e for e in engines if e not in failed],
    }
    retiring: list[threading.Thread] = []  # engines being torn down in the background

    def engine() -> Any:
        if state["engine"] is None:
            raise WorkerError("no engine is running on this worker")
        return state["engine"]

    def settle() -> None:
        """Wait for engines being torn down: only one engine at a time in this process."""
        while retiring:
            retiring.pop().join()

    def prepare_engine(spec: Any) -> None:
        from warmserve_agent.engines import engine_info
        from warmserve_agent.engines.prepared import PreparedEngine

        cur = state["prepared"]
        if cur is not None and cur.slot_id == spec.slot_id and cur.key == spec.prepared_key():
            return  # asked again: it is being built or ready
        if state["engine"] is not None or cur is not None or state["rank"] is not None:
            held = "an engine is running" if cur is None else f"slot {cur.slot_id}'s engine"
            if state["rank"] is not None:
                held = f"rank {state['rank'].rank} of slot {state['rank'].spec.slot_id}"
            raise WorkerError(f"this worker holds {held}; it prepares one engine at a time")
        if spec.engine in failed:
            raise WorkerError(f"engine {spec.engine!r} is unavailable here: {failed[spec.engine]}")
        retiring[:] = [t for t in retiring if t.is_alive()]
        eng = engine_info(spec.engine).create(backend=state.get("mem"))
        state["prepared"] = PreparedEngine(
            eng, spec, backend=state.get("mem"), after=tuple(retiring)
        )

    def prepared_state(slot_id: str) -> Any:
        from warmserve_agent.engines.spec import PreparedReport, PreparedState

        cur = state["prepared"]
        if cur is None or cur.slot_id != slot_id:
            return PreparedReport(PreparedState.NONE)
        return cur.report()

    def drop_prepared(slot_id: str) -> None:
        cur = state["prepared"]
        if cur is not None and cur.slot_id == slot_id:
            state["prepared"] = None
            retiring.append(cur.drop())

    def start_engine(spec: Any) -> str:
        from warmserve_agent.engines import engine_info

        if state["engine"] is not None:
            raise WorkerError("an engine is already running on this worker")
        if spec.engine in failed:
            raise WorkerError(f"engine {spec.engine!r} is unavailable here: {failed[spec.engine]}")
        prep, state["prepared"] = state["prepared"], None
        eng = None
        if prep is not None and prep.slot_id == spec.slot_id:
            eng = prep.claim(spec)  # waits for its build; None: built for other arguments
        elif prep is not None:
            retiring.append(prep.drop())
        settle()
        if eng is None:
            eng = engine_info(spec.engine).create(backend=state.get("mem"))
        try:
            endpoint = eng.start(spec)
        except BaseException:
            with contextlib.suppress(Exception):
                eng.stop()
            raise
        state["engine"] = eng
        return endpoint

    def prepare_rank(spec: Any, rank: int) -> None:
        """Rank ``rank`` of ``spec``'s tensor-parallel engine over this GPU's slot: listens for
        rank 0, whose engine build forms the ranks' process group (prewarm time)."""
        from warmserve_agent.engines.vllm.tp_executor import VllmRank

        cur = state["rank"]
        if cur is not None and cur.spec.slot_id == spec.slot_id and cur.rank == rank:
            return  # asked again
        if state["engine"] is not None or state["prepared"] is not None or cur is not None:
            raise WorkerError("this worker holds an engine; it hosts one engine or rank at a time")
        settle()
        r = VllmRank(backend=state.get("mem"))
        r.prepare(spec, rank)
        state["rank"] = r

    def the_rank(slot_id: str) -> Any:
        r = state["rank"]
        if r is None or r.spec.slot_id != slot_id:
            raise WorkerError(f"this worker hosts no tensor-parallel rank of slot {slot_id}")
        return r

    def stop_rank(slot_id: str) -> None:
        from warmserve_agent.engines.prepared import trim_heap

        r = state["rank"]
        if r is not None and r.spec.slot_id == slot_id:
            state["rank"] = None
            r.stop()
            trim_heap()

    def read_va(va: int, nbytes: int) -> bytes:
        return state["mem"].read(state["gpu"], va, nbytes)

    def verify(va: int, tensors: list[tuple[str, int, int, str]]) -> list[str]:
        from warmserve_agent.engine import verify_shard

        if state.get("mem") is None:
            raise WorkerError("this worker owns no GPU memory to verify")
        return verify_shard(read_va, va, tensors)

    def stop_engine() -> None:
        from warmserve_agent.engines.prepared import trim_heap

        eng, state["engine"] = state["engine"], None
        if eng is not None:
            eng.stop()
            del eng
            trim_heap()  # a pooled process keeps nothing of the engine it hosted

    def mem_init(kind: str, options: dict[str, Any]) -> None:
        """Create this worker's memory backend: the worker owns its GPU's memory (§3)."""
        if state.get("mem") is not None:
            raise WorkerError("memory backend already initialised in this worker")
        if kind == "simulated":
            from warmserve_agent.backends.simulated import SimulatedBackend

            state["mem"] = SimulatedBackend(**options)
        elif kind == "cuda":
            from warmserve_agent.backends.cuda import CudaBackend

            state["mem"] = CudaBackend(**options)
        else:
            raise WorkerError(f"unknown memory backend {kind!r}")

    def mem(op: str, args: tuple[Any, ...]) -> Any:
        backend = state.get("mem")
        if backend is None:
            if op == "close":  # nothing opened: a replacement the agent stopped before mem_init
                return None
            raise WorkerError("memory backend not initialised (mem_init)")
        if op not in _MEM_OPS:
            raise WorkerError(f"unknown memory operation {op!r}")
        return getattr(backend, op)(*args)

    handlers: dict[str, Callable[..., Any]] = {
        "mem_init": mem_init,
        "verify": verify,
        "mem": mem,
        "ping": lambda: {
            "pid": os.getpid(),
            "gpu": state["gpu"],
            "import_s": state["import_s"],
            "engines": state["engines"],
            "engine_builds": _engine_builds(),
        },
        "bind": lambda gpu: state.__setitem__("gpu", gpu),
        "prepare_engine": prepare_engine,
        "prepared_state": prepared_state,
        "drop_prepared": drop_prepared,
        "start_engine": start_engine,
        "layers_ready": lambda n: engine().layers_ready(n),
        "set_kv_capacity": lambda nbytes: engine().set_kv_capacity(nbytes),
        "stats": lambda: engine().stats(),
        "stop_engine": stop_engine,
        "prepare_rank": prepare_rank,
        "start_rank": lambda spec: the_rank(spec.slot_id).start(spec),
        "rank_layers_ready": lambda slot_id, n: the_rank(slot_id).layers_ready(n),
        "rank_kv": lambda slot_id, nbytes: the_rank(slot_id).resize_kv(nbytes),
        "stop_rank": stop_rank,
        # introspection (tests): the parameters of the engine or rank held, in its slot
        "slot_params": lambda: (state["rank"] or engine()).slot_params(),
    }
    while True:
        try:
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # the agent is gone
        if cmd == "exit":
            conn.send((Reply.OK, None))
            break
        try:
            result = handlers[cmd](**kwargs)
            conn.send((Reply.OK, result))
        except Exception as exc:
            conn.send((Reply.ERR, WorkerFault.of(exc).to_wire()))
    stop_engine()
    if state["rank"] is not None:
        stop_rank(state["rank"].spec.slot_id)
    if state["prepared"] is not None:
        retiring.append(state["prepared"].drop())
    settle()
    if state.get("mem") is not None:
        state["mem"].close()


def _engine_builds() -> int:
    """vLLM engines this process built (tests: a prepared activation builds none)."""
    mod = sys.modules.get("warmserve_agent.engines.vllm.engine")
    return int(mod.VllmEngine.builds) if mod is not None else 0


def _child_main() -> None:
    """A worker process's entry (``python -c``): ``argv[1]`` the pipe's descriptor, ``argv[2]``
    the engines, comma-separated."""
    fd, engines = int(sys.argv[1]), tuple(e for e in sys.argv[2].split(",") if e)
    worker_main(Connection(fd), engines)


_MEM_OPS = frozenset(
    {
        "open_gpu",
        "reserve",
        "free_reservation",
        "map",
        "unmap",
        "write",
        "load_ranges",
        "wait_loaded",
        "staging_bytes",
        "pool_info",
        "read",
        "sync",
        "translation",
        "close",
    }
)


# ---- the agent side -----------------------------------------------------------------------
class WorkerHandle:
    """The agent's handle on one worker process (thread-safe, blocking calls)."""

    def __init__(self, engines: tuple[str, ...] = ("simulated",)) -> None:
        self.engines = tuple(engines)
        ours, theirs = socket.socketpair()
        self.started = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), ",".join(self.engines)],
                env=worker_environ(os.environ, sys.path),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.gpu: int | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, cmd: str, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        with self._lock:
            if not self.alive():
                raise WorkerError(f"worker pid {self.pid} (gpu {self.gpu}) is not running")
            try:
                self.conn.send((cmd, kwargs))
                if not self.conn.poll(timeout_s):
                    raise WorkerError(f"worker pid {self.pid}: {cmd} timed out after {timeout_s}s")
                status, result = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                raise WorkerError(f"worker pid {self.pid} (gpu {self.gpu}) died: {exc}") from None
        if status != Reply.OK:
            raise WorkerFault.from_wire(result).exception(f"worker gpu {self.gpu}: {cmd} failed")
        return result

    def kill(self, timeout_s: float = 10.0) -> None:
        """End the process at once (SIGKILL) and reap it, so that ``alive()`` is false when this
        returns (callers then skip its memory, ``backends/workers.py``); the pool's monitor
        replaces it as a dead worker."""
        if self.alive():
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)

    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        # generous: a worker preloading vLLM imports torch + vllm (10-30 s on a loaded CPU)
        return self.call("ping", timeout_s=timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.alive():
            with contextlib.suppress(WorkerError):
                self.call("exit", timeout_s=timeout_s)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout_s)
        else:
            self.proc.poll()  # reap it
        self.conn.close()


class WorkerPool:
    """One worker per GPU plus ``spares`` pre-started processes to replace them at once."""

    def __init__(
        self, gpus: list[int], spares: int = 1, engines: tuple[str, ...] = ("simulated",)
    ) -> None:
        self.gpus = list(gpus)
        self.engines = tuple(engines)  # what every worker preloads and may host
        self.spares_target = spares
        self._spares: deque[WorkerHandle] = deque()
        self._workers: dict[int, WorkerHandle] = {}
        self.restarts: dict[int, int] = dict.fromkeys(gpus, 0)
        self._lock = threading.Lock()
        self._closed = False
        self._refilling = False

    def start(self) -> None:
        handles = [WorkerHandle(self.engines) for _ in self.gpus]
        spares = [WorkerHandle(self.engines) for _ in range(self.spares_target)]
        for g, h in zip(self.gpus, handles, strict=True):
            h.wait_ready()
            h.call("bind", gpu=g)
            h.gpu = g
            self._workers[g] = h
        for s in spares:
            s.wait_ready()
            self._spares.append(s)

    def worker(self, gpu: int) -> WorkerHandle:
        return self._workers[gpu]

    @property
    def spare_count(self) -> int:
        return sum(1 for s in self._spares if s.alive())

    def replace(self, gpu: int) -> WorkerHandle:
        """Give ``gpu`` a new worker (from the spares if one is alive) and start a new spare."""
        with self._lock:
            old = self._workers.get(gpu)
            new = None
            while self._spares and new is None:
                cand = self._spares.popleft()
                if cand.alive():
                    new = cand
                else:
                    cand.stop()  # reap it and close its pipe
            if new is None:
                new = WorkerHandle(self.engines)
                new.wait_ready()
            new.call("bind", gpu=gpu)
            new.gpu = gpu
            self._workers[gpu] = new
            self.restarts[gpu] += 1
        if old is not None:
            threading.Thread(target=old.stop, daemon=True).start()
        threading.Thread(target=self._refill, daemon=True).start()
        log.info(
            "event=worker_replaced gpu=%d old_pid=%s new_pid=%d", gpu, old and old.pid, new.pid
        )
        return new

    def _refill(self) -> None:
        with self._lock:
            if self._refilling:  # one refiller at a time, or spares overshoot the target
                return
            self._refilling = True
        try:
            self._refill_loop()
        finally:
            self._refilling = False

    def _refill_loop(self) -> None:
        while not self._closed and len(self._spares) < self.spares_target:
            h = WorkerHandle(self.engines)
            try:
                h.wait_ready()
            except WorkerError:
                h.stop()
                return
            with self._lock:
                if self._closed:
                    h.stop()
                    return
                self._spares.append(h)

    def dead_gpus(self) -> list[int]:
        return [g for g, h in self._workers.items() if not h.alive()]

    def close(self) -> None:
        self._closed = True
        with self._lock:
            handles = list(self._workers.values()) + list(self._spares)
            self._workers.clear()
            self._spares.clear()
        for h in handles:
            h.stop()
