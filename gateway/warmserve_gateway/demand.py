"""What this gateway replica reports to the operator: requests held per model (``/demand``).

The wire format is an API type, :mod:`warmserve.api.demand`; the operator polls and sums the
replicas' reports (docs/gateway.md, "Demand", has the whole design).  This replica

* answers ``GET /demand`` with a :class:`~warmserve.api.demand.DemandReport` of its
  own counts (held per model; forwarded and unfinished ones as ``inflight``);
* streams reports on ``GET /demand?watch=1`` (newline-delimited JSON): the current report at
  once, then one whenever a model's held count rises from 0 or reaches twice the level last
  streamed (1, 2, 4, 8, ...: a burst costs a handful of wake-ups, not one per request), and an
  empty line every :data:`HEARTBEAT_S` seconds.

Each model's entry names its deployment's namespace, so the operator can cap a namespace's
held demand.  ``/demand`` answers only the operator: a bearer token from
``--demand-token-file`` (the chart's ``<release>-demand-token`` Secret, mounted into the operator
and the gateways; re-read when it changes), compared in constant time; without one the gateway
refuses every ``/demand`` unless ``--insecure-demand`` says otherwise.  At most
``--max-demand-streams`` watch streams are open at once (one per operator replica is needed);
more get 429.

The gateway does not decide anything here: the operator's autoscaler turns demand into
instances.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web

from warmserve.api.demand import HEARTBEAT_S, DemandReport, ModelDemand

from .errors import openai_error

log = logging.getLogger("warmserve.gateway.demand")


class DemandTracker:
    """Edge detection on held counts and the subscribers of the watch stream."""

    def __init__(self, replica: str, counts: Callable[[], Mapping[str, ModelDemand]]) -> None:
        self.replica = replica
        self.started = time.time()
        self._counts = counts
        self._level: dict[str, int] = {}  # held level last streamed, per model (0: none held)
        self.seq = 0
        self._subscribers: set[asyncio.Event] = set()

    def held_changed(self, model: str, held: int) -> None:
        """Called by the dispatcher on every change of a model's held count."""
        level = self._level.get(model, 0)
        if held <= 0:
            if level:
                self._level[model] = 0
            return
        if held >= 2 * level or level == 0:
            self._level[model] = held
            self.seq += 1
            for ev in self._subscribers:
                ev.set()

    def report(self) -> DemandReport:
        return DemandReport(self.replica, self.started, self.seq, dict(self._counts()))

    def line(self) -> bytes:
        return json.dumps(self.report().to_json(), separators=(",", ":")).encode() + b"\n"

    async def stream(
        self, write: Callable[[bytes], Awaitable[object]], stop: asyncio.Event
    ) -> None:
        """Write reports and heartbeats with ``write`` (an async callable) until ``stop``."""
        ev = asyncio.Event()
        self._subscribers.add(ev)
        try:
            await write(self.line())
            while not stop.is_set():
                try:
                    await asyncio.wait_for(ev.wait(), HEARTBEAT_S)
                except TimeoutError:
                    await write(b"\n")
                    continue
                ev.clear()
                await write(self.line())
        finally:
            self._subscribers.discard(ev)


class DemandAccess:
    """Whether a ``/demand`` request carries the operator's token (module docstring)."""

    def __init__(self, token_file: Path | None, insecure: bool = False) -> None:
        self.token_file = Path(token_file) if token_file else None
        self.insecure = insecure
        self._stamp: float | None = None
        self._digest: bytes | None = None
        if self.token_file is not None:
            self._load()  # fail at start on an unreadable or empty file

    def _load(self) -> None:
        assert self.token_file is not None
        stamp = self.token_file.stat().st_mtime
        if stamp == self._stamp:
            return
        token = self.token_file.read_text().strip()
        if not token:
            raise ValueError(f"--demand-token-file {self.token_file} is empty")
        self._digest, self._stamp = hashlib.sha256(token.encode()).digest(), stamp

    def allowed(self, authorization: str | None) -> bool:
        if self.token_file is None:
            return self.insecure
        try:
            self._load()
        except (OSError, ValueError) as exc:  # keep the token read last
            log.warning("event=demand_token_unreadable error=%r", str(exc))
        scheme, _, token = (authorization or "").partition(" ")
        presented = hashlib.sha256(token.strip().encode()).digest()
        ok = hmac.compare_digest(presented, self._digest or b"")
        return ok and scheme.lower() == "bearer" and bool(token.strip())


class DemandEndpoint:
    """The ``/demand`` handler: the operator's token, a cap on concurrent watch streams."""

    def __init__(
        self, tracker: DemandTracker, access: DemandAccess, max_streams: int, stop: asyncio.Event
    ) -> None:
        self.tracker = tracker
        self.access = access
        self.max_streams = max_streams
        self.streams = 0
        self.stop = stop

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not self.access.allowed(request.headers.get("Authorization")):
            log.info("event=demand_refused peer=%s", request.remote)
            return openai_error(
                401,
                "/demand is for the warmserve operator: send its token "
                "('Authorization: Bearer <token>' of the gateway's --demand-token-file)",
                code="invalid_token",
                headers={"WWW-Authenticate": 'Bearer realm="warmserve-demand"'},
            )
        if request.query.get("watch") not in ("1", "true"):
            return web.json_response(self.tracker.report().to_json())
        if self.streams >= self.max_streams:
            return openai_error(
                429,
                f"{self.streams} demand streams are open, the limit (--max-demand-streams)",
                kind="rate_limit_error",
                code="too_many_streams",
                retry_after=5,
            )
        self.streams += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            await self.tracker.stream(resp.write, self.stop)
            return resp
        finally:
            self.streams -= 1
