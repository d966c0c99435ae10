"""Simulated GPU memory: one sparse shared-memory file per GPU, page tables in Python.

Why a file and not ``multiprocessing.shared_memory`` of the GPU's size: an 80 GiB GPU must not
cost 80 GiB of RAM.  A file truncated to the GPU size in ``/dev/shm`` (tmpfs) or a temp dir is
sparse: pages cost nothing until written.  The agent and every worker process ``mmap`` the same
file, so weights the agent loads are the bytes the engine in a worker reads (by physical page).

Physical page ``p`` of GPU ``g`` is bytes ``[p*P, (p+1)*P)`` of ``<dir>/gpu<g>.mem``.  Virtual
addresses are plain integers handed out per GPU; :meth:`SimulatedBackend.translation` exposes the
emulated MMU (virtual page -> physical page) so tests can compare it with the page tables.

The MMU is also **shared**: each reservation (a slot's range on one GPU) has a page-table file
``<dir>/gpu<g>-<va hex>.pt`` (one uint32 per virtual page: 0 unmapped, else physical page + 1),
written on every map and unmap.  An engine in any process reads it (:class:`PageTableView`) to
find the physical pages of KV pages mapped after it started, and to check that every KV page it
touches is mapped right now, to the page it thinks: the simulated counterpart of a GPU's
page-fault on an unmapped address.

Weights are loaded with :meth:`SimulatedBackend.load_ranges`: the same staging ring as the
``cuda`` backend (:mod:`~warmserve_agent.backends.staging`) reads the safetensors file ranges
into host buffers and copies them in (synchronously here), so CI runs the GPU data path.

The optional timing model (``map_s_per_page``, ``copy_bytes_per_s``) sleeps to mimic driver and
PCIe costs in benchmarks; it is off by default so tests are fast.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from warmserve.policy.cluster import PAGE_BYTES
from warmserve_agent.backends.staging import (
    FileRange,
    StagingRing,
    SyncCopyTarget,
)

_VA_START = 0x7F00_0000_0000
_VA_ALIGN = 1 << 30


def page_table_file(directory: str | Path, gpu: int, va: int) -> Path:
    """The shared page-table file of the reservation at ``va`` on ``gpu`` (module docstring)."""
    return Path(directory) / f"gpu{gpu}-{va:x}.pt"


class _Reservation:
    """One reserved virtual range and its shared page-table file."""

    def __init__(self, path: Path, va: int, npages: int) -> None:
        self.path, self.va, self.npages = path, va, npages
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, max(1, npages) * 4)
            self._mm = mmap.mmap(fd, max(1, npages) * 4)
        finally:
            os.close(fd)
        self.table = memoryview(self._mm).cast("I")

    def set(self, vpage: int, ppage: int | None) -> None:
        self.table[vpage] = 0 if ppage is None else ppage + 1

    def close(self) -> None:
        self.table.release()
        self._mm.close()
        self.path.unlink(missing_ok=True)


class SimulatedBackend:
    """:class:`~warmserve_agent.memory.MemoryBackend` over sparse shared files."""

    name = "simulated"

    def __init__(
        self,
        directory: str | Path,
        *,
        page_bytes: int = PAGE_BYTES,
        keep_files: bool = False,
        map_s_per_page: float = 0.0,
        copy_bytes_per_s: float | None = None,
        # A smaller ring than the cuda backend's: the copies here are memcpys into a shared
        # file, and a node may simulate many GPUs in little RAM.
        staging_chunk_bytes: int = 4 * 1024**2,
        staging_depth: int = 4,
        staging_readers: int = 2,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_bytes = page_bytes
        self.keep_files = keep_files
        self.map_s_per_page = map_s_per_page
        self.copy_bytes_per_s = copy_bytes_per_s
        self._mm: dict[int, mmap.mmap] = {}
        self._files: dict[int, Path] = {}
        self._mmu: dict[int, dict[int, int]] = {}  # gpu -> {virtual page number: ppage}
        self._used: dict[int, set[int]] = {}  # gpu -> physical pages mapped somewhere
        self._next_va: dict[int, int] = {}
        self._res: dict[int, dict[int, _Reservation]] = {}  # gpu -> {va: reservation}
        self._lock = threading.Lock()
        self._staging = (staging_chunk_bytes, staging_depth, staging_readers)
        self._rings: dict[int, StagingRing] = {}

    def path(self, gpu: int) -> Path:
        return self.dir / f"gpu{gpu}.mem"

    def open_gpu(self, gpu: int, memory_bytes: int) -> int:
        n = memory_bytes // self.page_bytes
        if n < 1:
            raise ValueError(f"gpu {gpu}: {memory_bytes} bytes is less than one page")
        size = n * self.page_bytes
        path = self.path(gpu)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # sparse: no RAM until written
            self._mm[gpu] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._files[gpu] = path
        self._mmu[gpu] = {}
        self._used[gpu] = set()
        self._res[gpu] = {}
        self._next_va[gpu] = _VA_START
        return n

    def reserve(self, gpu: int, size: int) -> int:
        with self._lock:
            va = self._next_va[gpu]
            self._next_va[gpu] = va + -(-size // _VA_ALIGN) * _VA_ALIGN + _VA_ALIGN
            path = page_table_file(self.dir, gpu, va)
            self._res[gpu][va] = _Reservation(path, va, size // self.page_bytes)
            return va

    def page_table_path(self, gpu: int, va: int) -> Path:
        return page_table_file(self.dir, gpu, va)

    def free_reservation(self, gpu: int, va: int, size: int) -> None:
        first, n = va // self.page_bytes, size // self.page_bytes
        with self._lock:
            mmu = self._mmu[gpu]
            still = [v for v in mmu if first <= v < first + n]
            if still:
                raise RuntimeError(f"gpu {gpu}: freeing a reservation with {len(still)} mapped")
            res = self._res[gpu].pop(va, None)
            if res is not None:
                res.close()

    def _note(self, gpu: int, vfirst: int, ppages: Sequence[int | None]) -> None:
        """Mirror MMU changes into the shared page-table file (caller holds the lock)."""
        va = vfirst * self.page_bytes
        for res in self._res[gpu].values():
            if res.va <= va < res.va + res.npages * self.page_bytes:
                first = (va - res.va) // self.page_bytes
                for i, p in enumerate(ppages):
                    res.set(first + i, p)
                return

    def map(self, gpu: int, va: int, ppages: Sequence[int]) -> None:
        vfirst = va // self.page_bytes
        with self._lock:
            mmu, used = self._mmu[gpu], self._used[gpu]
            for i, p in enumerate(ppages):
                if vfirst + i in mmu:
                    raise RuntimeError(f"gpu {gpu}: virtual page {vfirst + i} already mapped")
                if p in used:
                    raise RuntimeError(f"gpu {gpu}: physical page {p} already mapped")
            if len(set(ppages)) != len(ppages):
                raise RuntimeError(f"gpu {gpu}: a physical page mapped twice in one call")
            for i, p in enumerate(ppages):
                mmu[vfirst + i] = p
            used.update(ppages)
            self._note(gpu, vfirst, ppages)
        if self.map_s_per_page:
            time.sleep(self.map_s_per_page * len(ppages))

    def unmap(self, gpu: int, va: int, npages: int) -> None:
        vfirst = va // self.page_bytes
        with self._lock:
            mmu = self._mmu[gpu]
            for v in range(vfirst, vfirst + npages):
                if v not in mmu:
                    raise RuntimeError(f"gpu {gpu}: virtual page {v} is not mapped")
            used = self._used[gpu]
            for v in range(vfirst, vfirst + npages):
                used.discard(mmu.pop(v))
            self._note(gpu, vfirst, [None] * npages)
        if self.map_s_per_page:  # the driver's cost per page, as for map
            time.sleep(self.map_s_per_page * npages)

    def _spans(self, gpu: int, va: int, nbytes: int) -> list[tuple[int, int, int]]:
        """(file offset, buffer offset, length) pieces of a virtual byte range."""
        out = []
        mmu = self._mmu[gpu]
        pos = 0
        while pos < nbytes:
            v, off = divmod(va + pos, self.page_bytes)
            n = min(self.page_bytes - off, nbytes - pos)
            try:
                p = mmu[v]
            except KeyError:
                raise RuntimeError(f"gpu {gpu}: access to unmapped virtual page {v}") from None
            out.append((p * self.page_bytes + off, pos, n))
            pos += n
        return out

    def write(self, gpu: int, va: int, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        with self._lock:
            spans = self._spans(gpu, va, len(mv))
        mm = self._mm[gpu]
        for foff, boff, n in spans:
            mm[foff : foff + n] = mv[boff : boff + n]
        if self.copy_bytes_per_s:
            time.sleep(len(mv) / self.copy_bytes_per_s)

    def load_ranges(self, gpu: int, ranges: Sequence[tuple[int, str, int, int]]) -> int:
        """Copy file ranges ``(va, path, offset, nbytes)`` in through the staging ring (the
        cuda backend's code path, with synchronous copies); returns a ticket."""
        with self._lock:
            ring = self._rings.get(gpu)
            if ring is None:
                chunk, depth, readers = self._staging
                ring = StagingRing(
                    SyncCopyTarget(lambda va, view: self.write(gpu, va, view)),
                    chunk_bytes=chunk,
                    depth=depth,
                    readers=readers,
                )
                self._rings[gpu] = ring
        ring.load([FileRange(*r) for r in ranges])
        return 0

    def wait_loaded(self, gpu: int, ticket: int) -> None:
        """Copies are synchronous here: everything is already in place."""

    def staging_bytes(self, gpu: int) -> int:
        ring = self._rings.get(gpu)
        return 0 if ring is None else ring.host_bytes

    def read(self, gpu: int, va: int, nbytes: int) -> bytes:
        with self._lock:
            spans = self._spans(gpu, va, nbytes)
        mm = self._mm[gpu]
        return b"".join(mm[foff : foff + n] for foff, _, n in spans)

    def translation(self, gpu: int) -> dict[int, int]:
        with self._lock:
            return dict(self._mmu[gpu])

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
        for reservations in self._res.values():
            for res in reservations.values():
                res.close()
        self._res.clear()
        for mm in self._mm.values():
            mm.close()
        self._mm.clear()
        if not self.keep_files:
            for path in self._files.values():
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.dir.rmdir()  # only if empty (another backend may share the dir)


class PhysicalReader:
    """Read-only view of a simulated GPU for a worker process: bytes by physical page list."""

    def __init__(self, path: str | Path, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, ppages: Sequence[int], offset: int, nbytes: int) -> bytes:
        """Bytes [offset, offset+nbytes) of the virtual range whose pages are ``ppages``."""
        out = bytearray()
        pos = offset
        end = offset + nbytes
        while pos < end:
            v, off = divmod(pos, self.page_bytes)
            n = min(self.page_bytes - off, end - pos)
            base = ppages[v] * self.page_bytes + off
            out += self._mm[base : base + n]
            pos += n
        return bytes(out)

    def close(self) -> None:
        self._mm.close()


class PageTableView:
    """Read-only view of a reservation's shared page-table file (module docstring), opened by
    an engine in any process: the physical page behind each virtual page of its slot, now."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._table = memoryview(self._mm).cast("I")

    def __len__(self) -> int:
        return len(self._table)

    def ppage(self, vpage: int) -> int | None:
        """The physical page mapped at virtual page ``vpage`` of the range, or None."""
        if not 0 <= vpage < len(self._table):
            return None
        e = self._table[vpage]
        return e - 1 if e else None

    def close(self) -> None:
        self._table.release()
        self._mm.close()
