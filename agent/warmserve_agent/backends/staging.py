"""Pipelined weight copies: file ranges -> a ring of host staging buffers -> GPU (WarmServe §4.2).

The process that owns a GPU's memory (the GPU's worker, or the agent when it owns the memory)
loads a slot by reading the model's safetensors **file ranges itself** into a small ring of host
buffers it owns and copying each buffer to the slot while the next ones are being read.  Nothing
but ``(virtual address, file, offset, length)`` descriptors crosses a process boundary, so weights
are never pickled through the worker's pipe.

How one :meth:`StagingRing.load` flows, for a ring of ``depth`` buffers of ``chunk_bytes``::

    ranges ─split/pack─▶ chunks ─read (reader threads, os.preadv)─▶ buffer k%depth
                                   └─ up to depth-1 reads in flight while buffer k-depth+1 copies
    buffer ─copy_async (one call per contiguous run)─▶ device, event recorded per buffer
    a buffer is refilled only after its event completed (the copy read it)

With the ``cuda`` backend the buffers are pinned (``cuMemHostAlloc``) and copies are
``cuMemcpyHtoDAsync`` on the GPU's non-blocking stream, so reads, copies and the next layer's
``cuMemMap`` overlap.  The ``simulated`` backend runs the **same ring** with ordinary memory and
synchronous copies into its shared file, so CI exercises this code path.

The ring is created lazily by its owner on first use (with the GPU's context current) and closed
before the owner releases its context: :meth:`StagingRing.close` waits for every copy that may
still read a buffer and then frees the buffers.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_CHUNK_BYTES = 16 * 1024**2
DEFAULT_DEPTH = 8
DEFAULT_READERS = 4


class LoadError(RuntimeError):
    """A weight file could not be read as described (missing, truncated, unreadable)."""


@dataclass(frozen=True)
class FileRange:
    """Copy bytes ``[offset, offset + nbytes)`` of ``path`` to device address ``va``."""

    va: int
    path: str
    offset: int
    nbytes: int


@dataclass
class HostBuffer:
    """One staging buffer: a writable view and the address the copy engine reads."""

    view: memoryview
    ptr: int
    event: Any = None  # completes when the last copy reading this buffer is done


class CopyTarget(Protocol):
    """What a memory backend provides for one GPU so a ring can feed it."""

    def alloc_buffers(self, count: int, nbytes: int) -> list[HostBuffer]: ...
    def free_buffers(self, buffers: list[HostBuffer]) -> None: ...
    def copy_async(self, va: int, buf: HostBuffer, offset: int, nbytes: int) -> None: ...
    def record(self, reuse: Any = None) -> Any:
        """An event that completes when every copy issued so far is done (``reuse``: an event
        of this target to re-record instead of creating one); None if copies are synchronous."""

    def wait(self, event: Any) -> None: ...
    def destroy(self, event: Any) -> None: ...


@dataclass(frozen=True)
class _Piece:
    buf_off: int
    va: int
    path: str
    file_off: int
    nbytes: int


def plan_chunks(ranges: Sequence[FileRange], chunk_bytes: int) -> list[list[_Piece]]:
    """Split ranges larger than a chunk and pack small ones together, in order."""
    chunks: list[list[_Piece]] = []
    cur: list[_Piece] = []
    used = 0
    for r in ranges:
        if r.nbytes < 0 or r.offset < 0:
            raise LoadError(f"bad range {r}")
        done = 0
        while done < r.nbytes:
            if used == chunk_bytes:
                chunks.append(cur)
                cur, used = [], 0
            n = min(r.nbytes - done, chunk_bytes - used)
            cur.append(_Piece(used, r.va + done, r.path, r.offset + done, n))
            used += n
            done += n
    if cur:
        chunks.append(cur)
    return chunks


def copy_runs(pieces: Sequence[_Piece]) -> list[tuple[int, int, int]]:
    """``(va, buffer offset, nbytes)`` copies, merging pieces contiguous on both sides."""
    runs: list[list[int]] = []
    for p in pieces:
        if runs and runs[-1][0] + runs[-1][2] == p.va and runs[-1][1] + runs[-1][2] == p.buf_off:
            runs[-1][2] += p.nbytes
        else:
            runs.append([p.va, p.buf_off, p.nbytes])
    return [(a, b, c) for a, b, c in runs]


def _read_into(fds: dict[str, int], buf: HostBuffer, pieces: Sequence[_Piece]) -> None:
    for p in pieces:
        view = buf.view[p.buf_off : p.buf_off + p.nbytes]
        got = 0
        while got < p.nbytes:
            n = os.preadv(fds[p.path], [view[got:]], p.file_off + got)
            if n <= 0:
                raise LoadError(
                    f"{p.path}: file ends at byte {p.file_off + got}, expected "
                    f"{p.nbytes - got} more (truncated or changed while loading)"
                )
            got += n


class StagingRing:
    """A ring of host buffers feeding one GPU (see the module docstring)."""

    def __init__(
        self,
        target: CopyTarget,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        depth: int = DEFAULT_DEPTH,
        readers: int = DEFAULT_READERS,
    ) -> None:
        if chunk_bytes < 4096 or depth < 2 or readers < 1:
            raise ValueError("staging ring needs chunk_bytes >= 4096, depth >= 2, readers >= 1")
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.readers = readers
        self._bufs: list[HostBuffer] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.bytes_loaded = 0

    @property
    def host_bytes(self) -> int:
        """Host memory the ring holds (0 until first used)."""
        return 0 if self._bufs is None else self.depth * self.chunk_bytes

    def _ensure(self) -> list[HostBuffer]:
        if self._bufs is None:
            self._bufs = self.target.alloc_buffers(self.depth, self.chunk_bytes)
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="staging-read")
        return self._bufs

    def load(self, ranges: Sequence[FileRange]) -> Any:
        """Issue every copy of ``ranges``; returns an event (see CopyTarget.record) that
        completes when all of them landed.  Copies may still be in flight on return."""
        with self._lock:
            bufs = self._ensure()
            assert self._pool is not None
            chunks = plan_chunks(ranges, self.chunk_bytes)
            fds: dict[str, int] = {}
            inflight: deque[tuple[list[_Piece], HostBuffer, Future[None]]] = deque()
            try:
                for path in {r.path for r in ranges}:
                    try:
                        fds[path] = os.open(path, os.O_RDONLY)
                    except OSError as exc:
                        raise LoadError(f"cannot read weights: {exc}") from None
                inline = len(chunks) == 1  # nothing to overlap with: skip the thread hand-off
                for k, pieces in enumerate(chunks):
                    buf = bufs[k % self.depth]
                    if buf.event is not None:  # the copy of chunk k-depth still reads it
                        self.target.wait(buf.event)
                    if inline:
                        fut: Future[None] = Future()
                        _read_into(fds, buf, pieces)
                        fut.set_result(None)
                    else:
                        fut = self._pool.submit(_read_into, fds, buf, pieces)
                    inflight.append((pieces, buf, fut))
                    if len(inflight) >= self.depth - 1:
                        self._issue(*inflight.popleft())
                while inflight:
                    self._issue(*inflight.popleft())
                return self.target.record()
            finally:
                for _, _, fut in inflight:  # an error part-way: no reader may still write
                    fut.exception()
                for fd in fds.values():
                    os.close(fd)

    def _issue(self, pieces: list[_Piece], buf: HostBuffer, fut: Future[None]) -> None:
        fut.result()  # raises the reader's error
        for va, off, n in copy_runs(pieces):
            self.target.copy_async(va, buf, off, n)
            self.bytes_loaded += n
        buf.event = self.target.record(buf.event)

    def close(self) -> None:
        """Wait for copies still reading the buffers, then free them (idempotent)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._bufs is None:
                return
            for b in self._bufs:
                if b.event is not None:
                    self.target.wait(b.event)
                    self.target.destroy(b.event)
                    b.event = None
            self.target.free_buffers(self._bufs)
            self._bufs = None


class SyncCopyTarget:
    """CopyTarget over a synchronous ``write(va, view)`` and ordinary host memory (the
    simulated backend)."""

    def __init__(self, write: Callable[[int, memoryview], None]) -> None:
        self._write = write

    def alloc_buffers(self, count: int, nbytes: int) -> list[HostBuffer]:
        return [HostBuffer(memoryview(bytearray(nbytes)), 0) for _ in range(count)]

    def free_buffers(self, buffers: list[HostBuffer]) -> None:
        for b in buffers:
            b.view.release()

    def copy_async(self, va: int, buf: HostBuffer, offset: int, nbytes: int) -> None:
        self._write(va, buf.view[offset : offset + nbytes])

    def record(self, reuse: Any = None) -> Any:
        return None

    def wait(self, event: Any) -> None:
        return None

    def destroy(self, event: Any) -> None:
        return None
