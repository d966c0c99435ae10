"""Run the node agent: build backend, store, core, worker pool and the gRPC server.

:class:`AgentServer` is what ``warmserve agent`` runs and what the tests start on loopback.
Security: with ``tls_cert``/``tls_key`` the server speaks TLS; with ``client_ca`` it requires
client certificates signed by that CA with the clientAuth usage (mutual TLS) — the TLS handshake
itself refuses clients without one — and naming an allowed identity (``client_ids``,
``reader_ids``; :class:`~warmserve_agent.auth.IdentityInterceptor`).  With a token file every
call except the standard health service must carry ``authorization: Bearer <token>`` or is
refused with UNAUTHENTICATED (health stays open for kubelet probes).

Its parts: the settings (:mod:`~warmserve_agent.config`), who may call the API
(:mod:`~warmserve_agent.auth`), which memory backend serves the page pools
(:mod:`~warmserve_agent.memory_setup`) and the gRPC servicer (:mod:`~warmserve_agent.service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from warmserve.api.agent.v1 import agent_pb2_grpc as pb_grpc
from warmserve_agent.auth import (
    ClientIdentities,
    IdentityInterceptor,
    TokenInterceptor,
    check_exposure,
)
from warmserve_agent.config import AgentConfig, ConfigError
from warmserve_agent.fencing import Bounds, Fence, FenceError
from warmserve_agent.memory import MemoryManager
from warmserve_agent.memory_setup import (
    cuda_gpu_sizes,
    make_backend,
    memory_in_workers,
    new_memory_dir,
)
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import EventKind
from warmserve_agent.service import AgentService
from warmserve_agent.service_describe import ServiceInfo
from warmserve_agent.shm import MemoryDir, MemoryDirBusy, remove_stale
from warmserve_agent.sources import SourceSettings
from warmserve_agent.sources.fetch_records import FetchStatus
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.store import StoreError, WeightStore

log = logging.getLogger("warmserve.agent")


class AgentServer:
    """The running agent (``await AgentServer(cfg).start()``; ``await stop()``)."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.agent_id = uuid.uuid4().hex
        self.pool: Any = None
        self.core: NodeCore | None = None
        self.service: AgentService | None = None
        self.fetcher: ModelFetcher | None = None
        self.fence = Fence()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: Any = None
        self._health: Any = None
        self._memdir: MemoryDir | None = None

    @property
    def address(self) -> str:
        host = self.cfg.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> AgentServer:
        """Start everything; on failure, undo what was started (workers, files) and re-raise."""
        try:
            return await self._start()
        except BaseException:
            await self.stop(0)
            raise

    async def _start(self) -> AgentServer:
        cfg = self.cfg
        exposure_warning = check_exposure(cfg)  # before anything is started
        identities = self._identities()
        try:  # a fence it cannot read: refuse to start rather than forget it
            bounds = Bounds(cfg.fencing_max_skew_s, cfg.fencing_max_term_jump)
            self.fence = Fence(cfg.fencing_path, cfg.require_fencing_token, bounds)
        except (FenceError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        in_workers = memory_in_workers(cfg)
        if in_workers and not cfg.use_workers:
            raise ConfigError("memory owned by workers needs worker processes (use_workers)")
        if in_workers and cfg.recycle_workers:
            raise ConfigError(
                "--recycle-workers cannot be combined with memory owned by the workers: "
                "recycling a worker would drop the weights it keeps resident"
            )
        sizes = cfg.simulate_gpus if cfg.simulate_gpus is not None else cuda_gpu_sizes()
        if not sizes:
            raise ConfigError("no GPUs found; use --simulate-gpus to run without GPUs")
        memdir = None
        if cfg.simulate_gpus is not None:
            if cfg.memory_dir is None:  # our siblings of agents that died (kill -9, OOM kill)
                await asyncio.to_thread(remove_stale, cfg.memory_root)
            try:
                self._memdir = MemoryDir.claim(new_memory_dir(cfg))
            except MemoryDirBusy as exc:
                raise ConfigError(str(exc)) from None
            memdir = self._memdir.path
        gpu_ids = list(range(len(sizes)))
        if cfg.use_workers:
            from warmserve_agent.engine_host import WorkerEngine
            from warmserve_agent.worker import WorkerPool

            self.pool = WorkerPool(gpu_ids, spares=cfg.spare_workers, engines=cfg.engines)
            await asyncio.to_thread(self.pool.start)
            pool = self.pool

            def factory(group: Any) -> Any:
                return WorkerEngine(pool, group)
        else:
            from warmserve_agent.engine_host import InProcessEngine

            def factory(group: Any) -> Any:
                return InProcessEngine(group)

        backend = make_backend(cfg, self.pool, memdir)
        store = WeightStore(cfg.model_dir, host_cache_bytes=cfg.host_cache_bytes)
        try:
            await asyncio.to_thread(store.upgrade_layout)  # before anything reads or fetches
        except StoreError as exc:
            raise ConfigError(str(exc)) from None
        t_open = time.perf_counter()
        self.core = NodeCore(
            MemoryManager(backend),
            store,
            dict(zip(gpu_ids, sizes, strict=True)),
            factory,
            node_name=cfg.node_name,
            engine_host=cfg.engine_host,
            advertise_host=cfg.advertise_host,
            traces=(cfg.engine_traces_endpoint, cfg.engine_trace_sample_ratio),
            engines=cfg.engines,
            default_engine=cfg.default_engine,
            engine_policy=cfg.engine_policy,
            rank_workers=cfg.use_workers,
        )
        log.info(
            "event=gpus_opened gpus=%d backend=%s seconds=%.2f",
            len(sizes),
            backend.name,
            time.perf_counter() - t_open,
        )
        info = ServiceInfo(agent_id=self.agent_id, started_unix=time.time())
        if self.pool is not None:
            info.spare_workers = lambda: self.pool.spare_count
            info.worker_pid = lambda g: self.pool.worker(g).pid
            info.worker_restarts = lambda g: self.pool.restarts[g]
        if cfg.recycle_workers and self.pool is not None:
            pool = self.pool

            def recycle(gpus: tuple[int, ...]) -> None:
                # A fresh process per instance: no engine state leaks into the next one; a
                # pre-started spare takes over at once.
                for g in gpus:
                    pool.replace(g)

            self.core.on_instance_ended = recycle
        self.fetcher = self._make_fetcher(store)
        self.service = AgentService(
            self.core,
            info,
            max_watch_queue=cfg.watch_queue_max,
            watch_write_timeout_s=cfg.watch_write_timeout_s,
            fetcher=self.fetcher,
            fence=self.fence,
        )
        self.service.bind_loop(asyncio.get_running_loop())

        interceptors: list[grpc.aio.ServerInterceptor] = []
        if identities is not None:
            interceptors.append(IdentityInterceptor(identities))
            log.info(
                "event=client_identities callers=%s readers=%s",
                ",".join(sorted(identities.callers)),
                ",".join(sorted(identities.readers)) or "-",
            )
        if cfg.token_file is not None:
            token = Path(cfg.token_file).read_text().strip()
            if not token:
                raise ConfigError(f"token file {cfg.token_file} is empty")
            interceptors.append(TokenInterceptor(token))
        self.server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_NodeAgentServicer_to_server(self.service, self.server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        if cfg.engine_host in ("0.0.0.0", "::") and not cfg.advertise_host:
            raise ConfigError(
                f"engines bind {cfg.engine_host}: set --advertise-host to the address clients "
                "use to reach this node (e.g. the pod IP)"
            )
        if cfg.tls_cert is not None or cfg.tls_key is not None:
            if cfg.tls_cert is None or cfg.tls_key is None:
                raise ConfigError("--tls-cert and --tls-key go together")
            if cfg.client_ca is None and cfg.token_file is None:
                raise ConfigError(
                    "TLS without client authentication would accept any caller: add "
                    "--client-ca (mutual TLS) and/or --token-file"
                )
            creds = grpc.ssl_server_credentials(
                [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())],
                root_certificates=Path(cfg.client_ca).read_bytes() if cfg.client_ca else None,
                require_client_auth=cfg.client_ca is not None,
            )
            self.port = self.server.add_secure_port(cfg.listen, creds)
        else:
            if cfg.client_ca is not None:
                raise ConfigError("--client-ca needs --tls-cert and --tls-key")
            self.port = self.server.add_insecure_port(cfg.listen)
        if not self.port:
            raise ConfigError(f"cannot listen on {cfg.listen}")
        await self.server.start()
        for svc in ("", "warmserve.agent.v1.NodeAgent"):
            await self._health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port is not None:
            self._start_metrics(cfg.metrics_port)
        self._tasks.append(asyncio.create_task(self._grace_loop()))
        if self.pool is not None:
            self._tasks.append(asyncio.create_task(self._monitor_loop()))
        if exposure_warning:
            log.warning(exposure_warning)
        log.info(
            "event=agent_started node=%s listen=%s gpus=%d backend=%s agent_id=%s",
            cfg.node_name,
            self.address,
            len(sizes),
            backend.name,
            self.agent_id,
        )
        return self

    def _identities(self) -> ClientIdentities | None:
        """Who may call (mutual TLS only): the allowlist of client certificate identities."""
        cfg = self.cfg
        if cfg.client_ca is None:
            if cfg.client_ids or cfg.reader_ids:
                raise ConfigError(
                    "--allow-client-id/--allow-reader-id check client certificates: they need "
                    "mutual TLS (--tls-cert, --tls-key, --client-ca)"
                )
            return None
        try:
            return ClientIdentities.parse(cfg.client_ids, cfg.reader_ids)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _make_fetcher(self, store: WeightStore) -> ModelFetcher:
        cfg = self.cfg
        core = self.core
        assert core is not None
        token = ""
        if cfg.hf_token_file is not None:
            token = Path(cfg.hf_token_file).read_text().strip()
        settings = SourceSettings(
            hf_endpoint=cfg.hf_endpoint,
            hf_token=token,
            s3_endpoint_url=cfg.s3_endpoint_url,
            s3_region=cfg.s3_region,
            pvc_root=cfg.pvc_root,
            allowed_paths=tuple(cfg.allowed_paths),
        )

        def on_change(st: FetchStatus) -> None:
            core.emit(
                EventKind.FETCH, st.model, f"{st.state.value} {st.bytes_done}/{st.bytes_total}"
            )

        return ModelFetcher(
            store,
            settings,
            lock=core.lock,
            in_use=core.models_in_use,
            on_change=on_change,
            budget_bytes=cfg.store_budget_bytes,
            reserve=cfg.store_reserve,
            attempts=cfg.fetch_attempts,
            backoff_s=cfg.fetch_backoff_s,
        )

    def _start_metrics(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        from warmserve_agent.metrics import AgentCollector

        assert self.core is not None
        reg = CollectorRegistry()
        restarts = (lambda g: self.pool.restarts[g]) if self.pool is not None else (lambda g: 0)
        reg.register(AgentCollector(self.core, restarts, self.fence))
        if self.fetcher is not None:
            from warmserve_agent.sources.fetch_metrics import FetchCollector

            reg.register(FetchCollector(self.fetcher, self.core.node_name))
        self._metrics_server, _ = start_http_server(port, addr=self.cfg.metrics_host, registry=reg)
        self.metrics_port = self._metrics_server.server_port

    async def _grace_loop(self) -> None:
        """Safety net for grace lending (§4.1): Eq. 1 is re-checked on each request completion
        (the engine's event, ``engine_events.py``); this slow timer catches an event lost on
        the way (a full socket buffer, an engine without events)."""
        assert self.core is not None
        while True:
            await asyncio.sleep(self.cfg.grace_interval_s)
            await asyncio.to_thread(self.core.refresh_grace_all)

    async def _monitor_loop(self) -> None:
        """Replace dead worker processes from the spares; drop the instances they hosted.  A
        failure while handling one GPU is logged and retried at the next tick: the loop must
        outlive it, or no later dead worker would ever be replaced."""
        assert self.core is not None and self.service is not None
        while True:
            await asyncio.sleep(self.cfg.monitor_interval_s)
            for g in self.pool.dead_gpus():
                try:
                    await self._replace_dead_worker(g)
                except Exception:
                    log.exception("event=worker_replace_failed gpu=%d (retried)", g)

    async def _replace_dead_worker(self, g: int) -> None:
        assert self.core is not None
        if memory_in_workers(self.cfg):
            # The GPU's memory died with its owner: drop what it held, then give the
            # replacement worker a fresh page pool.
            insts, slots = await asyncio.to_thread(self.core.gpu_lost, g)
            new = await asyncio.to_thread(self.pool.replace, g)
            await asyncio.to_thread(self.core.gpu_restored, g)
            iid = ",".join(insts)
            msg = f"worker of GPU {g} died with its memory ({len(slots)} slots lost); "
            msg += f"replaced by pid {new.pid}"
        else:
            iid = await asyncio.to_thread(self.core.worker_died, g) or ""
            new = await asyncio.to_thread(self.pool.replace, g)
            msg = f"worker of GPU {g} died; replaced by pid {new.pid}"
        await asyncio.to_thread(self.core.worker_replaced, g)
        if iid:
            msg += f"; instance(s) {iid} lost"
        log.warning("event=worker_died gpu=%d instance=%s new_pid=%d", g, iid, new.pid)
        self.core.emit(EventKind.WORKER_REPLACED, str(g), msg)

    async def stop(self, grace_s: float = 1.0) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.service is not None:
            await self.service.instances.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.core is not None:
            await asyncio.to_thread(self.core.shutdown)
            self.core.mm.close()
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)
        if self._memdir is not None:
            self._memdir.release(keep=self.cfg.keep_memory)
            self._memdir = None
