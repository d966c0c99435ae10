"""The engine-event socket: well-formed hints reach the node core coalesced, anything else is
dropped and counted, a sender never blocks or fails its engine, and the socket is private."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from pathlib import Path

from warmserve_agent.engine_events import (
    MAX_DATAGRAM,
    EngineEvent,
    EngineEventKind,
    EventListener,
    EventSender,
)

IID = "inst-0123456789ab"


def _listener() -> tuple[EventListener, list[dict[str, set[EngineEventKind]]], threading.Event]:
    got: list[dict[str, set[EngineEventKind]]] = []
    seen = threading.Event()

    def handler(batch: dict[str, set[EngineEventKind]]) -> None:
        got.append(batch)
        seen.set()

    return EventListener(handler), got, seen


def test_events_arrive_and_malformed_datagrams_are_dropped() -> None:
    lst, got, seen = _listener()
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for bad in (
            b"finished",  # no instance
            b"finished inst-0123",  # not an instance id
            b"exploded " + IID.encode(),  # unknown kind
            b"finished " + IID.encode() + b" extra",
            "finished inst-0123456789aé".encode(),  # not ASCII
            b"x" * (MAX_DATAGRAM + 10),
        ):
            raw.sendto(bad, lst.address)
        sender = EventSender(lst.address, IID)
        sender.send(EngineEventKind.FINISHED)
        assert seen.wait(5)
        deadline = time.monotonic() + 5
        while lst.dropped < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lst.dropped == 6 and lst.received == 1
        assert got == [{IID: {EngineEventKind.FINISHED}}]
        raw.close()
        sender.close()
    finally:
        lst.close()


def test_a_burst_is_coalesced_and_a_full_queue_loses_nothing_that_matters() -> None:
    """While the node is busy, a burst fills the socket's queue (Linux keeps ~10 datagrams) and
    further sends are dropped, never blocking the engine.  That loses no information: the
    queued events are read after the dropped ones were sent, and the node re-reads the engine's
    stats, so its refresh sees the state after the last completion."""
    calls: list[tuple[float, dict[str, set[EngineEventKind]]]] = []
    gate = threading.Event()

    def slow(batch: dict[str, set[EngineEventKind]]) -> None:
        calls.append((time.monotonic(), batch))
        gate.wait(5)  # the node's lock is busy: events queue up meanwhile

    lst = EventListener(slow)
    try:
        s = EventSender(lst.address, IID)
        s.send(EngineEventKind.FINISHED)
        time.sleep(0.2)
        for _ in range(50):
            s.send(EngineEventKind.FINISHED)
        last_send = time.monotonic()
        assert s.sent + s.lost == 51 and s.lost > 0  # the queue filled: dropped, not blocked
        gate.set()
        deadline = time.monotonic() + 5
        while lst.received < s.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert lst.received == s.sent
        assert len(calls) == 2, "everything queued became one call"
        assert calls[-1][0] > last_send and calls[-1][1] == {IID: {EngineEventKind.FINISHED}}
    finally:
        lst.close()


def test_the_socket_is_private_and_senders_never_fail() -> None:
    lst, _, _ = _listener()
    path = Path(lst.address)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lst.close()
    assert not path.parent.exists()
    gone = EventSender(str(path), IID)
    gone.send(EngineEventKind.FINISHED)  # the agent is gone: counted, never raised
    assert gone.lost == 1 and gone.sent == 0
    EventSender("", IID).send(EngineEventKind.FINISHED)  # no socket: a no-op
    assert EngineEvent.decode(EngineEvent(EngineEventKind.KV_WANTED, IID).encode()) == EngineEvent(
        EngineEventKind.KV_WANTED, IID
    )


def test_close_returns_when_the_queue_filled_while_the_handler_was_busy() -> None:
    """The agent closes its listener while the handler is inside a call (it waits for the node's
    lock that the closing thread holds) and engines have filled the socket's queue meanwhile
    (aborts report a completion each; Linux queues 10 datagrams by default).  close() must not
    wait for room in that queue: the listener leaves without reading once it sees it is closed."""
    inside, release = threading.Event(), threading.Event()

    def handler(batch: dict) -> None:
        inside.set()
        release.wait(30)

    lis = EventListener(handler)
    tx = EventSender(lis.address, IID)
    tx.send(EngineEventKind.FINISHED)
    assert inside.wait(10)
    for _ in range(50):  # more than the queue holds: the rest are dropped by the sender
        tx.send(EngineEventKind.KV_WANTED)
    assert tx.lost > 0, "the queue never filled: the test shows nothing"
    done = threading.Event()
    closer = threading.Thread(target=lambda: (lis.close(), done.set()), daemon=True)
    closer.start()
    time.sleep(0.3)
    release.set()
    assert done.wait(10), "close() waited for room in a full queue"
    tx.close()
