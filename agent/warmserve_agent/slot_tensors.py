"""Torch tensors over a prewarm slot's memory, without copying (WarmServe §4.2; note §2.4, §7.3).

An engine hosted by the process that owns a GPU's memory builds its model over the slot: the
bytes the loader placed at ``va_base + slot_offset`` (``store.SlotLayout``) *become* the
parameters, so activating a prewarmed model costs no weight copy.  Two steps:

* :func:`cuda_bytes` wraps ``[va, va + nbytes)`` of the process's own VMM mappings as a ``uint8``
  CUDA tensor through ``__cuda_array_interface__`` (public torch API; torch keeps a reference to
  the owner object).  The range must stay mapped for the tensor's lifetime: the agent unmaps a
  slot's weights only after its instance ended.
* :func:`bind_module` replaces every parameter of a model built on the ``meta`` device with a
  typed view of that byte tensor (by checkpoint tensor name), keeping tied parameters tied.

torch is imported lazily: the agent itself never needs it.  Tensor-parallel layouts here are byte
splits (see ``store.py``), so binding is for single-GPU layouts (``tp == 1``); an engine with
semantic sharding (vLLM) maps its own shards with the same two calls.
"""

from __future__ import annotations

from typing import Any

from warmserve_agent.store import SlotLayout

# safetensors dtype names -> torch dtype attribute names
_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class BindError(ValueError):
    """The model and the slot layout disagree (names, shapes or dtypes)."""


class _CudaRange:
    """Owner object exposing a device range through the CUDA array interface (version 3)."""

    def __init__(self, va: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (va, False),
            "version": 3,
            "strides": None,
        }


def cuda_bytes(va: int, nbytes: int, device: int) -> Any:
    """A ``uint8`` tensor over device memory ``[va, va + nbytes)`` of ``cuda:device``."""
    import torch

    t = torch.as_tensor(_CudaRange(va, nbytes), device=f"cuda:{device}")
    if t.data_ptr() != va or t.numel() != nbytes:
        raise BindError(f"torch wrapped {t.data_ptr():#x}+{t.numel()}, not {va:#x}+{nbytes}")
    return t


def torch_dtype(name: str) -> Any:
    import torch

    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise BindError(f"safetensors dtype {name} has no torch equivalent here") from None


def bind_module(module: Any, layout: SlotLayout, base: Any) -> int:
    """Make every parameter of ``module`` a view of ``base`` (a ``uint8`` tensor over the slot's
    weights, e.g. :func:`cuda_bytes`) at its tensor's slot offset; returns the bytes bound.

    ``module`` is typically built on the ``meta`` device; parameters keep their names and shapes,
    which must match the checkpoint's, and take its dtypes (a materialised parameter must already
    have it).  Buffers are left alone (the caller moves them)."""
    import torch

    if layout.tp != 1:
        raise BindError(f"binding needs a single-GPU layout, this one is for {layout.tp} GPUs")
    if base.dtype != torch.uint8 or base.numel() < layout.total_bytes:
        raise BindError(f"base covers {base.numel()} bytes, the weights need {layout.total_bytes}")
    by_name = {p.tensor.name: p for p in layout.placements}
    new: dict[int, torch.nn.Parameter] = {}  # id(old parameter) -> its replacement (ties)
    bound = 0
    for name, old in list(module.named_parameters(remove_duplicate=False)):
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        if id(old) not in new:
            pl = by_name.get(name)
            if pl is None:
                raise BindError(f"parameter {name} is not in the checkpoint")
            dtype = torch_dtype(pl.tensor.dtype)
            shape = tuple(pl.tensor.shape)
            # A meta placeholder's dtype is whatever the skeleton defaulted to: the checkpoint
            # decides.  Casting the skeleton instead would also cast float32 buffers (rotary
            # frequencies) and change the outputs.
            if tuple(old.shape) != shape or (old.dtype != dtype and not old.is_meta):
                raise BindError(
                    f"{name}: model wants {tuple(old.shape)} {old.dtype}, checkpoint has "
                    f"{shape} {dtype}"
                )
            view = base[pl.slot_offset : pl.slot_offset + pl.tensor.nbytes].view(dtype).view(shape)
            new[id(old)] = torch.nn.Parameter(view, requires_grad=False)
            bound += pl.tensor.nbytes
        owner._parameters[leaf] = new[id(old)]
    return bound
