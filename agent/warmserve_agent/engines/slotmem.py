"""The slot's memory as the engine's process sees it: bytes to verify, tensors to serve from.

An engine gets a :class:`~warmserve_agent.engines.spec.SlotRegion` per rank.  This module turns
it into

* ``read(offset, nbytes)`` — bytes (the simulated engine hashes them against the store), and
* ``tensor()`` — a ``torch.uint8`` tensor **over the slot's own memory** (no copy), from which a
  model loader cuts parameter views.  Its ``data_ptr()`` range is the slot, so "parameter storage
  lies inside the slot" is checkable (``contains``).

How, per memory backend (the seam with ``warmserve_agent.backends``):

* **simulated** (``region.host_file``/``ppages``, or the worker's own ``SimulatedBackend``): the
  slot's physical pages are pages of a shared file.  We reserve one contiguous range of this
  process's address space and ``mmap(MAP_FIXED | MAP_SHARED)`` each run of consecutive physical
  pages of the file into it, in virtual-page order — a host MMU doing what ``cuMemMap`` does on a
  GPU.  Weights are mapped read-only (an engine that wrote into them would fault, not corrupt the
  prewarmed bytes); KV pages read-write.  Pages the agent later unmaps (grace lending) can be
  made inaccessible with :meth:`HostSlotMapping.revoke`.
* **cuda** (the worker owns a ``CudaBackend``): the slot's virtual address *is* device memory
  mapped by the backend (``cuMemMap``).  ``torch.as_tensor`` over ``__cuda_array_interface__``
  wraps it without a copy (vllm-integration note §7.3).  A backend may provide
  ``torch_view(gpu, va, nbytes)`` itself; it is preferred when present.

Linux only (``mmap`` with ``MAP_FIXED`` through libc).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from warmserve_agent.engines.spec import SlotRegion

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, mmap.PROT_READ, mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_ANON = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10  # <sys/mman.h>, Linux (all architectures Python supports here)
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


class SlotMemoryError(RuntimeError):
    pass


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


UNMAPPED = -1  # a virtual page with no physical page (yet): inaccessible in the host mapping


def _runs(ppages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first virtual page, first physical page, count) runs of consecutive physical pages;
    :data:`UNMAPPED` pages belong to no run."""
    out: list[tuple[int, int, int]] = []
    for v, p in enumerate(ppages):
        if p == UNMAPPED:
            continue
        if out and out[-1][1] + out[-1][2] == p and out[-1][0] + out[-1][2] == v:
            v0, p0, n = out[-1]
            out[-1] = (v0, p0, n + 1)
        else:
            out.append((v, p, 1))
    return out


class HostSlotMapping:
    """A contiguous host mapping of a slot whose pages live in a shared file (see module doc)."""

    def __init__(
        self,
        path: str,
        ppages: Sequence[int],
        page_bytes: int,
        weight_bytes: int,
        npages: int | None = None,
    ) -> None:
        self.page_bytes = page_bytes
        self.npages = len(ppages) if npages is None else npages
        self.size = self.npages * page_bytes
        if self.npages == 0:
            raise SlotMemoryError("slot region has no mapped pages")
        self._libc = _libc()
        self._fd = os.open(path, os.O_RDWR)
        try:
            base = self._libc.mmap(
                None, self.size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0
            )
            if base in (None, _MAP_FAILED):
                raise SlotMemoryError(
                    f"reserving {self.size} bytes: {os.strerror(ctypes.get_errno())}"
                )
            self.base = int(base)
            self._wpages = -(-weight_bytes // page_bytes)
            self._phys = [UNMAPPED] * self.npages
            self.update(ppages)
        except BaseException:
            self.close()
            raise

    def update(self, ppages: Sequence[int]) -> None:
        """Make the mapping follow ``ppages`` (one entry per virtual page of the reservation,
        :data:`UNMAPPED` for none): pages whose physical page changed are mapped in place
        (weights read-only, KV read-write) or made inaccessible; addresses never move, so
        tensors over the mapping stay valid.  A prepared engine's slot is mapped this way as
        the agent maps its pages."""
        if len(ppages) > self.npages:
            raise SlotMemoryError(
                f"{len(ppages)} pages do not fit the {self.npages}-page reservation"
            )
        new = list(ppages) + [UNMAPPED] * (self.npages - len(ppages))
        changed = [v for v in range(self.npages) if new[v] != self._phys[v]]
        i = 0
        while i < len(changed):  # runs of consecutive changed virtual pages
            j = i
            while j + 1 < len(changed) and changed[j + 1] == changed[j] + 1:
                j += 1
            lo, hi = changed[i], changed[j] + 1
            for start, end, prot in (
                (lo, min(hi, self._wpages), _PROT_READ),
                (max(lo, self._wpages), hi, _PROT_READ | _PROT_WRITE),
            ):
                if start >= end:
                    continue
                gone = [v for v in range(start, end) if new[v] == UNMAPPED]
                for v in gone:
                    self.revoke(v, 1)
                self._map(new, start, end, prot)
            i = j + 1
        self._phys = new

    @property
    def mapped_pages(self) -> int:
        return sum(1 for p in self._phys if p != UNMAPPED)

    def _map(self, ppages: Sequence[int], start: int, end: int, prot: int) -> None:
        P = self.page_bytes
        for v, p, n in _runs(ppages[start:end]):
            addr = self.base + (start + v) * P
            got = self._libc.mmap(addr, n * P, prot, _MAP_SHARED | _MAP_FIXED, self._fd, p * P)
            if got != addr:
                raise SlotMemoryError(
                    f"mapping {n} pages at +{(start + v) * P}: {os.strerror(ctypes.get_errno())}"
                )

    def revoke(self, first_page: int, npages: int) -> None:
        """Make virtual pages [first, first+n) inaccessible (lent to another slot)."""
        P = self.page_bytes
        addr = self.base + first_page * P
        got = self._libc.mmap(
            addr,
            npages * P,
            _PROT_NONE,
            _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED | _MAP_NORESERVE,
            -1,
            0,
        )
        if got != addr:
            raise SlotMemoryError(f"revoking pages: {os.strerror(ctypes.get_errno())}")
        if hasattr(self, "_phys"):
            self._phys[first_page : first_page + npages] = [UNMAPPED] * npages

    def remap(self, first_page: int, ppages: Sequence[int]) -> None:
        """Map physical pages at virtual pages [first, first+len) read-write (taken back)."""
        full = [UNMAPPED] * first_page + list(ppages)
        self._map(full, first_page, first_page + len(ppages), _PROT_READ | _PROT_WRITE)
        self._phys[first_page : first_page + len(ppages)] = list(ppages)

    def close(self) -> None:
        if getattr(self, "base", 0):
            self._libc.munmap(self.base, self.size)
            self.base = 0
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1


class SlotMemoryKind(StrEnum):
    """How this process reaches a slot region's bytes."""

    HOST_FILE = "host-file"  # the simulated backend's shared file, by physical page
    HOST_BACKEND = "host-backend"  # this worker's own simulated backend (memory in workers)
    DEVICE = "device"  # this worker's GPU memory (CUDA VMM)


class SlotMemory:
    """One rank's slot region, opened in the engine's process.

    ``read`` and ``close`` may run on different threads (the agent's loader thread verifies new
    layers while node shutdown stops the engine): a lock makes ``close`` wait for a read in
    progress, and a read after ``close`` raises instead of touching unmapped memory (which
    crashed the process with SIGSEGV).  A ``tensor()`` view is not guarded: its engine must be
    done with it before it closes the slot.

    ``partial``: the region may have pages not mapped yet (an engine prepared at prewarm time:
    its KV pages, and weights still loading); they stay inaccessible until :meth:`update` maps
    them.  Without it every page must be mapped."""

    def __init__(self, region: SlotRegion, backend: Any = None, *, partial: bool = False) -> None:
        self.region = region
        self.backend = backend
        self.partial = partial
        self.size = region.mapped_bytes  # the reservation: tensors over it never move
        self._host: HostSlotMapping | None = None
        self._tensor: Any = None
        self._lock = threading.Lock()
        self._closed = False
        if region.host_file:
            self.kind = SlotMemoryKind.HOST_FILE
        elif backend is not None and region.local and backend.name == "simulated":
            self.kind = SlotMemoryKind.HOST_BACKEND
        elif backend is not None and region.local:
            self.kind = SlotMemoryKind.DEVICE
        else:
            raise SlotMemoryError(
                f"GPU {region.gpu}: this process can read neither the slot's shared file nor "
                "its virtual address (its memory belongs to another worker)"
            )

    def _ppages(self, upto: int | None = None) -> tuple[str, list[int]]:
        """(file, physical page of each of the slot's first ``upto`` virtual pages)."""
        r = self.region
        n = -(-r.mapped_bytes // r.page_bytes) if upto is None else upto
        if self.kind == SlotMemoryKind.HOST_FILE:
            return r.host_file, list(r.ppages[:n])
        tr = self.backend.translation(r.gpu)
        first = r.va // r.page_bytes
        if self.partial:
            return str(self.backend.path(r.gpu)), [tr.get(first + i, UNMAPPED) for i in range(n)]
        try:
            return str(self.backend.path(r.gpu)), [tr[first + i] for i in range(n)]
        except KeyError as exc:
            raise SlotMemoryError(f"slot page {exc} is not mapped") from None

    def update(self, region: SlotRegion) -> None:
        """The agent mapped (or unmapped) pages of this slot: follow ``region`` in place.

        Used when a prepared engine's slot is activated (the rest of the weights and the KV
        pages are mapped by then).  A region larger than the reservation, or another slot, is
        an error; CUDA needs nothing (the worker's own VMM mappings are the memory)."""
        old = self.region
        if (region.gpu, region.va, region.page_bytes, region.weight_bytes) != (
            old.gpu,
            old.va,
            old.page_bytes,
            old.weight_bytes,
        ) or region.mapped_bytes > self.size:
            raise SlotMemoryError(
                f"GPU {region.gpu}: the activated region ({region.mapped_bytes} bytes at "
                f"{region.va:#x}) is not the prepared one ({self.size} bytes at {old.va:#x})"
            )
        with self._lock:
            self.region = region
            if self.kind == SlotMemoryKind.DEVICE or self._host is None:
                return
            _, ppages = self._ppages()
            if not self.partial and UNMAPPED in ppages:
                raise SlotMemoryError(f"slot page {ppages.index(UNMAPPED)} is not mapped")
            self._host.update(ppages)

    def host_mapping(self) -> HostSlotMapping:
        if self.kind == SlotMemoryKind.DEVICE:
            raise SlotMemoryError("device memory has no host mapping")
        if self._closed:
            raise SlotMemoryError("the slot memory is closed (its engine stopped)")
        if self._host is None:
            npages = -(-self.size // self.region.page_bytes)
            path, ppages = self._ppages(npages)
            self._host = HostSlotMapping(
                path, ppages, self.region.page_bytes, self.region.weight_bytes, npages
            )
        return self._host

    def read(self, offset: int, nbytes: int) -> bytes:
        r = self.region
        if self.kind == SlotMemoryKind.DEVICE:
            return bytes(self.backend.read(r.gpu, r.va + offset, nbytes))
        with self._lock:
            m = self.host_mapping()
            if offset < 0 or offset + nbytes > m.size:
                raise SlotMemoryError(f"read [{offset}, {offset + nbytes}) outside the slot")
            return ctypes.string_at(m.base + offset, nbytes)

    def tensor(self) -> Any:
        """``torch.uint8`` tensor over the whole mapped region (weights + KV), no copy."""
        if self._tensor is not None:
            return self._tensor
        import torch

        r = self.region
        n = self.size
        view = getattr(self.backend, "torch_view", None)
        if self.kind == SlotMemoryKind.DEVICE and view is not None:
            t = view(r.gpu, r.va, n)
        elif self.kind == SlotMemoryKind.DEVICE:
            t = torch.as_tensor(_CudaArray(r.va, n), device=f"cuda:{r.gpu}")
        else:
            m = self.host_mapping()
            buf = (ctypes.c_uint8 * n).from_address(m.base)
            t = torch.frombuffer(buf, dtype=torch.uint8, count=n)
        self._tensor = t
        return t

    @property
    def base(self) -> int:
        return int(self.tensor().data_ptr())

    def contains(self, ptr: int, nbytes: int = 1) -> bool:
        b = self.base
        return b <= ptr and ptr + nbytes <= b + self.region.mapped_bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._tensor = None
            if self._host is not None:
                self._host.close()
                self._host = None


class _CudaArray:
    """``__cuda_array_interface__`` of a raw device range (wrapped by ``torch.as_tensor``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }
