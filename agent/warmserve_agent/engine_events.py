"""Engine → agent events: a request finished, or waits for KV blocks (WarmServe §4.1).

"Upon the completion of each request for a grace-period instance, WarmServe verifies whether the
size of the current reserved KV cache exceeds the reservation target" (Eq. 1).  The engine runs
in a GPU worker process whose pipe only answers the agent's calls, so events travel on their own
channel: a Unix datagram socket the agent binds in a private directory (mode 0700) and names in
every :class:`~warmserve_agent.engines.spec.EngineSpec` (``events_addr``).

* :class:`EventSender` (engine side) sends one datagram per event, never blocks and never fails
  the engine: an event is a hint, and the agent's slow grace timer is the safety net if one is
  lost.
* :class:`EventListener` (agent side) receives them on one thread, drops anything malformed,
  coalesces a burst into one call per instance and hands it to the node core, which reads the
  engine's own stats before deciding anything (an event's sender is trusted with nothing).

Wire format: ``b"<kind> <instance id>"``, ASCII, at most :data:`MAX_DATAGRAM` bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

log = logging.getLogger("warmserve.agent.events")

MAX_DATAGRAM = 256
# the instance ids the agent hands out (node_records.INSTANCE_ID_RE; engines do not import the
# node's records)
INSTANCE_ID_RE = re.compile(r"^inst-[0-9a-f]{12}$")


class EngineEventKind(StrEnum):
    FINISHED = "finished"  # a request completed or was aborted: its KV blocks are free
    KV_WANTED = "kv_wanted"  # a request waits for KV blocks the engine's capacity lacks


@dataclass(frozen=True)
class EngineEvent:
    kind: EngineEventKind
    instance_id: str

    def encode(self) -> bytes:
        return f"{self.kind.value} {self.instance_id}".encode("ascii")

    @staticmethod
    def decode(data: bytes) -> EngineEvent | None:
        """The event in ``data``, or None if it is not one (never raises)."""
        if len(data) > MAX_DATAGRAM:
            return None
        try:
            kind, iid = data.decode("ascii").split(" ")
            ev = EngineEvent(EngineEventKind(kind), iid)
        except (UnicodeDecodeError, ValueError):
            return None
        return ev if INSTANCE_ID_RE.match(iid) else None


class EventSender:
    """The engine's end: fire-and-forget datagrams to the agent (no-op without an address)."""

    def __init__(self, addr: str, instance_id: str) -> None:
        self.addr = addr
        self.instance_id = instance_id
        self.sent = 0
        self.lost = 0
        self._sock: socket.socket | None = None
        if addr:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def send(self, kind: EngineEventKind) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(EngineEvent(kind, self.instance_id).encode(), self.addr)
            self.sent += 1
        except OSError:  # the agent is gone or its queue is full: the timer catches up
            self.lost += 1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class EventListener:
    """The agent's end (see module docstring); ``handler`` gets ``{instance id: kinds}``."""

    def __init__(self, handler: Callable[[dict[str, set[EngineEventKind]]], None]) -> None:
        self._handler = handler
        self._dir = Path(tempfile.mkdtemp(prefix="warmserve-events-"))  # mode 0700
        self.address = str(self._dir / "engine-events.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        os.chmod(self.address, 0o600)
        self.received = 0
        self.dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(MAX_DATAGRAM + 1)
            except OSError:
                return
            batch: dict[str, set[EngineEventKind]] = {}
            while data is not None:  # coalesce what already arrived
                ev = EngineEvent.decode(data)
                if ev is None:
                    self.dropped += 1
                else:
                    self.received += 1
                    batch.setdefault(ev.instance_id, set()).add(ev.kind)
                try:
                    data = self._sock.recv(MAX_DATAGRAM + 1, socket.MSG_DONTWAIT)
                except (BlockingIOError, OSError):
                    data = None
            if batch and not self._closed:
                try:
                    self._handler(batch)
                except Exception:  # a handler must never stop the listener
                    log.exception("event=engine_event_handler_failed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with (  # wake the blocked recv with an empty datagram, then stop
            contextlib.suppress(OSError),
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s,
        ):
            # never blocking: a full queue (10 datagrams by default) means the listener has
            # something to read and will see _closed anyway, while a blocking send would wait
            # forever once the listener, inside its handler when we closed, returns unread
            s.setblocking(False)
            s.sendto(b"", self.address)
        self._thread.join(5)
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
