"""Build and load the native slot allocator (``agent/native/slot_allocator.c``).

Decision: the allocator is compiled **lazily** with the system C compiler the
first time it is needed, into a cache keyed by the source's hash, instead of as a setuptools
extension — it needs no CUDA headers and no GPU (it only hands out addresses inside a range the
agent already mapped), and a lazy build keeps ``pip install -e .`` free of a compiler
requirement on machines that never host a vLLM engine.  CI builds and tests it
(tests/agent/test_agent_native.py).  The vLLM adapter (later issue) passes the built path to
``torch.cuda.memory.CUDAPluggableAllocator(path, "warmserve_malloc", "warmserve_free")``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "native" / "slot_allocator.c"


class NativeBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("WARMSERVE_NATIVE_CACHE", Path(base) / "warmserve" / "native"))


def build(out_dir: Path | None = None) -> Path:
    """Compile the allocator (if not cached) and return the shared library's path."""
    if not SOURCE.is_file():
        raise NativeBuildError(
            f"{SOURCE} is missing: the native allocator ships with the source tree "
            "(install warmserve from a checkout, e.g. pip install -e .)"
        )
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"libwarmserve_slot_alloc-{digest}.so"
    if lib.is_file():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError(
            "no C compiler found (set CC or install gcc) to build " + str(SOURCE)
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    cmd = [cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread", "-o", tmp, str(SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"building {SOURCE} failed:\n{res.stderr}")
    os.replace(tmp, lib)  # atomic: concurrent builders agree on the result
    return lib


class SlotAllocator:
    """ctypes view of the allocator (the same functions torch calls through the .so)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or build()
        lib = ctypes.CDLL(str(self.path))
        lib.warmserve_set_region.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
        lib.warmserve_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.warmserve_malloc.restype = ctypes.c_void_p
        lib.warmserve_free.argtypes = [
            ctypes.c_void_p,
            ctypes.c_ssize_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.warmserve_shrink.argtypes = [ctypes.c_int, ctypes.c_uint64]
        lib.warmserve_used.argtypes = [ctypes.c_int]
        lib.warmserve_used.restype = ctypes.c_uint64
        self._lib = lib

    def set_region(self, device: int, base: int, size: int) -> bool:
        return self._lib.warmserve_set_region(device, base, size) == 0

    def malloc(self, size: int, device: int = 0) -> int | None:
        return self._lib.warmserve_malloc(size, device, None)

    def free(self, ptr: int, device: int = 0) -> None:
        self._lib.warmserve_free(ptr, 0, device, None)

    def shrink(self, device: int, size: int) -> bool:
        return self._lib.warmserve_shrink(device, size) == 0

    def used(self, device: int = 0) -> int:
        return self._lib.warmserve_used(device)
