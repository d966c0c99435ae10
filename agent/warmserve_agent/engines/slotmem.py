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
  prewarmed bytes); KV pages read-write, and **only the KV pages the engine was granted**: the
  agent maps the KV range in the background and raises the engine's capacity as pages land, so
  the engine maps newly granted pages (:meth:`SlotMemory.grant_pages`, their physical pages read
  from the backend's shared page table) and makes withdrawn ones inaccessible
  (:meth:`SlotMemory.revoke_pages`) before the agent unmaps them.  A KV access through
  :meth:`SlotMemory.kv_write`/:meth:`SlotMemory.kv_read` is checked against the backend's page
  table first (:class:`KvAccessError`): the engine never touches a page that is not mapped.
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
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Any

from warmserve_agent.engine import EngineError
from warmserve_agent.engines.spec import SlotRegion

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, mmap.PROT_READ, mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_ANON = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10  # <sys/mman.h>, Linux (all architectures Python supports here)
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


class SlotMemoryError(RuntimeError):
    pass


class SlotGone(SlotMemoryError, EngineError):
    """The slot was evicted (its page table removed) while an engine was built over it: an
    engine prepared for it is cancelled then, so this is no engine failure to report loudly."""


class KvAccessError(SlotMemoryError):
    """An engine touched (or was granted) a KV page the backend does not map to it now."""


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
    :data:`UNMAPPED` pages (any entry < 0) belong to no run."""
    out: list[tuple[int, int, int]] = []
    for v, p in enumerate(ppages):
        if p < 0:
            continue
        if out and out[-1][1] + out[-1][2] == p and out[-1][0] + out[-1][2] == v:
            v0, p0, n = out[-1]
            out[-1] = (v0, p0, n + 1)
        else:
            out.append((v, p, 1))
    return out


def _vruns(vpages: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive pages in sorted ``vpages``."""
    out: list[tuple[int, int]] = []
    for v in vpages:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
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
        *,
        partial: bool = False,
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
            self.wpages = -(-weight_bytes // page_bytes)
            if not partial and any(p < 0 for p in ppages[: self.wpages]):
                raise SlotMemoryError("a weight page of the slot is not mapped")
            # the physical page behind every weight page mapped here (map_weights follows it)
            self._weights = [UNMAPPED] * self.wpages
            self.map_weights(ppages[: self.wpages])
            self._map(ppages, self.wpages, self.npages, _PROT_READ | _PROT_WRITE)
            # the physical page behind every KV page mapped here (access checks compare it)
            self.kv: dict[int, int] = {
                v: p for v, p in enumerate(ppages) if v >= self.wpages and p >= 0
            }
        except BaseException:
            self.close()
            raise

    def map_weights(self, ppages: Sequence[int]) -> None:
        """Make the weight pages follow ``ppages`` (one entry per weight page, :data:`UNMAPPED`
        for none), read-only and in place: addresses never move, so tensors over the mapping
        stay valid.  An engine prepared while its slot still loaded maps the rest of its
        weights this way at activation (KV pages are granted one by one: :meth:`map_kv`)."""
        new = list(ppages[: self.wpages]) + [UNMAPPED] * (self.wpages - len(ppages))
        for v in range(self.wpages):
            if new[v] < 0 <= self._weights[v]:
                self.revoke(v, 1)
                self._weights[v] = UNMAPPED
        changed = [UNMAPPED] * self.wpages
        for v in range(self.wpages):
            if new[v] >= 0 and new[v] != self._weights[v]:
                changed[v] = new[v]
        self._map(changed, 0, self.wpages, _PROT_READ)
        self._weights = new

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
        for v in range(first_page, first_page + npages):
            self.kv.pop(v, None)

    def map_kv(self, pages: dict[int, int]) -> None:
        """Map KV virtual pages onto their physical pages read-write (``{vpage: ppage}``)."""
        if not pages:
            return
        top = max(pages) + 1
        full = [-1] * top
        for v, p in pages.items():
            if v < self.wpages or v >= self.npages:
                raise SlotMemoryError(f"page {v} is not a KV page of this slot")
            full[v] = p
        self._map(full, 0, top, _PROT_READ | _PROT_WRITE)
        self.kv.update(pages)

    def remap(self, first_page: int, ppages: Sequence[int]) -> None:
        """Map physical pages at virtual pages [first, first+len) read-write (taken back)."""
        self.map_kv({first_page + i: p for i, p in enumerate(ppages)})

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

    ``partial``: weight pages may not be mapped yet (an engine prepared at prewarm time while
    its slot still loads); they stay inaccessible until :meth:`update` maps them.  Without it
    every weight page must be mapped.  KV pages are mapped only when granted, either way."""

    def __init__(self, region: SlotRegion, backend: Any = None, *, partial: bool = False) -> None:
        self.region = region
        self.backend = backend
        self.partial = partial
        self.size = region.mapped_bytes  # the reservation: tensors over it never move
        self._host: HostSlotMapping | None = None
        self._tensor: Any = None
        self._lock = threading.RLock()
        self._closed = False
        self._pt: Any = None  # the backend's shared page table (simulated), opened lazily
        self.violations = 0  # KV accesses refused by check_pages
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

    def _ppages(self) -> tuple[str, list[int]]:
        """(file, physical page of each of the slot's virtual pages: the weights', and -1 for
        every KV page — KV pages are mapped here only when granted, :meth:`grant_pages`)."""
        r = self.region
        n = -(-self.size // r.page_bytes)
        w = -(-r.weight_bytes // r.page_bytes)
        found = self._lookup(range(w))
        if not self.partial and any(p is None for p in found.values()):
            raise SlotMemoryError("a weight page of the slot is not mapped")
        path = r.host_file or str(self.backend.path(r.gpu))
        return path, [
            UNMAPPED if v >= w or found[v] is None else found[v]  # type: ignore[misc]
            for v in range(n)
        ]

    def _lookup(self, vpages: Iterable[int]) -> dict[int, int | None]:
        """The physical page the backend maps at each of the slot's ``vpages`` now (None: not
        mapped).  Read from the shared page table when there is one."""
        r = self.region
        vs = list(vpages)
        if r.page_table:
            if self._pt is None:
                from warmserve_agent.backends.simulated import PageTableView

                try:
                    self._pt = PageTableView(r.page_table)
                except FileNotFoundError:
                    raise SlotGone(
                        f"GPU {r.gpu}: the slot's page table is gone (the slot was evicted)"
                    ) from None
            return {v: self._pt.ppage(v) for v in vs}
        if self.kind == SlotMemoryKind.HOST_BACKEND:
            tr = self.backend.translation(r.gpu)
            first = r.va // r.page_bytes
            return {v: tr.get(first + v) for v in vs}
        return {v: (r.ppages[v] if v < len(r.ppages) and r.ppages[v] >= 0 else None) for v in vs}

    # ---- KV pages: granted, withdrawn, checked -------------------------------------------------
    def grant_pages(self, vpages: Iterable[int]) -> None:
        """The engine may now use these KV pages (the agent mapped them): map them here."""
        with self._lock:
            if self.kind == SlotMemoryKind.DEVICE or self._closed:
                return
            m = self.host_mapping()
            want = [v for v in vpages if v not in m.kv]
            found = self._lookup(want)
            gone = sorted(v for v, p in found.items() if p is None)
            if gone:
                self.violations += 1
                raise KvAccessError(
                    f"GPU {self.region.gpu}: KV pages {gone[:4]} granted but not mapped"
                )
            m.map_kv({v: p for v, p in found.items() if p is not None})

    def revoke_pages(self, vpages: Iterable[int]) -> None:
        """The engine gave these KV pages up (the agent unmaps them next): make them
        inaccessible here first."""
        with self._lock:
            if self.kind == SlotMemoryKind.DEVICE or self._host is None:
                return
            for first, n in _vruns(sorted(v for v in vpages if v in self._host.kv)):
                self._host.revoke(first, n)

    def check_pages(self, vpages: Iterable[int]) -> None:
        """Raise :class:`KvAccessError` unless every page is mapped by the backend right now,
        to the physical page this process reaches it through: the page-fault check of the
        simulated backend (a GPU's MMU does it on CUDA)."""
        vs = list(vpages)
        if self.kind == SlotMemoryKind.DEVICE or not vs:
            return
        found = self._lookup(vs)
        mine = self._host.kv if self._host is not None else {}
        bad = [v for v in vs if found[v] is None or mine.get(v) != found[v]]
        if bad:
            self.violations += 1
            raise KvAccessError(
                f"GPU {self.region.gpu}: KV access to page {bad[0]}, which is "
                + ("not mapped" if found[bad[0]] is None else "not granted to this engine")
            )

    def _pages_of(self, offset: int, nbytes: int) -> range:
        P = self.region.page_bytes
        return range(offset // P, (offset + max(nbytes, 1) - 1) // P + 1)

    def kv_write(self, offset: int, data: bytes) -> None:
        """Write KV bytes at slot ``offset`` (page-checked first)."""
        self.check_pages(self._pages_of(offset, len(data)))
        if self.kind == SlotMemoryKind.DEVICE:
            self.backend.write(self.region.gpu, self.region.va + offset, data)
            return
        with self._lock:
            m = self.host_mapping()
            ctypes.memmove(m.base + offset, data, len(data))

    def kv_read(self, offset: int, nbytes: int) -> bytes:
        """Read KV bytes at slot ``offset`` (page-checked first)."""
        self.check_pages(self._pages_of(offset, nbytes))
        return self.read(offset, nbytes)

    def update(self, region: SlotRegion) -> None:
        """The agent mapped more of this slot's weights: follow ``region`` in place.

        Used when a prepared engine's slot is activated (the rest of the weights are mapped by
        then; its KV pages are granted as the agent maps them, :meth:`grant_pages`).  A region
        larger than the reservation, or another slot, is an error; CUDA needs nothing (the
        worker's own VMM mappings are the memory)."""
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
            if self._pt is not None and region.page_table != old.page_table:
                self._pt.close()
                self._pt = None
            if self.kind == SlotMemoryKind.DEVICE or self._host is None:
                return
            _, ppages = self._ppages()
            w = self._host.wpages
            if not self.partial and any(p < 0 for p in ppages[:w]):
                raise SlotMemoryError("a weight page of the slot is not mapped")
            self._host.map_weights(ppages[:w])

    def host_mapping(self) -> HostSlotMapping:
        if self.kind == SlotMemoryKind.DEVICE:
            raise SlotMemoryError("device memory has no host mapping")
        if self._closed:
            raise SlotMemoryError("the slot memory is closed (its engine stopped)")
        if self._host is None:
            path, ppages = self._ppages()
            self._host = HostSlotMapping(
                path,
                ppages,
                self.region.page_bytes,
                self.region.weight_bytes,
                len(ppages),
                partial=self.partial,
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
            if self._pt is not None:
                self._pt.close()
                self._pt = None


class _CudaArray:
    """``__cuda_array_interface__`` of a raw device range (wrapped by ``torch.as_tensor``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }
