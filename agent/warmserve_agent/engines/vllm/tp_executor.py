"""Tensor parallelism over the agent's pooled workers: vLLM's ranks are the GPUs' own processes.

vLLM's multiprocessing executor spawns one fresh process per rank (import, CUDA context, model
build: the cold start WarmServe's universal workers exist to avoid).  Here rank 0 is the engine
in the pooled worker of the group's first GPU (``engine.VllmEngine``) and rank ``r >= 1`` is a
:class:`VllmRank` in the pooled worker of GPU ``r`` — already running, libraries imported — over
rank ``r``'s own slot (``store.SlotLayout``: each rank's slot holds exactly the shards vLLM's TP
layers load, so the loader binds views there as for TP 1, no copy).

:class:`PooledRankExecutor` is the executor **class** rank 0 hands vLLM
(``--distributed-executor-backend``): vLLM's ``UniProcExecutor`` for rank 0 plus a link to each
other rank — a Unix socket in the agent's private directory (``EngineSpec.tp_peers``, opened
with the slot's key ``tp_authkey``) carrying vLLM's worker calls (``collective_rpc``: sent to
every rank, run here, then every rank's answer awaited).  The ranks' process group (gloo on CPU
over a file store in the same directory, ``tp_init``; NCCL on a GPU, vLLM's choice for the
platform) forms in ``init_device`` — so when the engine is prepared at prewarm time, the group
exists before the slot is activated, and an activation only opens the endpoint.

Per-rank state the agent drives directly through each rank's worker pipe (``worker.py``):
``start_rank`` (the weights mapped since preparation), ``rank_layers_ready`` (per-layer gates, a
rank never reads a layer before it is resident) and ``rank_kv`` (KV pages mapped or revoked
on that rank before rank 0's scheduler uses or after it gives up blocks: every rank holds the
same blocks, its own heads of them, and zeroes a block when the scheduler hands it out).  A
rank whose process dies breaks the link: rank 0's next call fails, the engine core stops, and
the agent's worker monitor drops the GPU's slots and instances (``NodeCore.gpu_lost``), freeing
every rank's slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import socket
import threading
from concurrent.futures import Future
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from warmserve_agent.engine import EngineError

log = logging.getLogger("warmserve.agent.engine.vllm")

EXTRA_KEY = "warmserve_tp"  # model_loader_extra_config: the rendezvous rank 0 connects to
CONNECT_TIMEOUT_S = 60.0


class RankError(RuntimeError):
    """A tensor-parallel rank failed a call, or its process is gone."""


def _executor_base() -> type:
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


def executor_class() -> type:
    """:class:`PooledRankExecutor`, built on vLLM's ``UniProcExecutor`` (imported lazily: the
    agent imports this package without vLLM)."""
    return _make_executor_class()


_CLASS: list[type] = []


def _make_executor_class() -> type:
    if _CLASS:
        return _CLASS[0]
    base = _executor_base()

    class PooledRankExecutor(base):  # type: ignore[misc, valid-type]
        """See module docstring."""

        def _init_executor(self) -> None:
            from multiprocessing import Lock

            from vllm.v1.worker.worker_base import WorkerWrapperBase

            tp = (self.vllm_config.load_config.model_loader_extra_config or {}).get(EXTRA_KEY)
            if not tp:
                raise EngineError("PooledRankExecutor needs the ranks' rendezvous (EngineSpec)")
            key = bytes.fromhex(tp["authkey"])
            self.links: list[Connection] = []
            for addr in tp["peers"]:
                self.links.append(_connect(addr, key))
            init = tp["init"]
            for r, link in enumerate(self.links, start=1):
                link.send(("init", self.vllm_config, r, init))
            self.driver_worker = WorkerWrapperBase(rpc_rank=0)
            self.driver_worker.init_worker(
                all_kwargs=[
                    dict(
                        vllm_config=self.vllm_config,
                        local_rank=0,
                        rank=0,
                        distributed_init_method=init,
                        is_driver_worker=True,
                        shared_worker_lock=Lock(),
                    )
                ]
            )
            self._gather("init_worker")
            unlink_stale_rank_shm(init, 0)
            self.collective_rpc("init_device")  # the ranks' process group forms here
            self.collective_rpc("load_model")
            self.collective_rpc(warm_vocab_masking)  # each rank alone: no collective inside
            from vllm.platforms import current_platform

            current_platform.update_block_size_for_backend(self.vllm_config)

        def _gather(self, what: str, want: bool = False) -> list[Any]:
            out: list[Any] = []
            errors: list[str] = []
            for r, link in enumerate(self.links, start=1):
                try:
                    status, value = link.recv()
                except (EOFError, OSError) as exc:
                    errors.append(f"rank {r} is gone ({type(exc).__name__})")
                    continue
                if status != "ok":
                    errors.append(f"rank {r}: {value}")
                out.append(value if want else None)
            if errors:
                raise RankError(f"tensor-parallel {what} failed: {'; '.join(errors)}")
            return out

        def collective_rpc(  # type: ignore[override]
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
            non_block: bool = False,
            single_value: bool = False,
        ) -> Any:
            import cloudpickle
            from vllm.v1.outputs import AsyncModelRunnerOutput
            from vllm.v1.serial_utils import run_method

            kwargs = kwargs or {}
            sent = method if isinstance(method, str) else cloudpickle.dumps(method)
            for link in self.links:  # every rank runs it at once (collectives inside)
                link.send(("rpc", sent, args, kwargs, not single_value))
            try:
                local = run_method(self.driver_worker, method, args, kwargs)
                if isinstance(local, AsyncModelRunnerOutput):
                    local = local.get_output()
            finally:
                remote = self._gather(str(method), want=not single_value)
            result = local if single_value else [local, *remote]
            if not non_block:
                return result
            fut: Future[Any] = Future()
            fut.set_result(result)
            return fut

        def check_health(self) -> None:
            self.collective_rpc("check_health", timeout=10)

        def shutdown(self) -> None:
            for link in getattr(self, "links", []):
                with contextlib.suppress(Exception):
                    link.send(("close",))
                    link.close()
            self.links = []
            if getattr(self, "driver_worker", None) is not None:
                self.driver_worker.shutdown()

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return False  # a step's calls reach every rank in order, one step at a time

    PooledRankExecutor.__module__ = __name__
    PooledRankExecutor.__qualname__ = "PooledRankExecutor"
    _CLASS.append(PooledRankExecutor)
    return PooledRankExecutor


def warm_vocab_masking(wrapper: Any) -> None:
    """Compile vLLM's vocabulary-parallel masking now, while the engine is prepared: with TP > 1
    the embedding masks token ids through a ``torch.compile``'d helper that is compiled at the
    first forward, and the slot engine skips vLLM's profile and warm-up runs (the KV size is
    given), so the first request paid it (3.9-5.7 s of a TP=2 hit's first token on this CPU,
    py-spy: inductor's load inside ``VocabParallelEmbedding.forward``).  Token ids are int32 as
    in vLLM's input buffer; two lengths, as the compile is dynamic."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        get_masked_input_and_mask,
    )

    model = getattr(wrapper, "worker", wrapper).model_runner.model
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and m.tp_size > 1:
            si = m.shard_indices
            for n in (1, 5):
                get_masked_input_and_mask(
                    torch.zeros(n, dtype=torch.int32, device=m.weight.device),
                    si.org_vocab_start_index,
                    si.org_vocab_end_index,
                    si.num_org_vocab_padding,
                    si.added_vocab_start_index,
                    si.added_vocab_end_index,
                )
            return  # one compile serves every module (the same helper)


def remove_group_shm(slot_id: str, shm_dir: str = "/dev/shm") -> int:
    """Unlink what vLLM's CPU shared-memory all-reduce left of ``slot_id``'s group: one segment
    per rank, named after the group's store (``<slot>.store-tp:...-cpushm_<rank>``), which a
    rank killed inside the group never unlinks (seen: one pair per killed TP=2 group).
    Returns how many were removed."""
    return _unlink(_group_shm(shm_dir, slot_id + ".store", "*"))


def unlink_stale_rank_shm(init_method: str, rank: int, shm_dir: str = "/dev/shm") -> int:
    """Before rank ``rank`` joins the group meeting at ``init_method``: unlink its shared-memory
    segment left by an earlier group of the same slot.  vLLM creates it exclusively and unlinks
    it only when the process exits (its manager lives as long as the process), and a slot's
    group is named the same at every build, so a pooled worker building the slot's engine again
    (a prepared engine dropped, then built at activation) would fail with EEXIST.  A process
    still mapping the old segment keeps it; only the name goes.  Each rank removes only its own:
    the others open it after the group's barrier, when it is the new one."""
    ident = os.path.basename(init_method.removeprefix("file://"))
    return _unlink(_group_shm(shm_dir, ident, str(int(rank))))


def _group_shm(shm_dir: str, ident: str, rank: str) -> str:
    """vLLM's name for a rank's segment (``<ident>-<group>-[<ranks>]-cpushm_<rank>``, ``ident``
    the basename of the group's store, ``<slot>.store``: ``prepared_engines._tp_rendezvous``) as
    a glob over ``shm_dir``; ``rank`` ``*`` for every rank."""
    return os.path.join(glob.escape(shm_dir), glob.escape(ident) + f"-*-cpushm_{rank}")


def _unlink(pattern: str) -> int:
    n = 0
    for path in glob.glob(pattern):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            n += 1
    return n


def _connect(addr: str, key: bytes) -> Connection:
    """A link to the rank listening on ``addr`` (it may still be starting: retried)."""
    import time

    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(addr, family="AF_UNIX", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise EngineError(
                    f"tensor-parallel rank at {addr} did not come up in {CONNECT_TIMEOUT_S:.0f} s"
                ) from None
            time.sleep(0.05)


def slot_params(model: Any, mem: Any) -> dict[str, tuple[int, int, bytes]]:
    """Each parameter of ``model`` as ``(offset, nbytes, slot bytes)``: its data pointer's
    offset from the slot's base (``-1`` outside the slot's weight range, bytes empty) and the
    bytes the slot holds there, read through the slot memory rather than the tensor (tests
    compare them with the checkpoint's shard for the rank)."""
    base, limit = mem.base, mem.region.weight_bytes
    out: dict[str, tuple[int, int, bytes]] = {}
    for name, p in model.named_parameters():
        off, n = p.data_ptr() - base, p.numel() * p.element_size()
        inside = off >= 0 and off + n <= limit
        out[name] = (off if inside else -1, n, mem.read(off, n) if inside else b"")
    return out


def _own_region(spec: Any, rank: int) -> Any:
    """Rank ``rank``'s region as its own worker sees it: GPU ``rank``'s worker owns that GPU's
    memory when memory lives in the workers, so the region is local there (the spec marks only
    rank 0's, the engine's process)."""
    return dataclasses.replace(spec.regions[rank], local=True)


# ---- rank r >= 1, in the pooled worker of GPU r -------------------------------------------------
class VllmRank:
    """Rank ``rank`` of a tensor-parallel vLLM engine over this GPU's slot (module docstring):
    listens for rank 0's link, then runs vLLM's worker calls over the slot's views."""

    def __init__(self, backend: Any = None) -> None:
        self._backend = backend
        self.spec: Any = None
        self.rank = 0
        self._mem: Any = None
        self._slot: Any = None
        self._gate: Any = None
        self._key = ""
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._worker: Any = None
        self._kv: Any = None  # (nb, geometry, order, need, first_page)
        self._granted = 0
        self._nb = 0
        self.error = ""

    def prepare(self, spec: Any, rank: int) -> None:
        """Open this rank's slot (pages not mapped yet stay inaccessible) and listen."""
        import torch

        from warmserve_agent.engines.layer_gate import LayerGate
        from warmserve_agent.engines.slotmem import SlotMemory, SlotMemoryKind
        from warmserve_agent.engines.vllm.loader import ActiveSlot, activate_slot

        self.spec, self.rank = spec, rank
        region = _own_region(spec, rank)
        self._mem = SlotMemory(region, self._backend, partial=True)
        device = torch.device(
            f"cuda:{region.gpu}" if self._mem.kind == SlotMemoryKind.DEVICE else "cpu"
        )
        self._gate = LayerGate(spec.layers_total, spec.layers_resident)
        self._slot = ActiveSlot(spec, self._mem, device, gate=self._gate, rank=rank)
        self._key = spec.slot_id or spec.instance_id
        activate_slot(self._key, self._slot)
        addr = spec.tp_peers[rank - 1]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(addr)  # a previous preparation's socket of the same slot
        self._listener = Listener(addr, family="AF_UNIX", authkey=bytes.fromhex(spec.tp_authkey))
        self._thread = threading.Thread(target=self._serve, name=f"tp-rank-{rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from warmserve_agent.engines.vllm.loader import slot_kv_cache

        listener = self._listener
        if listener is None:
            return
        try:
            conn = listener.accept()
        except OSError:
            return  # shut down before rank 0 came (stop)
        with conn, slot_kv_cache(self._slot):
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "close":
                    break
                try:
                    conn.send(("ok", self._run(msg)))
                except Exception as exc:
                    log.exception("event=tp_rank_call_failed rank=%d", self.rank)
                    self.error = f"{type(exc).__name__}: {exc}"
                    with contextlib.suppress(Exception):
                        conn.send(("err", self.error))
        self._shutdown_worker()

    def _run(self, msg: tuple[Any, ...]) -> Any:
        if msg[0] == "init":
            from multiprocessing import Lock

            from vllm.v1.worker.worker_base import WorkerWrapperBase

            from warmserve_agent.engines.vllm.cpu_threads import use_rank_threads

            _, config, rank, init = msg
            use_rank_threads(self.spec.tp_size)  # this thread runs the rank's forwards
            unlink_stale_rank_shm(init, rank)
            self._worker = WorkerWrapperBase(rpc_rank=0, global_rank=rank)
            self._worker.init_worker(
                all_kwargs=[
                    dict(
                        vllm_config=config,
                        local_rank=0,
                        rank=rank,
                        distributed_init_method=init,
                        is_driver_worker=False,
                        shared_worker_lock=Lock(),
                    )
                ]
            )
            return None
        import cloudpickle
        from vllm.v1.outputs import AsyncModelRunnerOutput
        from vllm.v1.serial_utils import run_method

        _, method, args, kwargs, want = msg
        if method == "initialize_from_config":  # every rank's pool has rank 0's block count
            self._nb = int(args[0][0].num_blocks)
        if isinstance(method, bytes):
            method = cloudpickle.loads(method)
        out = run_method(self._worker, method, args, kwargs)
        if isinstance(out, AsyncModelRunnerOutput):
            out = out.get_output()
        if method == "initialize_from_config":  # its KV cache exists now
            from warmserve_agent.engines.vllm.hooks import runner_zeroes_blocks

            runner_zeroes_blocks(self._worker.worker.model_runner)
        return out if want else None

    # ---- driven by the agent, through this worker's pipe ----------------------------------------
    def start(self, spec: Any) -> None:
        """Activation: the weights mapped since the preparation, the KV the agent mapped."""
        self._mem.update(_own_region(spec, self.rank))
        self.layers_ready(spec.layers_resident)
        if self._nb:  # built (prepared at prewarm): before rank 0 hands the blocks out
            self.resize_kv(spec.kv_capacity_bytes // spec.tp_size)

    def layers_ready(self, n: int) -> None:
        self._gate.advance(n)

    def resize_kv(self, nbytes: int) -> int:
        """Map (or revoke) this rank's pages of the blocks a per-rank capacity of ``nbytes``
        covers, as rank 0's ``SlotKvPool.resize`` does on its own (same geometry)."""
        import bisect

        from warmserve_agent.engines.vllm.kv import measure_geometry, zero_null_block

        if not self._slot.kv or not self._nb:
            raise EngineError(f"rank {self.rank}: its KV cache is not built yet")
        if nbytes < 0:  # what it holds now
            return self._granted * self._kv[1].block_bytes if self._kv else 0
        if self._kv is None:
            start, _ = self._slot.kv_range
            nb = self._nb
            geo = measure_geometry(self._slot, self._mem, nb)
            page = self._mem.region.page_bytes
            order, need = geo.page_order(page, self._mem.region.kv_bytes // page)
            self._kv = (nb, geo, order, need, start // page)
        nb, geo, order, need, first = self._kv

        def pages(blocks: int) -> list[int]:
            k = bisect.bisect_left(need, min(blocks, geo.num_blocks))
            return [first + p for p in order[:k]]

        def vblocks(t: int) -> int:
            return t if geo.num_blocks == nb else (nb if t >= 1 else 0)

        t = min(geo.num_blocks, max(0, nbytes) // geo.block_bytes)
        if t > self._granted:
            self._mem.grant_pages(pages(t))
            zero_null_block(self._slot, nb, vblocks(self._granted), vblocks(t))
        elif t < self._granted:
            keep = set(pages(t))
            self._mem.revoke_pages(p for p in pages(self._granted) if p not in keep)
        self._granted = t
        return t * geo.block_bytes

    def model(self) -> Any:
        assert self._worker is not None
        return self._worker.worker.model_runner.model

    def slot_layout(self) -> dict[str, Any]:
        return {
            "base": self._mem.base,
            "weight_bytes": self._mem.region.weight_bytes,
            "kv_range": self._slot.kv_range,
            "params": {
                n: (p.data_ptr(), p.numel() * p.element_size())
                for n, p in self.model().named_parameters()
            },
        }

    def slot_params(self) -> dict[str, tuple[int, int, bytes]]:
        """Introspection for tests: :func:`slot_params` of this rank's model and slot."""
        assert self._mem is not None
        return slot_params(self.model(), self._mem)

    def _shutdown_worker(self) -> None:
        w, self._worker = self._worker, None
        if w is not None:
            with contextlib.suppress(Exception):
                w.shutdown()

    def stop(self) -> None:
        from warmserve_agent.engines.vllm.hooks import cleanup_vllm_process_state
        from warmserve_agent.engines.vllm.loader import release_slot

        if self._gate is not None:
            self._gate.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            # closing a listening socket does not wake a thread blocked in accept(); a
            # shutdown does (the serving thread then sees no listener and ends)
            with contextlib.suppress(Exception):
                listener._listener._socket.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
            with contextlib.suppress(Exception):
                listener.close()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._shutdown_worker()
        if self._key:
            release_slot(self._key)
        if self._mem is not None:
            self._mem.close()
            self._mem = None
        cleanup_vllm_process_state()
