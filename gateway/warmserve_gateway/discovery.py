"""Where the gateway learns the deployments and their serving instances.

:class:`KubeSource` lists the ModelDeployments and then *watches* them (list + watch from the
list's resourceVersion, re-listed after a ``410 Gone`` or a broken stream), so a new instance,
an instance entering grace or a changed spec reaches the router within the API server's watch
latency — never by polling per request.  Instances and their phases come from the status the
operator writes from the agents' reports.  It also watches the cluster-scoped ``GPUNode``
objects: their status is the operator's mirror of each agent's report, the record an instance
endpoint must match before the gateway contacts it (:mod:`.records`).  It uses the official
``kubernetes`` client (its kubeconfig and in-cluster handling, token refresh included) in a
thread per scope (a namespace's ModelDeployments, or the GPUNodes) and hands every event to the
event loop.  RBAC: get/list/watch on ``modeldeployments`` (the chart's gateway ClusterRole, or
Roles when ``watchNamespaces`` is set) and on ``gpunodes`` (a ClusterRole) — nothing else.

:class:`FileSource` reads ModelDeployment and GPUNode objects, statuses included, from a
YAML/JSON file (re-read when it changes): a gateway without Kubernetes, for development and
``bench/gateway_bench.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from warmserve.api.crd import GROUP, MD_PLURAL, NODE_KIND, NODE_PLURAL, VERSION

log = logging.getLogger("warmserve.gateway.discovery")

# What one list+watch covers: (resource plural, namespace or None for cluster-wide)
Scope = tuple[str, str | None]
NODES: Scope = (NODE_PLURAL, None)
# (scope, full list) or (scope, event type, object)
OnList = Callable[[Scope, list[Mapping[str, Any]]], None]
OnEvent = Callable[[Scope, str, Mapping[str, Any]], None]


def md_scope(namespace: str | None) -> Scope:
    return (MD_PLURAL, namespace)


class Source(Protocol):
    """Calls ``on_list(scope, objects)`` once per scope in :attr:`scopes` (ModelDeployments of a
    namespace or of all, and the GPUNodes) and again after every re-list, ``on_event`` for every
    change in between."""

    scopes: tuple[Scope, ...]

    def start(
        self, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent
    ) -> None: ...

    def stop(self) -> None: ...


class KubeSource:
    """List + watch ModelDeployments in every namespace, or in each of ``namespaces``."""

    def __init__(self, namespaces: tuple[str, ...] = (), watch_timeout_s: int = 55) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        self._custom = client.CustomObjectsApi(client.ApiClient())
        self.namespaces = namespaces
        self.scopes: tuple[Scope, ...] = (
            *(md_scope(ns) for ns in (namespaces or (None,))),
            NODES,
        )
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent) -> None:
        for scope in self.scopes:
            t = threading.Thread(
                target=self._run, args=(scope, loop, on_list, on_event), daemon=True,
                name=f"watch-{scope[0]}-{scope[1] or 'all'}",
            )  # fmt: skip
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def _list_fn(self, scope: Scope) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        plural, ns = scope
        if ns is None:
            return self._custom.list_cluster_custom_object, (GROUP, VERSION, plural)
        return self._custom.list_namespaced_custom_object, (GROUP, VERSION, ns, plural)

    def _run(
        self, scope: Scope, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent
    ) -> None:
        from kubernetes import watch
        from kubernetes.client import ApiException

        ns = scope[1]
        fn, args = self._list_fn(scope)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                res = fn(*args)
                rv = res["metadata"]["resourceVersion"]
                loop.call_soon_threadsafe(on_list, scope, list(res.get("items") or []))
                backoff = 0.5
                while not self._stop.is_set():
                    w = watch.Watch()
                    for ev in w.stream(
                        fn,
                        *args,
                        resource_version=rv,
                        timeout_seconds=self.watch_timeout_s,
                        allow_watch_bookmarks=True,
                        _request_timeout=self.watch_timeout_s + 10,
                    ):
                        typ, obj = ev["type"], ev["object"]
                        if typ == "ERROR":
                            raise ApiException(
                                status=obj.get("code", 500), reason=obj.get("message")
                            )
                        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                        if typ != "BOOKMARK":
                            loop.call_soon_threadsafe(on_event, scope, typ, obj)
                        if self._stop.is_set():
                            w.stop()
                            return
            except ApiException as exc:
                if exc.status != 410 and not self._stop.is_set():
                    log.warning(
                        "event=watch_failed resource=%s namespace=%s status=%s reason=%r",
                        scope[0], ns or "*", exc.status, exc.reason,
                    )  # fmt: skip
            except Exception as exc:  # network trouble: re-list after a pause
                if self._stop.is_set():
                    return
                log.warning(
                    "event=watch_failed resource=%s namespace=%s error=%r",
                    scope[0], ns or "*", str(exc),
                )  # fmt: skip
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 10.0)


class FileSource:
    """ModelDeployment and GPUNode objects (a YAML list, a ``kind: List`` or JSON) from a file;
    objects of kind ``GPUNode`` are the agents' records, every other one a ModelDeployment."""

    def __init__(self, path: Path, poll_s: float = 1.0) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self.scopes: tuple[Scope, ...] = (md_scope(None), NODES)
        self._task: asyncio.Task[None] | None = None
        self.read()  # fail fast on a bad file

    def read(self) -> list[Mapping[str, Any]]:
        import yaml

        text = self.path.read_text()
        doc = json.loads(text) if self.path.suffix == ".json" else yaml.safe_load(text)
        if isinstance(doc, Mapping) and isinstance(doc.get("items"), list):
            doc = doc["items"]
        if not isinstance(doc, list) or not all(isinstance(d, Mapping) for d in doc):
            raise ValueError(f"{self.path}: expected a list of ModelDeployment objects")
        return list(doc)

    def _hand(self, on_list: OnList) -> None:
        objs = self.read()
        on_list(md_scope(None), [o for o in objs if o.get("kind") != NODE_KIND])
        on_list(NODES, [o for o in objs if o.get("kind") == NODE_KIND])

    def start(self, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent) -> None:
        self._hand(on_list)
        self._task = loop.create_task(self._watch(on_list))

    async def _watch(self, on_list: OnList) -> None:
        stamp = self.path.stat().st_mtime
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                now = self.path.stat().st_mtime
                if now != stamp:
                    stamp = now
                    self._hand(on_list)
            except (OSError, ValueError) as exc:
                log.warning("event=static_models_unreadable error=%r", str(exc))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
