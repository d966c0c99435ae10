"""The operator's Kubernetes I/O outside kopf's handlers, behind a small port.

kopf owns the watch streams and the per-object handlers; the cluster-level window loop needs a
few direct calls (list the deployments and GPU nodes, patch their status, read/write the load
history ConfigMaps, post Events, read the peering object).  They go through
:class:`.ports.KubePort` so the reconciler is unit-tested with an in-memory fake;
:class:`KubeApi` implements it with the official ``kubernetes`` client (synchronous, so every
call runs in a worker thread).

Leadership: kopf's peering pauses a replica's handlers while a live peer with a higher priority
exists (and pauses all replicas with equal priorities).  The window loop is not a kopf handler,
so it holds its own ``coordination.k8s.io`` Lease (:mod:`.leader`), never reading kopf's
internal peering status.  The Lease is renewed by its own task (:meth:`KubeApi.run_election`);
every leader-only write here checks the fence first (:meth:`KubeApi.leading`) and raises
:class:`.leader.NotLeader` once this replica may no longer act.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from warmserve.api.crd import API_VERSION, GROUP, MD_PLURAL, NODE_KIND, NODE_PLURAL, VERSION

from .leader import ElectionTiming, Elector, LeaseTarget, NotLeader
from .ports import AgentDiscovery, ClusterView, ObjRef

log = logging.getLogger("warmserve.operator.kube")

PEERING_GROUP = "kopf.dev"
PEERING_PLURAL = "clusterkopfpeerings"
COMPONENT = "warmserve-operator"
REQUEST_TIMEOUT_S = 15.0
API_THREADS = 16


def own_namespace() -> str:
    """The operator's namespace: $POD_NAMESPACE (the chart sets it), the in-cluster service
    account's namespace, the kubeconfig context's namespace, else ``default``."""
    ns = os.environ.get("POD_NAMESPACE")
    if ns:
        return ns
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        pass
    try:
        from kubernetes import config

        _, active = config.list_kube_config_contexts(
            config_file=os.environ.get("KUBECONFIG") or None
        )
        return str((active or {}).get("context", {}).get("namespace") or "default")
    except Exception:  # no kubeconfig: the caller fails on its own, clearly
        return "default"


class KubeApi:
    """:class:`KubePort` over the ``kubernetes`` client (kubeconfig or in-cluster config)."""

    def __init__(
        self,
        *,
        peering: str | None,
        identity: str,
        priority: int,
        event_namespace: str = "default",
        discovery: AgentDiscovery | None = None,
        namespaces: tuple[str, ...] = (),
        history_namespace: str | None = None,
        view: ClusterView | None = None,
        election: ElectionTiming | None = None,
    ) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        conf = client.Configuration.get_default_copy()
        conf.connection_pool_maxsize = API_THREADS  # one connection per API thread
        self._api = client.ApiClient(conf)
        self._custom = client.CustomObjectsApi(self._api)
        self._core = client.CoreV1Api(self._api)
        self._coord = client.CoordinationV1Api(self._api)
        self._exc = client.ApiException
        # The client is synchronous: its calls run on threads; enough for a poll's status writes
        # and Events to go out together (the default executor has cores + 4 threads).
        self._pool = ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="kube")
        self.view = view
        self.peering = peering
        self.identity = identity
        self.priority = priority
        self.event_namespace = event_namespace
        self.discovery = discovery
        self.namespaces = namespaces  # empty: every namespace
        # Load histories live in the operator's own namespace (see .history).
        self.history_namespace = history_namespace or own_namespace()
        self.timing = election or ElectionTiming()
        # --standalone (no peering): no election, always leading.
        self.elector = (
            Elector(self._lease_round, self.timing, release_=self._lease_release)
            if peering
            else None
        )

    async def _t(self, fn: Any, *args: Any, **kw: Any) -> Any:
        # Bounded: with etcd unavailable a call fails after this, and the next poll retries.
        kw.setdefault("_request_timeout", REQUEST_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    def _fence(self) -> None:
        if not self.leading():
            raise NotLeader("this replica no longer holds the loop's Lease")

    async def _write(self, fn: Any, *args: Any, **kw: Any) -> None:
        """A leader-only write whose answer the operator does not read: the response body (the
        whole object) is neither decoded nor turned into client models; errors still raise."""
        self._fence()

        def call() -> None:
            resp = fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kw)
            resp.read()
            resp.release_conn()

        await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def list_model_deployments(self) -> list[dict[str, Any]]:
        if self.view is None:
            raise RuntimeError("no kopf index view: the loop runs inside `warmserve operator`")
        return self.view.model_deployments()

    async def list_gpu_nodes(self) -> list[dict[str, Any]]:
        if self.view is None:
            raise RuntimeError("no kopf index view: the loop runs inside `warmserve operator`")
        return self.view.gpu_nodes()

    async def ready(self) -> bool:
        return self.view is not None and self.view.ready()

    async def list_gpu_nodes_now(self) -> list[dict[str, Any]]:
        """One listing from the API (startup only: what the indexes must catch up with)."""
        res = await self._t(self._custom.list_cluster_custom_object, GROUP, VERSION, NODE_PLURAL)
        return list(res.get("items", []))

    async def list_model_deployments_now(self) -> list[dict[str, Any]]:
        if not self.namespaces:
            res = await self._t(self._custom.list_cluster_custom_object, GROUP, VERSION, MD_PLURAL)
            return list(res.get("items", []))
        items: list[dict[str, Any]] = []
        for ns in self.namespaces:
            res = await self._t(
                self._custom.list_namespaced_custom_object, GROUP, VERSION, ns, MD_PLURAL
            )
            items += res.get("items", [])
        return items

    async def patch_md_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            await self._write(
                self._custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                namespace,
                MD_PLURAL,
                name,
                {"status": status},
            )
        except self._exc as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to report on
                raise

    async def patch_node_status(self, name: str, status: dict[str, Any]) -> None:
        try:
            await self._write(
                self._custom.patch_cluster_custom_object_status,
                GROUP,
                VERSION,
                NODE_PLURAL,
                name,
                {"status": status},
            )
        except self._exc as exc:
            if exc.status != 404:
                raise

    async def read_histories(self, uids: list[str]) -> dict[str, dict[str, str]]:
        """The stored histories of ``uids`` (missing ones left out), in one LIST of the
        operator's namespace: a restart with 1,000 deployments makes one call, not 1,000."""
        from warmserve.api.history import OWNER_LABEL

        want = set(uids)
        res = await self._t(
            self._core.list_namespaced_config_map,
            self.history_namespace,
            label_selector=f"app.kubernetes.io/managed-by={COMPONENT},{OWNER_LABEL}",
        )
        return {
            cm.metadata.labels[OWNER_LABEL]: dict(cm.data or {})
            for cm in res.items
            if cm.metadata.labels.get(OWNER_LABEL) in want
        }

    async def write_history(self, uid: str, data: dict[str, str], owner_key: str) -> None:
        from warmserve.api.history import OWNER_LABEL, configmap_name

        name, ns = configmap_name(uid), self.history_namespace
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": COMPONENT, OWNER_LABEL: uid[:63]},
                "annotations": {"warmserve.io/model-deployment": owner_key},
            },
            "data": data,
        }
        try:
            await self._write(self._core.replace_namespaced_config_map, name, ns, body)
        except self._exc as exc:
            if exc.status != 404:
                raise
            await self._write(self._core.create_namespaced_config_map, ns, body)

    async def delete_history(self, uid: str) -> None:
        from warmserve.api.history import configmap_name

        self._fence()
        try:
            await self._t(
                self._core.delete_namespaced_config_map,
                configmap_name(uid),
                self.history_namespace,
            )
        except self._exc as exc:
            if exc.status != 404:
                raise

    async def list_history_uids(self) -> list[str]:
        from warmserve.api.history import OWNER_LABEL

        res = await self._t(
            self._core.list_namespaced_config_map,
            self.history_namespace,
            label_selector=f"app.kubernetes.io/managed-by={COMPONENT},{OWNER_LABEL}",
        )
        return [cm.metadata.labels[OWNER_LABEL] for cm in res.items]

    async def emit_event(self, ref: ObjRef, type_: str, reason: str, message: str) -> None:
        from kubernetes import client

        if not self.leading():  # best effort, like a failed post
            log.debug("event=event_fenced reason=%s", reason)
            return
        now = dt.datetime.now(dt.UTC)
        ns = ref.namespace or self.event_namespace
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{ref.name[:200]}."),
            involved_object=client.V1ObjectReference(
                api_version=ref.api_version,
                kind=ref.kind,
                name=ref.name,
                namespace=ref.namespace or None,
                uid=ref.uid or None,
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT,
            reporting_instance=self.identity[:128],
            action=reason,
        )
        try:
            await self._t(self._core.create_namespaced_event, ns, body)
        except self._exc as exc:  # an Event is best effort; never fail a decision on it
            log.warning("event=post_event_failed reason=%s status=%s", reason, exc.status)

    async def is_leader(self) -> bool:
        """Whether this replica leads now (no API call: :meth:`run_election` holds the Lease)."""
        return self.leading()

    def leading(self) -> bool:
        """The fence (:func:`.leader.leading`); ``--standalone``: always."""
        return self.elector is None or self.elector.leading()

    async def run_election(self, stop: asyncio.Event) -> None:
        """Hold the loop's Lease until ``stop`` (:class:`.leader.Elector`)."""
        if self.elector is not None:
            await self.elector.run(stop)

    def _lease(self) -> LeaseTarget:
        return LeaseTarget(
            self._coord,
            self._exc,
            self._t,
            self.history_namespace,
            f"{self.peering}-loop",
            COMPONENT,
        )

    async def _lease_round(self) -> tuple[bool | None, int]:
        from .leader import hold_lease

        release = self.elector.release if self.elector is not None else lambda: None
        return await hold_lease(
            self._lease(), self.identity[:128], self.priority, self.timing.lease_s, release
        )

    async def _lease_release(self) -> bool:
        from .leader import release_lease

        return await release_lease(self._lease(), self.identity[:128], self.timing.lease_s)

    async def sync_agent_nodes(self) -> None:
        """Create/update a GPUNode for every running agent pod (see :class:`AgentDiscovery`)."""
        d = self.discovery
        if d is None:
            return
        self._fence()
        pods = await self._t(self._core.list_namespaced_pod, d.namespace, label_selector=d.selector)
        for pod in pods.items:
            node, ip = pod.spec.node_name, pod.status.pod_ip
            if not node or not ip or pod.status.phase != "Running":
                continue
            address = f"[{ip}]:{d.port}" if ":" in ip else f"{ip}:{d.port}"
            body = {
                "apiVersion": API_VERSION,
                "kind": NODE_KIND,
                "metadata": {"name": node, "labels": {"warmserve.io/discovered": "true"}},
                "spec": {"agentAddress": address, "nodeName": node},
            }
            try:
                cur = await self._t(
                    self._custom.get_cluster_custom_object, GROUP, VERSION, NODE_PLURAL, node
                )
            except self._exc as exc:
                if exc.status != 404:
                    raise
                await self._t(
                    self._custom.create_cluster_custom_object, GROUP, VERSION, NODE_PLURAL, body
                )
                continue
            if (cur.get("spec") or {}).get("agentAddress") != address:
                await self._t(
                    self._custom.patch_cluster_custom_object,
                    GROUP,
                    VERSION,
                    NODE_PLURAL,
                    node,
                    {"spec": {"agentAddress": address}},
                )

    async def ensure_peering(self) -> None:
        """Create the ClusterKopfPeering object kopf's --peering expects, if missing."""
        if not self.peering:
            return
        body = {
            "apiVersion": f"{PEERING_GROUP}/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": self.peering},
        }
        try:
            await self._t(
                self._custom.create_cluster_custom_object, PEERING_GROUP, "v1", PEERING_PLURAL, body
            )
        except self._exc as exc:
            if exc.status != 409:
                raise
