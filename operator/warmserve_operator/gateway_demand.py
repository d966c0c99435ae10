"""Demand held at the gateways: the operator's reader of the ``/demand`` reports.

The operator's load signal per model is *demand* = requests in flight at its instances (the
agents report running + waiting) **plus** requests held in the gateways' queues (a model at zero
instances has no instance to report anything, so without the second term it could never scale
from zero).  Held requests live in the memory of each gateway replica; this module is how the
operator reads and sums them (the wire format is an API type: :mod:`warmserve.api.demand`).
Design (docs/gateway.md, "Demand"):

* **Every replica answers for itself.** Each gateway replica serves ``GET /demand`` on its admin
  port: a :class:`DemandReport` with its own per-model held counts.  Nothing is shared or
  stored between replicas, so two replicas never count one request twice, and a replica that
  dies takes its counts with it.
* **The operator finds the replicas through the EndpointSlices of the gateway's headless
  Service** (``--gateway-service NAMESPACE/NAME``; the chart's ``<release>-gateway-demand``
  Service publishes not-ready addresses too, so a replica that is starting or terminating but
  still holds clients is counted), or from a static list of URLs (``--gateway-url``, for a
  gateway run outside the cluster).  Every poll lists the slices and asks every replica
  concurrently (timeout ``timeout_s``); the sum over the replicas that answered is the held
  demand of that poll.  A killed replica stops answering (and leaves the slice), so the demand
  recovers at the next poll; a restarted replica starts from zero, which is right: its clients
  lost their connections.
* **Wake-ups**: the poll is the source of truth, but a held request at a model with no instance
  must start one within a second, not at the next 5 s poll.  So the operator also keeps one
  ``GET /demand?watch=1`` stream per replica (newline-delimited reports); a replica sends a
  report when a model's held count rises from 0 or doubles (1, 2, 4, 8, ...), and every report
  received wakes the operator's loop at once (the loop itself limits that to one extra poll per
  0.25 s).  A heartbeat (an empty line) every few seconds lets a dead stream be noticed.

Only ``held`` enters the demand; a model's ``traces`` (tracing on) link the operator's start
span to the held requests that woke it, and never add to the demand.

**Tenancy.**  A namespace's held requests count as its demand only up to
``held_per_namespace`` in all (summed over replicas, spread over its models in proportion:
:func:`warmserve.policy.fairness.cap_per_group`), so flooding a gateway cannot buy GPUs beyond
that; the fair share then divides scarce GPUs between namespaces first.  ``/demand`` needs the
bearer token of ``--demand-token-file`` (the operator's ``--gateway-token-file``; the chart's
``<release>-demand-token`` Secret), compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from warmserve.api.demand import DEMAND_PATH, HEARTBEAT_S, MAX_TRACES, DemandError, DemandReport
from warmserve.policy.fairness import cap_per_group

log = logging.getLogger("warmserve.operator.gateway_demand")


def sum_held(
    reports: Sequence[DemandReport], held_per_namespace: int | None = None
) -> dict[str, int]:
    """Held requests per model, summed over gateway replicas (models with none left out), each
    namespace's total cut to ``held_per_namespace`` (module docstring; ``None``: no cap)."""
    total: dict[str, int] = {}
    namespace: dict[str, str] = {}
    for r in reports:
        for model, d in r.models.items():
            if d.held:
                total[model] = total.get(model, 0) + d.held
                if d.namespace:
                    namespace.setdefault(model, d.namespace)
    return cap_per_group(total, namespace, held_per_namespace)


def held_traces(reports: Sequence[DemandReport]) -> dict[str, tuple[str, ...]]:
    """Per model, the held requests' traceparents over the replicas (at most MAX_TRACES)."""
    out: dict[str, list[str]] = {}
    for r in reports:
        for model, d in r.models.items():
            if d.traces:
                got = out.setdefault(model, [])
                got.extend(d.traces[: MAX_TRACES - len(got)])
    return {m: tuple(t) for m, t in out.items()}


# ----------------------------------------------------------------------------------- discovery


@dataclass(frozen=True, slots=True)
class GatewayEndpoint:
    """One gateway replica's admin base URL (``http://host:port``) and a name for logs."""

    name: str
    url: str


class EndpointSource(Protocol):
    async def endpoints(self) -> list[GatewayEndpoint]: ...


@dataclass(frozen=True, slots=True)
class StaticEndpoints:
    """Fixed URLs (``--gateway-url``): a gateway run as a local process, tests."""

    urls: tuple[str, ...]

    async def endpoints(self) -> list[GatewayEndpoint]:
        return [GatewayEndpoint(u, u.rstrip("/")) for u in self.urls]


def endpoints_from_slices(
    slices: Sequence[Mapping[str, Any]], port_name: str
) -> list[GatewayEndpoint]:
    """Admin URLs of every endpoint in the Service's EndpointSlices (pure; see the module doc).

    Every listed endpoint counts, ready or not: with ``publishNotReadyAddresses`` a replica that
    is starting or terminating is listed too, and it may hold clients.  Addresses of type FQDN
    are used as host names.  Duplicates (one endpoint in two slices during an update) collapse.
    """
    seen: dict[str, GatewayEndpoint] = {}
    for s in slices:
        port = next(
            (p.get("port") for p in s.get("ports") or [] if p.get("name") == port_name), None
        )
        if not isinstance(port, int):
            continue
        for ep in s.get("endpoints") or []:
            target = (ep.get("targetRef") or {}).get("name") or ""
            for addr in (ep.get("addresses") or [])[:1]:  # all addresses are the same endpoint
                host = f"[{addr}]" if ":" in addr else addr
                url = f"http://{host}:{port}"
                seen.setdefault(url, GatewayEndpoint(target or url, url))
    return sorted(seen.values(), key=lambda e: e.url)


class EndpointSliceEndpoints:
    """The gateway replicas behind a Service, from its EndpointSlices (in-cluster discovery).

    Needs ``list`` on ``endpointslices.discovery.k8s.io`` in the Service's namespace (the chart's
    operator Role grants exactly that).
    """

    def __init__(self, namespace: str, service: str, port_name: str = "admin") -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            import os

            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        self._api = client.DiscoveryV1Api(client.ApiClient())
        self.namespace, self.service, self.port_name = namespace, service, port_name

    async def endpoints(self) -> list[GatewayEndpoint]:
        res = await asyncio.to_thread(
            self._api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=f"kubernetes.io/service-name={self.service}",
            _preload_content=False,
        )
        doc = json.loads(res.data)
        return endpoints_from_slices(doc.get("items") or [], self.port_name)


@dataclass(frozen=True, slots=True)
class GatewaySources:
    """Where the gateways are (``warmserve operator --gateway-*`` flags)."""

    service: tuple[str, str] | None = None  # (namespace, name) of the headless demand Service
    port_name: str = "admin"
    urls: tuple[str, ...] = ()
    timeout_s: float = 1.0
    token_file: str | None = None  # bearer token for /demand (the gateways' --demand-token-file)
    held_per_namespace: int | None = None  # demand cap per namespace (None: none)

    def build(self) -> GatewayDemand | None:
        """The reader, or ``None`` when no gateway is configured."""
        sources: list[EndpointSource] = []
        if self.service is not None:
            sources.append(EndpointSliceEndpoints(*self.service, port_name=self.port_name))
        if self.urls:
            sources.append(StaticEndpoints(self.urls))
        if not sources:
            return None
        return GatewayDemand(
            Combined(tuple(sources)),
            self.timeout_s,
            token_file=self.token_file,
            held_per_namespace=self.held_per_namespace,
        )


@dataclass(frozen=True, slots=True)
class Combined:
    """Several sources; the same URL once."""

    sources: tuple[EndpointSource, ...]

    async def endpoints(self) -> list[GatewayEndpoint]:
        out: dict[str, GatewayEndpoint] = {}
        for src in self.sources:
            for ep in await src.endpoints():
                out.setdefault(ep.url, ep)
        return list(out.values())


# -------------------------------------------------------------------------------------- reader


@dataclass(frozen=True, slots=True)
class GatewayHeld:
    """One poll of every gateway replica."""

    held: Mapping[str, int]  # model -> requests held, summed over the replicas that answered
    replicas: int  # replicas that answered
    failed: tuple[str, ...] = ()  # replicas that did not (name: reason)
    traces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # held_traces()


class GatewayDemand:
    """Reads and sums the gateways' held requests; keeps wake-up streams (see the module doc)."""

    def __init__(
        self,
        source: EndpointSource,
        timeout_s: float = 1.0,
        *,
        token_file: str | Path | None = None,
        held_per_namespace: int | None = None,
    ) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.token_file = Path(token_file) if token_file else None
        self.held_per_namespace = held_per_namespace
        self._session: Any = None
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._wake: Callable[[], None] | None = None

    def _client(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s)
            )
        return self._session

    def _headers(self) -> dict[str, str]:
        """The bearer token, read afresh (a mounted Secret is updated in place on rotation)."""
        if self.token_file is None:
            return {}
        token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _fetch(self, ep: GatewayEndpoint) -> DemandReport:
        import aiohttp

        async with self._client().get(
            ep.url + DEMAND_PATH,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers=self._headers(),
        ) as resp:
            if resp.status != 200:
                raise DemandError(f"HTTP {resp.status}")
            return DemandReport.from_json(await resp.json(content_type=None))

    async def poll(self) -> GatewayHeld:
        """Ask every replica once; replicas that fail are left out of this poll's sum."""
        eps = await self.source.endpoints()
        self._sync_streams(eps)
        results = await asyncio.gather(*(self._fetch(e) for e in eps), return_exceptions=True)
        reports: list[DemandReport] = []
        failed: list[str] = []
        for ep, res in zip(eps, results, strict=True):
            if isinstance(res, DemandReport):
                reports.append(res)
            else:
                failed.append(f"{ep.name}: {res!r}")
                log.debug("event=gateway_demand_failed gateway=%s error=%r", ep.name, str(res))
        return GatewayHeld(
            sum_held(reports, self.held_per_namespace),
            len(reports),
            tuple(failed),
            held_traces(reports),
        )

    # ---- wake-up streams ----------------------------------------------------------------------

    def watch(self, wake: Callable[[], None]) -> None:
        """From now on, every report a replica streams calls ``wake`` (streams start at the
        next :meth:`poll`, which learns the replicas)."""
        self._wake = wake

    def _sync_streams(self, eps: Sequence[GatewayEndpoint]) -> None:
        if self._wake is None:
            return
        want = {e.url for e in eps}
        for url in list(self._streams):
            if url not in want or self._streams[url].done():
                self._streams.pop(url).cancel()
        for url in want - set(self._streams):
            self._streams[url] = asyncio.get_running_loop().create_task(self._stream(url))

    async def _stream(self, url: str) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeout_s, sock_read=HEARTBEAT_S * 3
        )
        while True:
            try:
                async with self._client().get(
                    url + DEMAND_PATH,
                    params={"watch": "1"},
                    timeout=timeout,
                    headers=self._headers(),
                ) as resp:
                    if resp.status != 200:
                        raise DemandError(f"HTTP {resp.status}")
                    async for line in resp.content:
                        if line.strip() and self._wake is not None:
                            self._wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the poll still reads this replica; retry the stream
                log.debug("event=gateway_stream_failed url=%s error=%r", url, str(exc))
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        for task in self._streams.values():
            task.cancel()
        for task in self._streams.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._streams.clear()
        if self._session is not None:
            await self._session.close()
