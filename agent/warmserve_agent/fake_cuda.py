"""A recording fake of ``cuda.bindings.driver`` that behaves like the driver where it matters.

What it models (so that code which is wrong on a GPU is wrong here too):

* **Contexts.** A per-thread current context; calls that need one fail with
  ``CUDA_ERROR_INVALID_CONTEXT`` without it.  Primary contexts are reference counted; releasing
  the last reference destroys the context, and pinned buffers, streams or events still alive in
  it are reported as violations (on a GPU they would be freed under the code's feet).
* **Device memory.** ``cuMemGetInfo`` reports free = total - memory used by other processes -
  what this process created; ``cuMemCreate`` fails with ``CUDA_ERROR_OUT_OF_MEMORY`` when it does
  not fit (optionally after ``oom_after`` handles, as when another process allocates meanwhile).
* **VMM.** Reservations, one-handle mappings, access only after ``cuMemSetAccess``, no
  sub-range unmap, no release of a mapped handle.
* **Asynchrony.** ``cuMemcpyHtoDAsync`` only *queues* the copy on its stream; queued copies run
  (reading the host buffer **at that time**) when the stream or an event recorded after them is
  synchronised.  Synchronous copies (legacy default stream) wait for *blocking* streams only, as
  on a GPU, so a reader that forgets to drain a non-blocking stream sees stale bytes, and a
  staging buffer refilled before its copy ran corrupts the slot.  Unmapping or freeing memory a
  queued copy still uses is a violation.
* **Types.** With ``cuda-bindings`` installed it returns the real handle, enum and struct types,
  and :func:`replay_against_real` re-issues every recorded call to the real bindings, whose
  argument checks run before they look for ``libcuda``: a call the real driver API would refuse
  with a ``TypeError`` fails the test.

Every violation raises ``AssertionError`` (and is kept in ``violations``).  Nothing here is a
GPU claim; ``hack/gpu-check.sh`` runs the same contract tests against a real device.  A test
double for the tests, ``hack/gpu-check.sh --dry-run`` and ``bench/gpu_bench.py --smoke``; never
used in production.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

MiB = 1024**2

try:  # the real binding types, when available (a dev dependency)
    from cuda.bindings import driver as _real  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - exercised only without cuda-bindings
    _real = None


class _CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_READY = 600


class _Struct:
    def __init__(self) -> None:
        self.type = 0
        self.flags = 0
        self.location = type("Loc", (), {"type": 0, "id": 0})()


def _enum(name: str, **members: int) -> Any:
    if _real is not None:
        return getattr(_real, name)
    return IntEnum(name, members)


CUresult = _real.CUresult if _real is not None else _CUresult


@dataclass
class _Ctx:
    dev: int
    refs: int = 0
    alive: bool = True


@dataclass
class _Stream:
    ctx: int
    flags: int
    queue: list[tuple[int, Callable[[], None], tuple[int, int], int]] = field(
        default_factory=list
    )  # (seq, run, (dst va, n), src host address)
    seq: int = 0


class FakeDriver:
    """See the module docstring.  ``calls`` records ``(name, args)`` of every call."""

    def __init__(
        self,
        *,
        devices: int = 1,
        mem_bytes: int = 64 * MiB,
        granularity: int = 2 * MiB,
        used_by_others: int = 0,
        oom_after: int | None = None,
        create_barrier: threading.Barrier | None = None,
        fail_map_at: int | None = None,
    ) -> None:
        self.devices = devices
        self.mem_bytes = mem_bytes
        self.granularity = granularity
        self.used_by_others = used_by_others
        self.oom_after = oom_after
        self.create_barrier = create_barrier
        self.fail_map_at = fail_map_at
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.violations: list[str] = []
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._ids = 0
        self.ctxs: dict[int, _Ctx] = {}
        self.primary: dict[int, int] = {}  # dev -> ctx id
        self.handles: dict[int, tuple[int, bytearray]] = {}  # id -> (dev, bytes)
        self.created: dict[int, int] = dict.fromkeys(range(devices), 0)  # dev -> handles made
        self.reservations: dict[int, int] = {}  # va -> size
        self.maps: dict[int, int] = {}  # va page -> handle id
        self.access: set[int] = set()
        self.streams: dict[int, _Stream] = {}
        self.events: dict[int, tuple[int, tuple[int, int] | None]] = {}  # id -> (ctx, marker)
        self.host: dict[int, tuple[int, Any]] = {}  # address -> (ctx, ctypes buffer)
        self.map_calls = 0
        self.first_create_seen: set[int] = set()
        # Enums and structs the backend reads off the driver module.
        self.CUresult = CUresult
        self.CUmemAllocationType = _enum("CUmemAllocationType", CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = _enum("CUmemLocationType", CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAllocationGranularity_flags = _enum(
            "CUmemAllocationGranularity_flags", CU_MEM_ALLOC_GRANULARITY_MINIMUM=0
        )
        self.CUmemAccess_flags = _enum("CUmemAccess_flags", CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
        self.CUstream_flags = _enum("CUstream_flags", CU_STREAM_DEFAULT=0, CU_STREAM_NON_BLOCKING=1)
        self.CUevent_flags = _enum("CUevent_flags", CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
        self.CUmemAllocationProp = _real.CUmemAllocationProp if _real else _Struct
        self.CUmemAccessDesc = _real.CUmemAccessDesc if _real else _Struct

    # ---- helpers -----------------------------------------------------------------------------
    def _t(self, name: str, value: int) -> Any:
        return getattr(_real, name)(value) if _real is not None else value

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    def _rec(self, name: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self.calls.append((name, args))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _violate(self, msg: str) -> None:
        self.violations.append(msg)
        raise AssertionError(f"CUDA misuse: {msg}")

    def _cur(self) -> int | None:
        ctx = getattr(self._tls, "ctx", None)
        if ctx is None or not self.ctxs[ctx].alive:
            return None
        return ctx

    def _ok(self, *rest: Any) -> tuple[Any, ...]:
        return (CUresult.CUDA_SUCCESS, *rest)

    def _err(self, code: str) -> tuple[Any, ...]:
        return (getattr(CUresult, code),)

    def current_device(self) -> int | None:
        ctx = self._cur()
        return None if ctx is None else self.ctxs[ctx].dev

    def _dev_used(self, dev: int) -> int:
        return sum(len(b) for d, b in self.handles.values() if d == dev)

    # ---- init, devices, contexts ------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple[Any, ...]:
        self._rec("cuInit", (flags,))
        return self._ok()

    def cuGetErrorName(self, err: Any) -> tuple[Any, ...]:
        try:
            return self._ok(CUresult(err).name.encode())
        except ValueError:
            return self._ok(b"CUDA_ERROR_UNKNOWN")

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        self._rec("cuDeviceGetCount", ())
        return self._ok(self.devices)

    def cuDeviceGet(self, i: int) -> tuple[Any, ...]:
        self._rec("cuDeviceGet", (i,))
        if not 0 <= i < self.devices:
            return self._err("CUDA_ERROR_INVALID_DEVICE")
        return self._ok(self._t("CUdevice", i))

    def cuDeviceTotalMem(self, dev: Any) -> tuple[Any, ...]:
        self._rec("cuDeviceTotalMem", (dev,))
        return self._ok(self.mem_bytes)

    def cuDeviceGetName(self, n: int, dev: Any) -> tuple[Any, ...]:
        self._rec("cuDeviceGetName", (n, dev))
        return self._ok(b"Fake GPU".ljust(n, b"\0"))

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[Any, ...]:
        self._rec("cuDevicePrimaryCtxRetain", (dev,))
        d = int(dev)
        with self._lock:
            cid = self.primary.get(d)
            if cid is None or not self.ctxs[cid].alive:
                cid = self._new_id()
                self.ctxs[cid] = _Ctx(d)
                self.primary[d] = cid
            self.ctxs[cid].refs += 1
        return self._ok(self._t("CUcontext", cid))

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> tuple[Any, ...]:
        self._rec("cuDevicePrimaryCtxRelease", (dev,))
        with self._lock:
            cid = self.primary.get(int(dev))
            if cid is None or self.ctxs[cid].refs == 0:
                return self._err("CUDA_ERROR_INVALID_CONTEXT")
            ctx = self.ctxs[cid]
            ctx.refs -= 1
            if ctx.refs == 0:
                ctx.alive = False
                pinned = [a for a, (c, _) in self.host.items() if c == cid]
                streams = [s for s, st in self.streams.items() if st.ctx == cid]
                events = [e for e, (c, _) in self.events.items() if c == cid]
                if pinned or streams or events:
                    self._violate(
                        f"context of device {int(dev)} released with {len(pinned)} pinned "
                        f"buffers, {len(streams)} streams, {len(events)} events still alive"
                    )
        return self._ok()

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        self._rec("cuCtxSetCurrent", (ctx,))
        cid = int(ctx)
        if cid not in self.ctxs or not self.ctxs[cid].alive:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        self._tls.ctx = cid
        return self._ok()

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        self._rec("cuCtxGetCurrent", ())
        return self._ok(self._t("CUcontext", self._cur() or 0))

    # ---- memory info, VMM ---------------------------------------------------------------------
    def cuMemGetInfo(self) -> tuple[Any, ...]:
        self._rec("cuMemGetInfo", ())
        ctx = self._cur()
        if ctx is None:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        dev = self.ctxs[ctx].dev
        with self._lock:
            free = self.mem_bytes - self.used_by_others - self._dev_used(dev)
        return self._ok(max(0, free), self.mem_bytes)

    def cuMemGetAllocationGranularity(self, prop: Any, flag: Any) -> tuple[Any, ...]:
        self._rec("cuMemGetAllocationGranularity", (prop, flag))
        if int(prop.type) != 1 or int(prop.location.type) != 1:
            self._violate("granularity asked for a non-pinned or non-device allocation")
        return self._ok(self.granularity)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        self._rec("cuMemCreate", (size, prop, flags))
        ctx = self._cur()
        if ctx is None:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        dev = int(prop.location.id)
        if self.create_barrier is not None and dev not in self.first_create_seen:
            self.first_create_seen.add(dev)
            # Every device's first handle waits for the others: serial opens time out here.
            self.create_barrier.wait()
        if size % self.granularity:
            return self._err("CUDA_ERROR_INVALID_VALUE")
        with self._lock:
            free = self.mem_bytes - self.used_by_others - self._dev_used(dev)
            if size > free or (self.oom_after is not None and self.created[dev] >= self.oom_after):
                return self._err("CUDA_ERROR_OUT_OF_MEMORY")
            h = self._new_id()
            self.handles[h] = (dev, bytearray(size))
            self.created[dev] += 1
        return self._ok(self._t("CUmemGenericAllocationHandle", h))

    def cuMemRelease(self, h: Any) -> tuple[Any, ...]:
        self._rec("cuMemRelease", (h,))
        with self._lock:
            if int(h) in self.maps.values():
                self._violate("released a handle that is still mapped")
            if self.handles.pop(int(h), None) is None:
                return self._err("CUDA_ERROR_INVALID_HANDLE")
        return self._ok()

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple[Any, ...]:
        self._rec("cuMemAddressReserve", (size, align, addr, flags))
        with self._lock:
            va = (1 << 40) + sum(s + (1 << 30) for s in self.reservations.values())
            va = -(-va // (1 << 30)) * (1 << 30)
            while va in self.reservations:
                va += 1 << 30
            self.reservations[va] = size
        return self._ok(self._t("CUdeviceptr", va))

    def cuMemAddressFree(self, va: int, size: int) -> tuple[Any, ...]:
        self._rec("cuMemAddressFree", (va, size))
        with self._lock:
            if self.reservations.get(int(va)) != size:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            g = self.granularity
            if any(int(va) // g <= v < (int(va) + size) // g for v in self.maps):
                self._violate("freed a reservation that still has mappings")
            del self.reservations[int(va)]
        return self._ok()

    def cuMemMap(self, va: int, size: int, off: int, h: Any, flags: int) -> tuple[Any, ...]:
        self._rec("cuMemMap", (va, size, off, h, flags))
        g = self.granularity
        with self._lock:
            self.map_calls += 1
            if self.fail_map_at is not None and self.map_calls == self.fail_map_at:
                return self._err("CUDA_ERROR_OUT_OF_MEMORY")
            if int(h) not in self.handles or size != len(self.handles[int(h)][1]) or off:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            if va % g or va // g in self.maps:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            self.maps[va // g] = int(h)
        return self._ok()

    def cuMemSetAccess(self, va: int, size: int, descs: list[Any], n: int) -> tuple[Any, ...]:
        self._rec("cuMemSetAccess", (va, size, descs, n))
        g = self.granularity
        if n != len(descs) or int(descs[0].flags) != 3:
            return self._err("CUDA_ERROR_INVALID_VALUE")
        with self._lock:
            pages = range(va // g, (va + size) // g)
            if any(v not in self.maps for v in pages):
                return self._err("CUDA_ERROR_INVALID_VALUE")
            self.access.update(pages)
        return self._ok()

    def cuMemUnmap(self, va: int, size: int) -> tuple[Any, ...]:
        self._rec("cuMemUnmap", (va, size))
        g = self.granularity
        with self._lock:
            h = self.maps.get(va // g)
            if h is None or size != len(self.handles[h][1]):
                return self._err("CUDA_ERROR_INVALID_VALUE")  # no sub-range unmaps
            for st in self.streams.values():
                for _, _, (dst, n), _ in st.queue:
                    if dst // g <= va // g <= (dst + max(n, 1) - 1) // g:
                        self._violate(f"unmapped page {va // g} while a copy to it is queued")
            del self.maps[va // g]
            self.access.discard(va // g)
        return self._ok()

    def _device_bytes(self, va: int, n: int) -> Iterable[tuple[bytearray, int, int, int]]:
        g = self.granularity
        pos = 0
        while pos < n:
            v, off = divmod(va + pos, g)
            if v not in self.access:
                self._violate(f"access to page {v} that is unmapped or has no access rights")
            k = min(g - off, n - pos)
            yield self.handles[self.maps[v]][1], off, pos, k
            pos += k

    def cuMemAlloc(self, n: int) -> tuple[Any, ...]:
        """Ordinary device memory (what cudaMalloc gives): modelled as mapped VMM pages."""
        self._rec("cuMemAlloc", (n,))
        ctx = self._cur()
        if ctx is None:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        g = self.granularity
        size = -(-n // g) * g
        dev = self.ctxs[ctx].dev
        with self._lock:
            if size > self.mem_bytes - self.used_by_others - self._dev_used(dev):
                return self._err("CUDA_ERROR_OUT_OF_MEMORY")
            va = (1 << 44) + self._new_id() * (1 << 36)
            for i in range(size // g):
                h = self._new_id()
                self.handles[h] = (dev, bytearray(g))
                self.maps[va // g + i] = h
                self.access.add(va // g + i)
            self.reservations[va] = size
        return self._ok(self._t("CUdeviceptr", va))

    def cuMemFree(self, p: Any) -> tuple[Any, ...]:
        self._rec("cuMemFree", (p,))
        g = self.granularity
        with self._lock:
            size = self.reservations.pop(int(p), None)
            if size is None:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            for v in range(int(p) // g, (int(p) + size) // g):
                self.handles.pop(self.maps.pop(v))
                self.access.discard(v)
        return self._ok()

    def cuDriverGetVersion(self) -> tuple[Any, ...]:
        self._rec("cuDriverGetVersion", ())
        return self._ok(13000)

    # ---- host memory, streams, events, copies -------------------------------------------------
    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[Any, ...]:
        self._rec("cuMemHostAlloc", (n, flags))
        ctx = self._cur()
        if ctx is None:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        buf = (ctypes.c_ubyte * n)()
        with self._lock:
            self.host[ctypes.addressof(buf)] = (ctx, buf)
        return self._ok(ctypes.addressof(buf))

    def cuMemFreeHost(self, p: Any) -> tuple[Any, ...]:
        self._rec("cuMemFreeHost", (p,))
        with self._lock:
            ent = self.host.get(int(p))
            if ent is None:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            if not self.ctxs[ent[0]].alive:
                self._violate("pinned memory freed after its context was released")
            size = ctypes.sizeof(ent[1])
            for st in self.streams.values():
                for _, _, _, src in st.queue:
                    if int(p) <= src < int(p) + size:
                        self._violate("freed pinned memory a queued copy still reads")
            del self.host[int(p)]
        return self._ok()

    def pinned_bytes(self) -> int:
        return sum(ctypes.sizeof(b) for _, b in self.host.values())

    def cuStreamCreate(self, flags: Any) -> tuple[Any, ...]:
        self._rec("cuStreamCreate", (flags,))
        ctx = self._cur()
        if ctx is None:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        with self._lock:
            s = self._new_id()
            self.streams[s] = _Stream(ctx, int(flags))
        return self._ok(self._t("CUstream", s))

    def cuStreamGetFlags(self, s: Any) -> tuple[Any, ...]:
        self._rec("cuStreamGetFlags", (s,))
        return self._ok(self.streams[int(s)].flags)

    def _run(self, sid: int, upto: int | None = None) -> None:
        st = self.streams[sid]
        while st.queue and (upto is None or st.queue[0][0] <= upto):
            _, run, _, _ = st.queue.pop(0)
            run()

    def cuStreamSynchronize(self, s: Any) -> tuple[Any, ...]:
        self._rec("cuStreamSynchronize", (s,))
        with self._lock:
            if int(s) not in self.streams:
                return self._err("CUDA_ERROR_INVALID_HANDLE")
            self._run(int(s))
        return self._ok()

    def cuStreamDestroy(self, s: Any) -> tuple[Any, ...]:
        self._rec("cuStreamDestroy", (s,))
        with self._lock:
            self._run(int(s))  # pending work completes before the stream goes away
            del self.streams[int(s)]
        return self._ok()

    def cuEventCreate(self, flags: Any) -> tuple[Any, ...]:
        self._rec("cuEventCreate", (flags,))
        ctx = self._cur()
        if ctx is None:
            return self._err("CUDA_ERROR_INVALID_CONTEXT")
        with self._lock:
            e = self._new_id()
            self.events[e] = (ctx, None)
        return self._ok(self._t("CUevent", e))

    def cuEventRecord(self, e: Any, s: Any) -> tuple[Any, ...]:
        self._rec("cuEventRecord", (e, s))
        with self._lock:
            if int(e) not in self.events or int(s) not in self.streams:
                return self._err("CUDA_ERROR_INVALID_HANDLE")
            st = self.streams[int(s)]
            self.events[int(e)] = (self.events[int(e)][0], (int(s), st.seq))
        return self._ok()

    def cuEventSynchronize(self, e: Any) -> tuple[Any, ...]:
        self._rec("cuEventSynchronize", (e,))
        with self._lock:
            if int(e) not in self.events:
                return self._err("CUDA_ERROR_INVALID_HANDLE")
            marker = self.events[int(e)][1]
            if marker is not None and marker[0] in self.streams:
                self._run(marker[0], marker[1])
        return self._ok()

    def cuEventQuery(self, e: Any) -> tuple[Any, ...]:
        self._rec("cuEventQuery", (e,))
        marker = self.events[int(e)][1]
        if marker is None or marker[0] not in self.streams:
            return self._ok()
        q = self.streams[marker[0]].queue
        return self._err("CUDA_ERROR_NOT_READY") if q and q[0][0] <= marker[1] else self._ok()

    def cuEventDestroy(self, e: Any) -> tuple[Any, ...]:
        self._rec("cuEventDestroy", (e,))
        with self._lock:
            if self.events.pop(int(e), None) is None:
                return self._err("CUDA_ERROR_INVALID_HANDLE")
        return self._ok()

    def cuMemcpyHtoDAsync(self, dst: Any, src: Any, n: int, s: Any) -> tuple[Any, ...]:
        self._rec("cuMemcpyHtoDAsync", (dst, src, n, s))
        dst, src = int(dst), int(src)
        with self._lock:
            if self._cur() is None:
                return self._err("CUDA_ERROR_INVALID_CONTEXT")
            pinned = self.host.items()
            if not any(a <= src and src + n <= a + ctypes.sizeof(b) for a, (_, b) in pinned):
                self._violate("asynchronous copy from memory that is not pinned")
            list(self._device_bytes(dst, n))  # must be mapped with access now

            def run() -> None:
                data = ctypes.string_at(src, n)  # the host buffer as it is *now*
                for buf, off, pos, k in self._device_bytes(dst, n):
                    buf[off : off + k] = data[pos : pos + k]

            st = self.streams[int(s)]
            st.seq += 1
            st.queue.append((st.seq, run, (dst, n), src))
        return self._ok()

    def _legacy_sync(self) -> None:
        """Synchronous copies use the legacy default stream: they wait for blocking streams
        of the current context, not for non-blocking ones."""
        ctx = self._cur()
        for sid, st in list(self.streams.items()):
            if st.ctx == ctx and not st.flags & 1:
                self._run(sid)

    def cuMemcpyHtoD(self, dst: Any, src: Any, n: int) -> tuple[Any, ...]:
        self._rec("cuMemcpyHtoD", (dst, src, n))
        with self._lock:
            if self._cur() is None:
                return self._err("CUDA_ERROR_INVALID_CONTEXT")
            self._legacy_sync()
            if isinstance(src, bytes | bytearray | memoryview):
                data = bytes(src)[:n]
            else:  # a host address (pinned or not), as the real binding accepts
                data = ctypes.string_at(int(src), n)
            for buf, off, pos, k in self._device_bytes(int(dst), n):
                buf[off : off + k] = data[pos : pos + k]
        return self._ok()

    def cuMemcpyDtoH(self, dst: Any, src: Any, n: int) -> tuple[Any, ...]:
        self._rec("cuMemcpyDtoH", (dst, src, n))
        with self._lock:
            if self._cur() is None:
                return self._err("CUDA_ERROR_INVALID_CONTEXT")
            self._legacy_sync()
            for buf, off, pos, k in self._device_bytes(int(src), n):
                dst[pos : pos + k] = buf[off : off + k]
        return self._ok()


# One shared instance per process for worker processes
# (``driver="warmserve_agent.fake_cuda:DRIVER"``); sized by the environment the test sets before
# the workers start.
DRIVER = FakeDriver(
    devices=int(os.environ.get("WARMSERVE_FAKE_CUDA_DEVICES", "2")),
    mem_bytes=int(os.environ.get("WARMSERVE_FAKE_CUDA_MEM", str(64 * MiB))),
)


def replay_against_real(calls: Iterable[tuple[str, tuple[Any, ...]]]) -> list[str]:
    """Re-issue recorded calls to the real ``cuda.bindings.driver``; return those its argument
    checks refuse.  Without a driver library each accepted call fails only when the binding
    looks for ``libcuda`` (that error is the expected outcome here)."""
    if _real is None:
        raise RuntimeError("cuda-bindings is not installed")
    refused = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for name, args in calls:
        key = (name, tuple(type(a).__name__ for a in args))
        if key in seen:
            continue
        seen.add(key)
        try:
            getattr(_real, name)(*args)
        except (TypeError, ValueError, OverflowError, AttributeError) as exc:
            refused.append(f"{name}{key[1]}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # the driver library is missing: arguments were accepted
            if "cuda" not in str(exc).lower() and "driver" not in str(exc).lower():
                refused.append(f"{name}{key[1]}: unexpected {type(exc).__name__}: {exc}")
        else:  # a real driver is present: fine too (the call ran)
            pass
    return refused
