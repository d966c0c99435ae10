"""The CUDA driver module and its calls: import it, call it with errors that name the call.

Shared by the VMM backend (:mod:`~warmserve_agent.backends.cuda`) and ``warmserve agent``'s GPU
discovery (:func:`device_sizes`, which needs no context and allocates nothing).  ``cuda-python``
is imported lazily, so this module imports on machines without it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["CudaError", "checked", "device_sizes", "import_driver", "init_driver"]


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


def import_driver(spec: str | None = None) -> ModuleType:
    """The driver module: ``cuda.bindings.driver`` (cuda-python 12.6+/13.x) or, given
    ``"module:attribute"``, that object (tests pass a fake driver this way to worker
    processes)."""
    if spec:
        mod_name, _, attr = spec.partition(":")
        mod = importlib.import_module(mod_name)
        return getattr(mod, attr) if attr else mod
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
        except ImportError as exc:
            raise CudaError(
                "the cuda backend needs cuda-python: pip install 'warmserve[cuda]' "
                "(or run with --simulate-gpus)"
            ) from exc
    return driver


def checked(drv: Any, name: str, *args: Any) -> tuple[Any, ...]:
    """Call a driver function; raise CudaError naming it unless it returned CUDA_SUCCESS."""
    ret = getattr(drv, name)(*args)
    err, rest = ret[0], tuple(ret[1:])
    if err != drv.CUresult.CUDA_SUCCESS:
        try:
            _, s = drv.cuGetErrorName(err)
            why = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # pragma: no cover - best effort for the message only
            why = str(err)
        raise CudaError(f"{name} failed: {why}", err)
    return rest


def init_driver(drv: Any) -> None:
    """``cuInit``, with a clear error where the NVIDIA driver itself is missing."""
    try:
        checked(drv, "cuInit", 0)
    except CudaError:
        raise
    except Exception as exc:  # cuda-bindings raises when libcuda itself is missing
        raise CudaError(
            f"no usable NVIDIA driver ({type(exc).__name__}: {exc}); "
            "on machines without GPUs use --simulate-gpus"
        ) from None


def device_sizes(driver: Any = None) -> list[int]:
    """Memory of every visible GPU, from the driver (no contexts, no allocations)."""
    drv = driver if driver is not None else import_driver()
    init_driver(drv)
    (count,) = checked(drv, "cuDeviceGetCount")
    out = []
    for i in range(int(count)):
        (dev,) = checked(drv, "cuDeviceGet", i)
        out.append(int(checked(drv, "cuDeviceTotalMem", dev)[0]))
    return out
