"""``load_format="warmserve_slot"``: vLLM model parameters built over the prewarm slot's memory.

Registered with vLLM's ``register_model_loader`` (vllm-integration note §2.1).  vLLM calls it in
the pooled worker process while it builds the engine; it

1. builds the model with its weights on the ``meta`` device (no memory), as vLLM's own
   zero-copy ``ipc_cache`` loader does — but only ``torch.empty`` (how layers create weights) goes
   to ``meta``, so constants (attention scales, rotary caches) are real;
2. replaces every parameter with a **view of the slot** (``SlotMemory.tensor()``: host memory on
   the simulated backend, the VMM-mapped device range on CUDA — the same code): a checkpoint
   tensor ``t`` placed at slot offset ``o`` becomes
   ``slot[o : o + t.nbytes].view(dtype).view(shape)``.
   vLLM's fused parameters (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up: the model's
   ``packed_modules_mapping``) are one view over their parts, which the slot layout keeps
   adjacent and in order (``store.SlotLayout``).  Tied weights stay one object.
   No weight file is opened, and nothing is copied: a parameter that cannot be a view (missing
   from the slot, parts not adjacent, other dtype or shape) fails the start with its name —
   there is no silent copy fallback;
3. recomputes buffers that are not weights (rotary ``cos_sin_cache``) on the target device;
4. runs vLLM's ``process_weights_after_loading`` under ``weights_already_processed`` — except
   that on the CPU backend the unquantised GEMM dispatch would repack every weight into oneDNN's
   layout (a copy); there the layers keep ``torch.nn.functional.linear`` over the slot views,
   vLLM's own fallback path (``_cpu_skip_gemm_dispatch``).  On CUDA unquantised weights are not
   transformed, so nothing is replaced.
5. reports the slot's resident bytes as external weight memory (``get_external_weight_memory``).

Per-layer readiness: every module holding parameters gets a forward pre-hook waiting on the slot's
:class:`~warmserve_agent.engines.layer_gate.LayerGate` for the layer of its parameters (and
``compute_logits`` for the last), so a forward runs layer ``i`` as soon as layer ``i`` is resident
(``hooks.install_layer_gates``).  Until then the slot's bytes of later layers are never read.

The KV cache: :func:`slot_kv_cache` makes vLLM's KV cache tensors views of the slot's pages after
the weights (``allocate_kv_cache`` computes the layout on ``meta``, the views are taken over the
slot), so weights and KV are the one contiguous range of Figure 6a.  They are not zeroed here (the
KV pages are mapped in the background, after the engine is built): a block's pages are mapped in
this process and zeroed when the agent grants it (``kv.py``), and vLLM zeroes a block again when
it hands it to a request (``hooks.zero_kv_blocks_on_allocation``).

Which slot: the engine registers an :class:`ActiveSlot` under a key (the slot id) and passes it in
``model_loader_extra_config``; the loader runs in the same process (the engine core is
in-process, ``inproc.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.model_executor.utils import weights_already_processed
from vllm.utils.torch_utils import set_default_torch_dtype

from warmserve_agent.engines.layer_gate import LayerGate
from warmserve_agent.engines.slotmem import SlotMemory
from warmserve_agent.engines.spec import EngineSpec

log = logging.getLogger("warmserve.agent.engine.vllm")

LOAD_FORMAT = "warmserve_slot"

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


class SlotLoadError(RuntimeError):
    pass


@dataclass
class ActiveSlot:
    """What the loader needs about the instance being built (in-process registry)."""

    spec: EngineSpec
    mem: SlotMemory
    device: torch.device
    views: dict[str, tuple[int, int]] = field(default_factory=dict)  # param -> (offset, nbytes)
    kv: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_range: tuple[int, int] = (0, 0)  # slot offsets of the KV backing buffer
    gate: LayerGate | None = None  # per-layer readiness (None: every layer is resident)
    rank: int = 0  # tensor-parallel rank: its region of the spec, its shard of every tensor

    @property
    def region(self) -> Any:
        return self.spec.regions[self.rank]


_ACTIVE: dict[str, ActiveSlot] = {}
_LOCK = threading.Lock()


def activate_slot(key: str, slot: ActiveSlot) -> None:
    with _LOCK:
        _ACTIVE[key] = slot


def release_slot(key: str) -> None:
    with _LOCK:
        _ACTIVE.pop(key, None)


def active_slot(key: str) -> ActiveSlot:
    with _LOCK:
        return _ACTIVE[key]


def _slot_for(load_config: Any) -> ActiveSlot:
    extra = load_config.model_loader_extra_config or {}
    key = extra.get("warmserve_instance")
    with _LOCK:
        slot = _ACTIVE.get(key)
    if slot is None:
        raise SlotLoadError(
            f"no prewarm slot registered for {key!r}: load_format={LOAD_FORMAT} is only usable "
            "inside a warmserve worker (the agent's vllm engine)"
        )
    return slot


@register_model_loader(LOAD_FORMAT)
class SlotModelLoader(BaseModelLoader):
    """vLLM model loader over a warmserve prewarm slot (see module docstring)."""

    def download_model(self, model_config: Any) -> None:
        return None  # the weights are already in the slot

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        return _slot_for(self.load_config).region.weight_bytes

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        raise SlotLoadError(
            "the warmserve_slot loader builds parameters over the slot; in-place reloads "
            "(reload_weights) are not supported"
        )

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        slot = _slot_for(self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with torch.device(slot.device), _EmptyOnMeta():
                model = initialize_model(
                    vllm_config=vllm_config, model_config=model_config, prefix=prefix
                )
            bind_parameters(model, slot)
            _materialise_buffers(model, slot.device)
            if slot.gate is not None:
                from warmserve_agent.engines.vllm.hooks import install_layer_gates

                install_layer_gates(model, slot.spec, slot.views, slot.gate)
            with weights_already_processed(), _keep_slot_weights(slot):
                from vllm.model_executor.model_loader.utils import (
                    process_weights_after_loading,
                )

                process_weights_after_loading(model, model_config, slot.device)
        _check_no_meta(model)
        return model.eval()


class _EmptyOnMeta(TorchFunctionMode):
    """During model construction, ``torch.empty`` (how vLLM's layers create their weights in
    ``create_weights``) allocates nothing: it lands on ``meta``.  Everything else — constants
    such as attention scales, rotary caches — is built for real on the target device."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _checkpoint_parts(name: str, packed: dict[str, list[str]]) -> list[str]:
    """Checkpoint tensor names making up vLLM parameter ``name`` (in concatenation order)."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in packed:
        return [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in packed[last]]
    return [name]


def bind_parameters(model: nn.Module, slot: ActiveSlot) -> None:
    """Replace every meta parameter of ``model`` with a view of the slot (see module doc)."""
    spec = slot.spec
    placements = {t.name: t for t in spec.tensors}
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    base = slot.mem.tensor()
    modules = dict(model.named_modules(remove_duplicate=False))
    done: dict[int, nn.Parameter] = {}  # id(meta param) -> slot param (tied weights)
    tp = spec.tp_size
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        if id(param) in done:
            module._parameters[leaf] = done[id(param)]
            continue
        parts = [placements.get(p) for p in _checkpoint_parts(name, packed)]
        if any(p is None for p in parts) and name.endswith("lm_head.weight"):
            # tied to the embeddings but not shared by object: view the same bytes
            parts = [placements.get(name.replace("lm_head", "model.embed_tokens"))]
        if any(p is None for p in parts):
            raise SlotLoadError(
                f"parameter {name}: no tensor {_checkpoint_parts(name, packed)} in the slot "
                f"(the slot holds {len(placements)} checkpoint tensors of {spec.model})"
            )
        start = parts[0].offset  # type: ignore[union-attr]
        end = start
        for p in parts:
            assert p is not None
            if tp > 1 and p.split == "bytes":
                raise SlotLoadError(
                    f"parameter {name}: tensor {p.name} is split by bytes across the "
                    f"{tp} ranks, not as vLLM's tensor-parallel layers load it"
                )
            if p.offset != end:
                raise SlotLoadError(
                    f"parameter {name}: checkpoint tensors {[q.name for q in parts]} are not "  # type: ignore[union-attr]
                    "adjacent in the slot, so one view cannot cover them"
                )
            if _DTYPES.get(p.dtype) != param.dtype:
                raise SlotLoadError(
                    f"parameter {name}: slot holds {p.dtype}, the model wants {param.dtype}; "
                    "serve with the checkpoint's dtype (--dtype auto)"
                )
            end += p.slot_bytes if tp > 1 else p.nbytes  # rank's shard (vocabulary padded)
        if end - start != param.numel() * param.element_size():
            raise SlotLoadError(
                f"parameter {name}: the model wants shape {tuple(param.shape)} "
                f"({param.numel() * param.element_size()} bytes), the slot holds {end - start} "
                "bytes for it (vocabulary padding or sharding differs)"
            )
        if end > slot.region.weight_bytes:
            raise SlotLoadError(f"parameter {name} lies beyond the slot's weights")
        view = base[start:end].view(param.dtype).view(param.shape)
        new = nn.Parameter(view, requires_grad=False)
        for attr, value in vars(param).items():  # vLLM's weight attributes (output_dim, ...)
            with contextlib.suppress(Exception):
                setattr(new, attr, value)
        module._parameters[leaf] = new
        done[id(param)] = new
        slot.views[name] = (start, end - start)


def _materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers are not weights: recompute them on ``device`` (rotary embeddings)."""
    for name, module in model.named_modules():
        for leaf, buf in list(module._buffers.items()):
            if buf is None or buf.device.type != "meta":
                continue
            if leaf in ("cos_sin_cache", "cos_sin_cache_bf16") and hasattr(
                module, "_compute_cos_sin_cache"
            ):
                with torch.device(device):
                    cache = module._compute_cos_sin_cache()
                module._buffers[leaf] = cache.to(device=device, dtype=buf.dtype)
            else:
                raise SlotLoadError(
                    f"buffer {name}.{leaf} of this model is not a weight and warmserve does not "
                    "know how to compute it; this architecture is not supported by the "
                    "warmserve_slot loader yet"
                )


def _check_no_meta(model: nn.Module) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            raise SlotLoadError(f"{name} was left without memory")


@contextlib.contextmanager
def _keep_slot_weights(slot: ActiveSlot) -> Iterator[None]:
    """On CPU, keep unquantised GEMMs on the slot views (``F.linear``) instead of letting
    vLLM repack them into oneDNN's layout (a copy); a no-op elsewhere."""
    if slot.device.type != "cpu":
        yield
        return
    import vllm.model_executor.layers.utils as lu

    original = lu.dispatch_cpu_unquantized_gemm

    def keep(layer: nn.Module, remove_weight: bool) -> None:
        w = getattr(layer, "weight", None)
        if w is not None and slot.mem.contains(w.data_ptr(), w.numel() * w.element_size()):
            layer.cpu_linear = torch.nn.functional.linear
            return
        original(layer, remove_weight)

    lu.dispatch_cpu_unquantized_gemm = keep
    try:
        yield
    finally:
        lu.dispatch_cpu_unquantized_gemm = original


# ---- the KV cache in the slot ----------------------------------------------------------------
_KV_TLS = threading.local()


@contextlib.contextmanager
def slot_kv_cache(slot: ActiveSlot) -> Iterator[None]:
    """While active (in this thread), vLLM's ``allocate_kv_cache`` returns views of the slot's
    KV pages instead of allocating (see module docstring)."""
    import importlib

    # Both model runners import vLLM's allocate_kv_cache by name (V1: gpu_model_runner, also
    # the CPU runner's base; V2: gpu/attn_utils): wrap it where each looks it up.
    mods = []
    for name in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"):
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(name)
            if hasattr(mod, "allocate_kv_cache"):
                mods.append((mod, mod.allocate_kv_cache))
    _KV_TLS.slot = slot

    def wrap(original: Any) -> Any:
        def allocate(kv_cache_config: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
            active: ActiveSlot | None = getattr(_KV_TLS, "slot", None)
            if active is None:
                return original(kv_cache_config, device, *args, **kwargs)
            meta = original(kv_cache_config, torch.device("meta"), *args, **kwargs)
            return _kv_views(active, meta)

        return allocate

    for mod, original in mods:
        mod.allocate_kv_cache = wrap(original)
    try:
        yield
    finally:
        for mod, original in mods:
            mod.allocate_kv_cache = original
        _KV_TLS.slot = None


def _kv_views(slot: ActiveSlot, meta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    region = slot.region
    page = region.page_bytes
    start = -(-region.weight_bytes // page) * page  # KV starts on the first page after weights
    need = 0
    for t in meta.values():
        span = t.untyped_storage().nbytes()
        need = max(need, span)
    if start + need > region.mapped_bytes:
        raise SlotLoadError(
            f"vLLM's KV cache needs {need} bytes; the slot has {region.mapped_bytes - start} "
            "after the weights"
        )
    # Not zeroed here: the pages are mapped (and zeroed, as vLLM does) block by block as the
    # agent grants them (engines/vllm/kv.py); touching them now could fault.
    kv = slot.mem.tensor()[start : start + need]
    out = {}
    for name, t in meta.items():
        typed = kv.view(t.dtype)  # as_strided's offset is absolute in the slot's storage
        out[name] = typed.as_strided(
            t.size(), t.stride(), typed.storage_offset() + t.storage_offset()
        )
    slot.kv = out
    slot.kv_range = (start, start + need)
    return out
