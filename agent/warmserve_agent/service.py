"""The gRPC service ``warmserve.agent.v1.NodeAgent`` over :class:`~warmserve_agent.node.NodeCore`.

Responsibilities beyond translating messages:

* **Idempotency.** Every mutating call carries a ``request_id``.  The first call with an id runs;
  a replay with the same id and the same arguments waits for / returns the first outcome (the
  same answer, or the same error) without redoing the work; the same id with different
  arguments is refused with ALREADY_EXISTS.  The last ``max_request_ids`` ids are remembered.
* **Fencing.** Every mutating call and ``Describe`` pass the caller's ``fencing_token`` through
  :mod:`~warmserve_agent.fencing` before anything changes: a deposed operator leader's late
  call is refused (FAILED_PRECONDITION, ``fenced: ...``).
* **Status codes.** :class:`~warmserve_agent.node_records.Refusal` carries the gRPC status name
  and a message a person can act on; it becomes ``context.abort(code, message)``.
* **Streams.** ``Prewarm`` streams progress of its slot until the requested layers are resident;
  ``Watch`` streams every state change (the core's event bus) with the changed object.  Each event
  is fanned out once (one hop onto the event loop, converted to protobuf once for all watchers) into
  per-watcher queues of at most ``max_watch_queue`` events; a watcher whose queue overflows or that
  does not take a message for ``watch_write_timeout_s`` (a client that stopped reading) is dropped
  with RESOURCE_EXHAUSTED and must re-Watch with a snapshot (issue 16: 20 stalled watchers made the
  agent ~4x slower and held 8 MB).
* **Error messages** echo client input only through :mod:`~warmserve_agent.safe_text` and are
  bounded as a whole (printable, at most 1 KiB).
* Core calls run in threads (``asyncio.to_thread``): loading and engine start-up block.

:class:`AgentService` is built in layers, one module per concept (lower modules never import
upper ones; ``[tool.importlinter]`` in pyproject.toml enforces it):

* :mod:`~warmserve_agent.service_idempotency`: request ids, run-once calls, :func:`abort`.
* :mod:`~warmserve_agent.service_describe`: ``Describe``, the protobuf views of GPUs, slots and
  instances, the cached model catalogue.
* :mod:`~warmserve_agent.service_fetch`: fetching a model named by ``source``, ``InspectModel``.
* :mod:`~warmserve_agent.service_watch`: the event fan-out and ``Watch``.
* :mod:`~warmserve_agent.service_prewarm`: ``Prewarm`` (§4.1 prewarm slots) and ``Evict``.
* :mod:`~warmserve_agent.service_instances`: ``Activate`` (§4.2), ``BeginGrace`` and
  ``GetLendable`` (Eq. 1 lending), ``EndInstance``.
* this module: the servicer, which owns the state all of them share.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from warmserve_agent.api.v1 import agent_pb2 as pb
from warmserve_agent.api.v1 import agent_pb2_grpc as pb_grpc
from warmserve_agent.fencing import Fence
from warmserve_agent.node import NodeCore
from warmserve_agent.service_describe import ServiceInfo
from warmserve_agent.service_idempotency import IdemEntry
from warmserve_agent.service_instances import InstanceRPCs
from warmserve_agent.service_prewarm import PrewarmRPCs
from warmserve_agent.service_watch import Watcher, WatchStreams
from warmserve_agent.sources.fetcher import ModelFetcher


class AgentService(PrewarmRPCs, InstanceRPCs, WatchStreams, pb_grpc.NodeAgentServicer):
    """The ``NodeAgent`` servicer (see module docstring)."""

    def __init__(
        self,
        core: NodeCore,
        info: ServiceInfo,
        *,
        max_request_ids: int = 10000,
        max_watch_queue: int = 1024,
        watch_write_timeout_s: float = 30.0,
        fetcher: ModelFetcher | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.core = core
        self.info = info
        self.fetcher = fetcher
        self.fence = fence if fence is not None else Fence()
        self._usage: tuple[int, float, pb.StoreInfo] | None = None
        self.max_request_ids = max_request_ids
        self.max_watch_queue = max_watch_queue
        self.watch_write_timeout_s = watch_write_timeout_s
        self._idem: OrderedDict[str, IdemEntry] = OrderedDict()
        self._catalog_cache: tuple[tuple[int, ...], float, list[pb.ModelInfo]] | None = None
        self._watchers: set[Watcher] = set()
        self._wakers: set[asyncio.Event] = set()  # Prewarm streams: "something changed"
        self._pb_cache: OrderedDict[int, pb.WatchEvent] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.watchers_dropped = 0
        core.subscribe(self._on_event)
