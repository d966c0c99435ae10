"""Where the gateway learns the deployments and their serving instances.

:class:`KubeSource` lists the ModelDeployments and then *watches* them (list + watch from the
list's resourceVersion, re-listed after a ``410 Gone`` or a broken stream), so a new instance,
an instance entering grace or a changed spec reaches the router within the API server's watch
latency — never by polling per request.  Instances and their phases come from the status the
operator writes from the agents' reports.  It uses the official ``kubernetes`` client (its
kubeconfig and in-cluster handling, token refresh included) in a thread per namespace and hands
every event to the event loop.  RBAC: get/list/watch on ``modeldeployments`` (the chart's
gateway ClusterRole, or Roles when ``watchNamespaces`` is set) — nothing else.

:class:`FileSource` reads ModelDeployment objects, statuses included, from a YAML/JSON file
(re-read when it changes): a gateway without Kubernetes, for development and
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

from warmserve_operator.spec import GROUP, MD_PLURAL, VERSION

log = logging.getLogger("warmserve.gateway.discovery")

# (namespace or None for cluster-wide, full list) or (event type, object)
OnList = Callable[[str | None, list[Mapping[str, Any]]], None]
OnEvent = Callable[[str, Mapping[str, Any]], None]


class Source(Protocol):
    """Calls ``on_list(scope, objects)`` once per scope in :attr:`scopes` (a namespace, or None
    for all) and again after every re-list, ``on_event`` for every change in between."""

    scopes: tuple[str | None, ...]

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
        self.scopes: tuple[str | None, ...] = namespaces or (None,)
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent) -> None:
        for ns in self.scopes:
            t = threading.Thread(
                target=self._run, args=(ns, loop, on_list, on_event), daemon=True,
                name=f"md-watch-{ns or 'all'}",
            )  # fmt: skip
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def _list_fn(self, ns: str | None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if ns is None:
            return self._custom.list_cluster_custom_object, (GROUP, VERSION, MD_PLURAL)
        return self._custom.list_namespaced_custom_object, (GROUP, VERSION, ns, MD_PLURAL)

    def _run(
        self, ns: str | None, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent
    ) -> None:
        from kubernetes import watch
        from kubernetes.client import ApiException

        fn, args = self._list_fn(ns)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                res = fn(*args)
                rv = res["metadata"]["resourceVersion"]
                loop.call_soon_threadsafe(on_list, ns, list(res.get("items") or []))
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
                            loop.call_soon_threadsafe(on_event, typ, obj)
                        if self._stop.is_set():
                            w.stop()
                            return
            except ApiException as exc:
                if exc.status != 410 and not self._stop.is_set():
                    log.warning(
                        "event=watch_failed namespace=%s status=%s reason=%r",
                        ns or "*", exc.status, exc.reason,
                    )  # fmt: skip
            except Exception as exc:  # network trouble: re-list after a pause
                if self._stop.is_set():
                    return
                log.warning("event=watch_failed namespace=%s error=%r", ns or "*", str(exc))
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 10.0)


class FileSource:
    """ModelDeployment objects (a YAML list, a ``kind: List`` or JSON) from a file."""

    def __init__(self, path: Path, poll_s: float = 1.0) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self.scopes: tuple[str | None, ...] = (None,)
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

    def start(self, loop: asyncio.AbstractEventLoop, on_list: OnList, on_event: OnEvent) -> None:
        on_list(None, self.read())
        self._task = loop.create_task(self._watch(on_list))

    async def _watch(self, on_list: OnList) -> None:
        stamp = self.path.stat().st_mtime
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                now = self.path.stat().st_mtime
                if now != stamp:
                    stamp = now
                    on_list(None, self.read())
            except (OSError, ValueError) as exc:
                log.warning("event=static_models_unreadable error=%r", str(exc))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
