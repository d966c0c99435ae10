"""kopf registrations (thin) and the operator's one composition root.

Importing this module registers the handlers in kopf's default registry; ``warmserve operator``
(:mod:`warmserve_operator.cli`) collects the flags into kopf's memo, imports it and runs
kopf.  :func:`startup` builds every object of the process once (API port, agent pool,
metrics, the loop).  The handlers only

* keep two kopf indexes, of ModelDeployments (by UID) and GPUNodes (by name): the loop reads
  them instead of listing the API every poll (issue 11);
* (validation and the ``Accepted`` / ``SpecChanged`` Events are the loop's, :mod:`.deployments`:
  a kopf create/update handler made kopf write a diff-base annotation on every new object, one
  more write and watch event per deployment, which throttled 1,000 deployments at startup);
* tear a deployment down on delete: kopf adds the finalizer ``warmserve.io/teardown`` because a
  delete handler exists, and removes it only when :mod:`.teardown` reports that nothing the
  deployment owns is left on any agent (otherwise it retries);
* start the loop at startup and stop it at cleanup.

kopf's own bookkeeping goes to annotations with the ``warmserve.io`` prefix (not to ``status``,
which the operator writes as a whole); it keeps no diff-base (:class:`NoDiffBase`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import kopf

from warmserve.api.crd import GROUP, MD_PLURAL, NODE_PLURAL, VERSION, SpecError

from .agents import AgentAuth, AgentPool, Unfenced
from .config import OperatorConfig
from .engine import admit_model_deployment
from .kube import KubeApi
from .metrics import Metrics
from .reconciler import Reconciler

log = logging.getLogger("warmserve.operator")

FINALIZER = "warmserve.io/teardown"


class RetryForever:
    """API retry delays for kopf: 1, 1, 2, 3, 5, 8, 13, 21, then 30 s forever.  Re-iterable
    (kopf iterates it once per request) and unsized (kopf then counts no last attempt)."""

    def __iter__(self) -> Iterator[float]:
        yield from (1, 1, 2, 3, 5, 8, 13, 21)
        while True:
            yield 30


INDEX_SYNC_TIMEOUT_S = 60.0


class NoDiffBase(kopf.DiffBaseStorage):
    """A diff-base that stores nothing.

    kopf stores the last handled state of every object it sees (one PATCH per new object) for
    its create/update/resume handlers; the operator registers none (the loop compares
    ``metadata.generation`` with ``status.observedGeneration`` instead), only indexes and a
    delete handler, which need no diff.  Every event is then a creation without handlers:
    nothing is written, and the essence is not even built (kopf deep-copies the body for it).
    """

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


# The indexes keep each watch event's object as kopf decoded it (a shallow copy of the top
# level): kopf never changes a received object and the loop only reads them; a deep copy per
# event was a tenth of the operator's CPU with 1,000 deployments starting.
@kopf.index(GROUP, VERSION, MD_PLURAL)
def model_deployments(body: kopf.Body, uid: str, **_: Any) -> dict[str, Any]:
    return {uid: dict(body)}


@kopf.index(GROUP, VERSION, NODE_PLURAL)
def gpu_nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, Any]:
    return {name: dict(body)}


class IndexView:
    """The loop's view of kopf's indexes (:class:`.ports.ClusterView`).

    Ready once both indexes hold every object a one-off listing at startup saw (kopf fills its
    indexes from its own listing; acting on a half-filled index would take the deployments not
    yet indexed for deleted ones), or after ``INDEX_SYNC_TIMEOUT_S`` (an object deleted in
    between is never indexed).
    """

    def __init__(self, mds: kopf.Index[str, Any], nodes: kopf.Index[str, Any]) -> None:
        self.mds = mds
        self.nodes = nodes
        self.want_mds: set[str] = set()
        self.want_nodes: set[str] = set()
        self.deadline = time.monotonic() + INDEX_SYNC_TIMEOUT_S
        self._ready = False

    @staticmethod
    def _values(index: kopf.Index[str, Any]) -> list[dict[str, Any]]:
        return [v for key in index for v in index[key]]

    def expect(self, md_uids: Iterable[str], node_names: Iterable[str]) -> None:
        self.want_mds, self.want_nodes = set(md_uids), set(node_names)

    def model_deployments(self) -> list[dict[str, Any]]:
        return self._values(self.mds)

    def gpu_nodes(self) -> list[dict[str, Any]]:
        return self._values(self.nodes)

    def ready(self) -> bool:
        if not self._ready:
            have = self.want_mds <= set(self.mds) and self.want_nodes <= set(self.nodes)
            self._ready = have or time.monotonic() > self.deadline
            if self._ready:
                log.info("event=indexes_ready complete=%s", have)
        return self._ready


def _keys(items: Collection[dict[str, Any]], field: str) -> set[str]:
    return {str((i.get("metadata") or {}).get(field) or "") for i in items} - {""}


# kopf's API requests at once, besides its watch streams.  kopf's own HTTP session has no
# limit: with 1,000 new deployments it opened ~1,000 TLS connections at once to add their
# finalizers, the API server answered hundreds of them 429 (API Priority and Fairness: one flow,
# its queues full) and both sides spent their CPU on TLS handshakes (issue 16, scale).
KOPF_API_CONNECTIONS = 32


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.AiohttpSession | None:
    """kopf's usual credentials (kubeconfig or in-cluster, via the ``kubernetes`` client), in an
    HTTP session with a bounded connection pool (:data:`KOPF_API_CONNECTIONS` plus one per watch
    stream: deployments and GPU nodes per namespace served, peering, namespaces)."""
    import warnings

    import aiohttp

    info = kopf.login_via_client(**kwargs)
    if info is None:
        return None
    watches = 2 * max(len(memo.get("namespaces") or ()), 1) + 4
    with warnings.catch_warnings():  # kopf's own session construction silences the same one
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        auth = info.as_aiohttp_basic_auth()
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=KOPF_API_CONNECTIONS + watches, ssl=info.as_ssl_context()
        ),
        headers=info.as_http_headers(),
        auth=auth,
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
        priority=info.priority,
        aiohttp_session=session,
    )


@kopf.on.startup()
async def startup(
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    model_deployments: kopf.Index[str, Any],
    gpu_nodes: kopf.Index[str, Any],
    **_: Any,
) -> None:
    """The composition root: everything the process runs is built here, once."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.level = logging.WARNING
    settings.peering.lifetime = int(memo.get("peering_lifetime", 20))
    # One leader for the whole cluster, also when serving a few namespaces only: the window
    # loop places every model on the shared GPUs, so the peering object is the cluster one.
    settings.peering.clusterwide = True
    settings.watching.server_timeout = 60
    # Retry API errors forever (capped at 30 s apart): kopf's default gives up after ~1 min of
    # retries per request and the operator then exited with etcd down for long (issue 16).
    settings.networking.error_backoffs = RetryForever()
    config: OperatorConfig = memo["config"]
    view = IndexView(model_deployments, gpu_nodes)
    kube = KubeApi(
        peering=memo.get("peering"),
        identity=memo["identity"],
        priority=int(memo.get("priority", 0)),
        discovery=memo.get("discovery"),
        namespaces=tuple(memo.get("namespaces") or ()),
        history_namespace=memo.get("history_namespace"),
        view=view,
        election=memo.get("election"),
    )
    await kube.ensure_peering()
    view.expect(
        _keys(await kube.list_model_deployments_now(), "uid"),
        _keys(await kube.list_gpu_nodes_now(), "name"),
    )
    metrics = Metrics()
    if memo.get("metrics_port"):
        metrics.serve(int(memo["metrics_port"]), memo.get("metrics_address", "127.0.0.1"))
    auth: AgentAuth = memo.get("agent_auth") or AgentAuth()
    gateways = memo.get("gateways")
    demand = gateways.build() if gateways is not None else None
    # Every agent call carries the Lease term's fencing token (.leader, warmserve_agent.fencing).
    fencing = kube.elector if kube.elector is not None else Unfenced()
    connect = memo.get("connect_agent")  # (node, address, fencing) -> AgentPort; None: gRPC
    pool = AgentPool(
        auth, factory=connect and (lambda node, addr: connect(node, addr, fencing)), fencing=fencing
    )
    reconciler = Reconciler(config, kube, pool, metrics, demand=demand)
    stop = asyncio.Event()
    memo["reconciler"] = reconciler
    memo["stop"] = stop
    memo["loop_task"] = asyncio.get_running_loop().create_task(reconciler.run(stop))
    if kube.elector is not None:  # the Lease on its own schedule, whatever a poll takes
        kube.elector.on_change = reconciler.leadership_changed
        memo["election_task"] = asyncio.get_running_loop().create_task(kube.run_election(stop))
    log.info(
        "event=operator_started window_s=%s poll_s=%s peering=%s priority=%s identity=%s",
        config.window_s,
        config.poll_s,
        memo.get("peering"),
        memo.get("priority"),
        memo["identity"],
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    stop = memo.get("stop")
    task = memo.get("loop_task")
    if stop is not None:
        stop.set()
    if task is not None:
        try:
            await asyncio.wait_for(task, timeout=10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
    election = memo.get("election_task")
    if election is not None:
        try:
            await asyncio.wait_for(election, timeout=5)
        except (TimeoutError, asyncio.CancelledError):
            election.cancel()
    reconciler = memo.get("reconciler")
    if reconciler is not None:
        await reconciler.agents.close()


@kopf.on.delete(GROUP, VERSION, MD_PLURAL)
async def model_deployment_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer: remove everything the deployment owns before the object goes."""
    try:
        md = admit_model_deployment(body)
    except SpecError:
        return  # never accepted, so nothing was started for it
    reconciler: Reconciler = memo["reconciler"]
    left = await reconciler.teardown(md)
    if left:
        raise kopf.TemporaryError(
            f"waiting for {len(left)} instance(s)/slot(s) to go: {'; '.join(left)[:500]}", delay=2
        )
    log.info("event=teardown_done model=%s deployment=%s", md.model, md.key)
