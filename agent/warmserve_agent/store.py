"""Node-local weight store and the layout of a model's weights inside a prewarm slot.

Store layout (HF-style files, one flat directory per model)::

    <root>/<dir>/config.json            # num_hidden_layers (or n_layer / num_layers)
    <root>/<dir>/*.safetensors          # tensors named model.layers.<i>.<...> etc.

``<dir>`` is :func:`warmserve.modelref.store_dirname` of the model's name (``NAME`` or
``ORG/NAME``, up to 200 characters) and nothing else computes it: ``llama-3-8b`` lives in
``<root>/llama-3-8b/``, ``meta-llama/Llama-3.1-8B`` in ``<root>/meta-llama~Llama-3.1-8B/``.  No
model's directory is the parent of another's, so removing one model can only remove its own
files.  Stores written in the earlier nested layout (``<root>/ORG/NAME``) are moved to this one
when the agent starts (:mod:`warmserve_agent.store_layout`).  The store only reads;
:mod:`warmserve_agent.sources` fills it on demand from a model's source.

Links: a file the store reads (``config.json``, ``*.safetensors``) must resolve inside its
model's directory (resolved too: a linked ``pvc://``/``file://`` model is its target).  A link
within the model's directory is followed; one that leaves it (to ``/etc``, the agent's keys,
another model) is refused when the model is scanned and again before its bytes are read.

``config.json`` may carry a ``"warmserve"`` object with engine profile fields (``max_batch``,
``prefill_tok_s``, ``decode_tok_s``, ``kv_bytes_per_token``); defaults apply otherwise.

Layers ("first N layers", WarmServe §4): a tensor named ``*.layers.<i>.*`` (or ``*.h.<i>.*``)
belongs to layer ``i``; tensors outside the layer stack are assigned by role — embeddings
(names containing ``embed`` or ``wte``/``wpe``) count with layer 0 (the first layer needs
them), everything else (final norm, ``lm_head``) with the last layer (only the last layer needs
them).  So "first N layers" is well defined and N = num_layers is the whole model.

Slot layout: tensors are placed in layer order (then by name, with the projections an engine
fuses — q/k/v, gate/up — adjacent and in that order), each at a 256-byte aligned offset from the
slot start; the weights of the first N layers are a prefix of the slot.

Tensor parallelism (a group of D GPUs): rank r's shard of every tensor sits at the same slot
offset on GPU r.  When ``config.json`` declares the head geometry (heads, KV heads, hidden,
intermediate, vocabulary) and D splits it, each tensor is split as vLLM's tensor-parallel layers
load it (:mod:`warmserve.policy.tensor_parallel`: column-parallel by heads/rows, row-parallel by
input columns, the vocabulary padded to 64 and split by rows, norms replicated), so a rank's slot
holds exactly its parameters.  A tensor with no such split (or a model without the geometry) is
split by bytes into D contiguous shards of ``ceil(n/D)``: verifiable bytes for the simulated
engine, refused by vLLM (``Placement.byte_split``).

Host copies: a model's file bytes are read once into (pageable) host memory for hashing and kept
in an LRU cache bounded by ``host_cache_bytes``.  Loading does not use them: the process owning a
GPU's memory reads the file ranges itself (``loader.layer_ranges``, ``backends/staging.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from warmserve.modelref import SourceURIError, model_of_store_entry, store_dirname
from warmserve.policy.tensor_parallel import (
    RankSlice,
    Split,
    TpShape,
    rank_slice,
    shape_problem,
    tensor_split,
    tp_shape_from_config,
)
from warmserve_agent.safe_text import shown, shown_names
from warmserve_agent.store_errors import StoreError, UnknownModel
from warmserve_agent.store_layout import upgrade_layout

ALIGN = 256
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBED_RE = re.compile(r"embed|(?:^|\.)wte(?:\.|$)|(?:^|\.)wpe(?:\.|$)")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    layer: int
    file: Path
    offset: int  # absolute byte offset of the tensor data in ``file``
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class EngineProfile:
    """Pacing of the simulated engine (and the model's batch limit C of Eq. 1)."""

    max_batch: int = 32
    prefill_tok_s: float = 20000.0
    decode_tok_s: float = 200.0
    kv_bytes_per_token: int = 4096


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    num_layers: int
    tensors: tuple[TensorEntry, ...]  # slot order: by layer, then name
    profile: EngineProfile
    tp_shape: TpShape | None = None  # head geometry from config.json (tensor-parallel splits)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
DTYPE_BYTES |= {"I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Placement:
    tensor: TensorEntry
    slot_offset: int
    shard_bytes: int  # slot bytes reserved on every rank
    slices: tuple[RankSlice, ...]  # rank r's bytes of the tensor
    split: Split = Split.REPLICATED

    @property
    def byte_split(self) -> bool:
        """Split by bytes, not as an engine's tensor-parallel layers load it (tp > 1 only)."""
        return self.split == Split.BYTES

    def ranges(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(start within the tensor, length) of rank's pieces, concatenated in the slot."""
        return self.slices[rank].ranges

    def shard_len(self, rank: int) -> int:
        """Bytes of rank's shard that hold the tensor's data (from the slot offset on)."""
        return self.slices[rank].nbytes

    def shard(self, rank: int) -> tuple[int, int]:
        """(start within the tensor, length) of rank's shard when it is one piece."""
        r = self.ranges(rank)
        if len(r) > 1:
            raise ValueError(f"{self.tensor.name}: rank {rank}'s shard is {len(r)} pieces")
        return r[0] if r else (self.tensor.nbytes, 0)

    def shard_data(self, data: memoryview | bytes, rank: int) -> bytes:
        """Rank's shard of the tensor's bytes ``data``."""
        return b"".join(bytes(data[s : s + n]) for s, n in self.ranges(rank))


@dataclass(frozen=True)
class SlotLayout:
    """Where every tensor shard of ``model`` sits in a slot of a ``tp``-GPU group."""

    model: ModelEntry
    tp: int
    placements: tuple[Placement, ...]
    layer_end: tuple[int, ...]  # slot offset just after layer i's tensors

    @classmethod
    def build(cls, model: ModelEntry, tp: int) -> SlotLayout:
        if tp < 1:
            raise StoreError(f"tensor-parallel group size must be >= 1, got {tp}")
        off = 0
        placements = []
        ends = [0] * model.num_layers
        for t in model.tensors:
            item = DTYPE_BYTES.get(t.dtype, 1)
            shape = t.shape if math.prod(t.shape) * item == t.nbytes else (t.nbytes,)
            tp_shape = model.tp_shape if shape == t.shape else None
            slices = tuple(rank_slice(t.name, shape, item, tp, r, tp_shape) for r in range(tp))
            split = tensor_split(t.name, shape, tp, tp_shape)
            shard = slices[0].slot_bytes
            placements.append(Placement(t, off, shard, slices, split))
            off = -(-(off + shard) // ALIGN) * ALIGN
            ends[t.layer] = off
        for i in range(1, len(ends)):  # a layer without tensors ends where the previous did
            ends[i] = max(ends[i], ends[i - 1])
        return cls(model, tp, tuple(placements), tuple(ends))

    def bytes_for_layers(self, n: int) -> int:
        """Slot bytes (per GPU) holding the first ``n`` layers."""
        return 0 if n <= 0 else self.layer_end[n - 1]

    @property
    def total_bytes(self) -> int:
        return self.bytes_for_layers(self.model.num_layers)

    def layer_placements(self, layer: int) -> list[Placement]:
        return [p for p in self.placements if p.tensor.layer == layer]

    def tp_layers_problem(self) -> str | None:
        """Why this layout cannot serve an engine whose TP ranks load tensors as vLLM's layers
        do (None when every tensor is split that way, or there is one rank)."""
        if self.tp == 1:
            return None
        shape = self.model.tp_shape
        if shape is None:
            return (
                f"model {self.model.name}'s config.json declares no head geometry "
                "(num_attention_heads, hidden_size, intermediate_size, vocab_size), so its "
                f"tensors cannot be split {self.tp} ways as the engine's layers load them"
            )
        why = shape_problem(self.tp, shape)
        if why:
            return f"model {self.model.name}: {why}"
        odd = [p.tensor.name for p in self.placements if p.byte_split]
        if odd:
            return (
                f"model {self.model.name}: no tensor-parallel split is known for "
                f"{len(odd)} tensors ({', '.join(shown_names(odd[:3]))}...)"
            )
        return None


def config_num_layers(cfg: object) -> int | None:
    """Layers a model's ``config.json`` declares (None when it declares no positive count)."""
    if not isinstance(cfg, dict):
        return None
    n = next((cfg[k] for k in _LAYER_KEYS if k in cfg), None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


# Projections an engine fuses into one parameter (vLLM's ``packed_modules_mapping``: qkv_proj =
# q, k, v; gate_up_proj = gate, up): placing them adjacent and in this order lets an engine view
# them as one tensor over the slot without a copy (engines/vllm/loader.py).
_FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2)}
_FUSED |= {"gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1)}


def _slot_order(name: str) -> tuple[str, int]:
    """Sort key within a layer: by name, except that fused projections sit together in order."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in _FUSED:
        group, idx = _FUSED[last]
        return f"{parent}.{group}.{leaf}", idx
    return name, 0


def _layer_of(name: str, num_layers: int) -> int:
    m = _LAYER_RE.search(name)
    if m:
        return int(m.group(1))
    return 0 if _EMBED_RE.search(name) else num_layers - 1


def confined(model_dir: Path, f: Path) -> Path:
    """The real path of model file ``f`` when it lies inside ``model_dir`` (resolved), else
    :class:`StoreError`: links may point within a model, never out of it (module docstring)."""
    base = os.path.realpath(model_dir)
    real = os.path.realpath(f)
    if real == base or os.path.commonpath([base, real]) != base:
        raise StoreError(
            f"{f} resolves to {real}, outside its model's directory {base}: a model's files may "
            "not link out of it"
        )
    return Path(real)


def read_safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(data start offset, header) of a .safetensors file, parsed without loading tensors."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise StoreError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise StoreError(f"{path}: safetensors header of {n} bytes is implausible")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as exc:
            raise StoreError(f"{path}: bad safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return 8 + n, header


class WeightStore:
    """Models under ``root`` and a bounded host-memory cache of their bytes."""

    def __init__(
        self,
        root: str | Path,
        *,
        host_cache_bytes: int = 8 * 1024**3,
    ) -> None:
        self.root = Path(root)
        self.host_cache_bytes = host_cache_bytes
        self._lock = threading.Lock()
        self._models: dict[str, tuple[float, ModelEntry]] = {}
        self._host: OrderedDict[str, memoryview] = OrderedDict()
        self._digests: dict[tuple[ModelEntry, int, int], tuple[bytes, ...]] = {}
        self._host_bytes = 0
        self.stats: dict[str, int] = {"host_hits": 0}

    def list_models(self) -> list[str]:
        """Model names in the store: entries of the root named as :func:`store_dirname` makes
        them, holding a config.json (hidden entries, e.g. the fetcher's staging area, and
        anything else are skipped)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            name = model_of_store_entry(p.name)
            if name is not None and (p / "config.json").is_file():
                out.append(name)
        return sorted(out)

    def model_path(self, name: str) -> Path:
        """Where model ``name`` lives in the store (checked name; may not exist).  The one
        place a store path is computed (module docstring)."""
        try:
            return self.root / store_dirname(name)
        except SourceURIError:
            raise StoreError(
                f"malformed model name {shown(name)}: use NAME or ORG/NAME (1-200 characters), "
                "each part of [A-Za-z0-9._-] starting with a letter or digit"
            ) from None

    def has(self, name: str) -> bool:
        return (self.model_path(name) / "config.json").is_file()

    def forget(self, name: str) -> None:
        """Drop cached scans, host copies and digests of ``name`` (its files went away)."""
        prefix = str(self.model_path(name)) + "/"
        with self._lock:
            self._models.pop(name, None)
            for key in [k for k, _ in self._digests.items() if k[0].name == name]:
                del self._digests[key]
            for key in [k for k in self._host if k.startswith(prefix)]:
                self._host_bytes -= len(self._host.pop(key))

    def upgrade_layout(self) -> list[str]:
        """Move models of the earlier nested layout to this one (:mod:`.store_layout`)."""
        return upgrade_layout(self)

    def model(self, name: str) -> ModelEntry:
        path = self.model_path(name)
        cfg = path / "config.json"
        if not cfg.is_file():
            have = shown_names(self.list_models()) or "none"
            raise UnknownModel(
                f"unknown model {shown(name)}: no {cfg} in the weight store (models here: {have}); "
                "set spec.model.source so agents fetch it, or copy it there"
            )
        mtime = max([cfg.stat().st_mtime] + [f.stat().st_mtime for f in path.glob("*.safetensors")])
        with self._lock:
            cached = self._models.get(name)
            if cached and cached[0] == mtime:
                return cached[1]
        entry = self._scan(name, path, cfg)
        with self._lock:
            self._models[name] = (mtime, entry)
        return entry

    def _scan(self, name: str, path: Path, cfg_path: Path) -> ModelEntry:
        try:
            cfg = json.loads(confined(path, cfg_path).read_text())
        except json.JSONDecodeError as exc:
            raise StoreError(f"{cfg_path}: invalid JSON: {exc}") from None
        num_layers = config_num_layers(cfg)
        if num_layers is None:
            raise StoreError(f"{cfg_path}: needs num_hidden_layers >= 1")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise StoreError(f"model {name!r}: no *.safetensors files in {path}")
        tensors = []
        for f in files:
            start, header = read_safetensors_header(confined(path, f))
            for tname, meta in header.items():
                b, e = meta["data_offsets"]
                layer = _layer_of(tname, num_layers)
                if layer >= num_layers:
                    raise StoreError(
                        f"model {name!r}: tensor {tname} is in layer {layer} but config.json "
                        f"says num_hidden_layers={num_layers}"
                    )
                tensors.append(
                    TensorEntry(
                        tname, layer, f, start + b, e - b, meta["dtype"], tuple(meta["shape"])
                    )
                )
        tensors.sort(key=lambda t: (t.layer, _slot_order(t.name)))
        ws = cfg.get("warmserve", {})
        try:
            profile = EngineProfile(**{k: ws[k] for k in EngineProfile.__annotations__ if k in ws})
        except TypeError as exc:
            raise StoreError(f"{cfg_path}: bad warmserve profile: {exc}") from None
        return ModelEntry(
            name, path, num_layers, tuple(tensors), profile, tp_shape_from_config(cfg)
        )

    def layout(self, name: str, tp: int) -> SlotLayout:
        return SlotLayout.build(self.model(name), tp)

    # ---- host copies ---------------------------------------------------------------------
    def host_view(self, t: TensorEntry) -> memoryview:
        """The tensor's bytes in host memory, cached per file."""
        key = str(t.file)
        with self._lock:
            buf = self._host.get(key)
            if buf is not None:
                self._host.move_to_end(key)
                self.stats["host_hits"] += 1
                return buf[t.offset : t.offset + t.nbytes]
        # Checked again at the read: a link swapped after the scan cannot leave the model.
        buf = memoryview(confined(t.file.parent, t.file).read_bytes())
        with self._lock:
            self._host[key] = buf
            self._host_bytes += len(buf)
            while self._host_bytes > self.host_cache_bytes and len(self._host) > 1:
                _, old = self._host.popitem(last=False)
                self._host_bytes -= len(old)
        return buf[t.offset : t.offset + t.nbytes]

    def digests(self, layout: SlotLayout, rank: int) -> tuple[bytes, ...]:
        """blake2b-128 of each placement's shard for ``rank`` (what the engine verifies)."""
        # Files in the store are treated as immutable; a changed file (new mtime) is a new
        # ModelEntry, hence a new key.
        key = (layout.model, layout.tp, rank)
        with self._lock:
            if key in self._digests:
                return self._digests[key]
        out = []
        for p in layout.placements:
            data = p.shard_data(self.host_view(p.tensor), rank)
            out.append(hashlib.blake2b(data, digest_size=16).digest())
        with self._lock:
            self._digests[key] = tuple(out)
        return tuple(out)
