"""Tensor parallelism of a decoder (Llama family): which TP sizes a model admits and which bytes
of each checkpoint tensor rank ``r`` of a ``tp``-GPU group holds.

Pure and deterministic, shared by the operator (admission: a TP size the model's heads do not
divide is refused before any Activate) and the agent (the per-rank slot layout, ``store.py``).

The per-rank slice is the one vLLM's tensor-parallel layers load (``linear.py``,
``vocab_parallel_embedding.py``), so rank ``r``'s slot holds exactly its parameters and the
engine binds them as views without a copy:

* **column-parallel** (output dim 0): ``q_proj`` by query heads, ``k_proj``/``v_proj`` by KV heads
  (a KV head is replicated when ``tp`` exceeds the KV heads: rank ``r`` holds head
  ``r // (tp / kv_heads)``), ``gate_proj``/``up_proj`` by rows; their biases alike.  The fused
  parameters (``qkv_proj``, ``gate_up_proj``) are then the rank's parts, adjacent in the slot.
* **row-parallel** (input dim 1): ``o_proj``, ``down_proj``: every row's ``r``-th chunk (one
  byte range per row); their biases are replicated.
* **vocab-parallel**: ``embed_tokens``/``lm_head`` rows of the vocabulary padded to 64, ``padded /
  tp`` rows per rank; the last ranks' padding rows are reserved in the slot and never loaded
  (vLLM never reads them into an answer: logits are cut to the vocabulary).
* **replicated**: norms, anything one-dimensional that is not a column-parallel bias.

A tensor that is none of these (or whose shape the config does not explain) is ``BYTES``: a
plain byte split, fine for the simulated engine, refused for vLLM (:func:`vllm_tp_problem`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class Split(StrEnum):
    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0
    ROW = "row"  # dim 1
    VOCAB = "vocab"  # dim 0 of the padded vocabulary
    BYTES = "bytes"  # no semantic split known: contiguous byte shards


@dataclass(frozen=True, slots=True)
class TpShape:
    """The head geometry a tensor-parallel split depends on (from ``config.json``)."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int


_MAX_DIM = 2**31 - 1  # beyond any real model; the heads travel as uint32 in Describe


def _pos_int(cfg: Mapping[str, object], key: str) -> int | None:
    """A positive dimension of ``config.json``; None when absent, not an int, or absurd (a
    model's file is untrusted: one bad value must not break the node's Describe)."""
    v = cfg.get(key)
    ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= _MAX_DIM
    return v if ok else None  # type: ignore[return-value]


def tp_shape_from_config(cfg: object) -> TpShape | None:
    """The geometry of a HF ``config.json`` (dict), or None when it does not declare one."""
    if not isinstance(cfg, Mapping):
        return None
    heads = _pos_int(cfg, "num_attention_heads")
    hidden = _pos_int(cfg, "hidden_size")
    vocab = _pos_int(cfg, "vocab_size")
    inter = _pos_int(cfg, "intermediate_size")
    if heads is None or hidden is None or vocab is None or inter is None:
        return None
    kv = _pos_int(cfg, "num_key_value_heads")
    if kv is None and cfg.get("num_key_value_heads") is not None:
        return None  # declared, but not a usable count
    kv = kv or heads
    head_dim = _pos_int(cfg, "head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        return None
    return TpShape(heads, kv, head_dim, hidden, inter, vocab)


def heads_problem(tp: int, heads: int, kv_heads: int) -> str | None:
    """Why ``tp`` ranks cannot split these heads (vLLM's own rules), None when they can."""
    if tp < 1:
        return f"tensor-parallel size must be >= 1, got {tp}"
    if tp == 1:
        return None
    if heads < 1 or heads % tp:
        return f"tensorParallel={tp} does not divide the model's {heads} attention heads"
    if kv_heads >= tp and kv_heads % tp:
        return f"tensorParallel={tp} does not divide the model's {kv_heads} KV heads"
    if kv_heads < tp and (kv_heads < 1 or tp % kv_heads):
        return (
            f"tensorParallel={tp} is neither a divisor nor a multiple of the model's "
            f"{kv_heads} KV heads"
        )
    return None


def shape_problem(tp: int, shape: TpShape) -> str | None:
    """:func:`heads_problem` plus the MLP and vocabulary splits vLLM asserts."""
    why = heads_problem(tp, shape.heads, shape.kv_heads)
    if why or tp == 1:
        return why
    if shape.intermediate % tp:
        return f"tensorParallel={tp} does not divide the MLP's {shape.intermediate} rows"
    padded = _padded_vocab(shape.vocab)
    if padded % tp:
        return f"tensorParallel={tp} does not divide the padded vocabulary of {padded} rows"
    return None


def _padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def _leaf(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module.rpartition(".")[2], leaf


_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}
_VOCAB = {"embed_tokens", "lm_head"}


def tensor_split(name: str, shape: tuple[int, ...], tp: int, model: TpShape | None) -> Split:
    """How ``tp`` ranks split checkpoint tensor ``name`` of ``shape`` (see module docstring)."""
    if tp == 1:
        return Split.REPLICATED
    if model is None or shape_problem(tp, model):
        return Split.BYTES
    module, leaf = _leaf(name)
    rows = {
        "q_proj": model.heads * model.head_dim,
        "k_proj": model.kv_heads * model.head_dim,
        "v_proj": model.kv_heads * model.head_dim,
        "gate_proj": model.intermediate,
        "up_proj": model.intermediate,
    }
    dims = {"weight": 2, "bias": 1}.get(leaf)
    if module in _COLUMN and len(shape) == dims and shape[0] == rows[module]:
        return Split.COLUMN
    if module in _ROW and leaf == "weight" and len(shape) == 2 and shape[1] % tp == 0:
        return Split.ROW
    if module in _ROW and leaf == "bias" and len(shape) == 1:
        return Split.REPLICATED
    if module in _VOCAB and leaf == "weight" and len(shape) == 2 and shape[0] == model.vocab:
        return Split.VOCAB
    if "norm" in module and len(shape) == 1:
        return Split.REPLICATED
    return Split.BYTES


@dataclass(frozen=True, slots=True)
class RankSlice:
    """Rank ``r``'s part of a tensor: ``ranges`` are ``(start, length)`` byte ranges of the
    tensor's row-major data, concatenated in the slot; ``slot_bytes`` (the same on every rank)
    is what the slot reserves for it (more than the ranges only for vocabulary padding)."""

    ranges: tuple[tuple[int, int], ...]
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.ranges)


def rank_slice(
    name: str,
    shape: tuple[int, ...],
    itemsize: int,
    tp: int,
    rank: int,
    model: TpShape | None,
) -> RankSlice:
    """Rank ``rank``'s bytes of tensor ``name`` (``shape``, ``itemsize`` bytes per element) in a
    ``tp``-GPU group (see module docstring)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside a group of {tp}")
    total = math.prod(shape) * itemsize
    split = tensor_split(name, shape, tp, model)
    if split == Split.REPLICATED:
        return RankSlice(((0, total),), total)
    if split == Split.BYTES:
        shard = math.ceil(total / tp)
        start = min(rank * shard, total)
        return RankSlice(((start, min(shard, total - start)),), shard)
    assert model is not None
    row = (math.prod(shape[1:]) if len(shape) > 1 else 1) * itemsize
    if split == Split.VOCAB:
        per = _padded_vocab(model.vocab) // tp
        first = min(rank * per, model.vocab)
        last = min(first + per, model.vocab)
        ranges = ((first * row, (last - first) * row),) if last > first else ()
        return RankSlice(ranges, per * row)
    if split == Split.COLUMN:
        module, _ = _leaf(name)
        if module in ("k_proj", "v_proj"):
            heads = max(1, model.kv_heads // tp)
            head = rank * heads if model.kv_heads >= tp else rank // (tp // model.kv_heads)
            n = heads * model.head_dim
            first = head * model.head_dim
        else:
            n = shape[0] // tp
            first = rank * n
        return RankSlice(((first * row, n * row),), n * row)
    # ROW: every row's rank-th chunk of the input dimension
    chunk = shape[1] // tp * itemsize
    full = shape[1] * itemsize
    ranges = tuple((i * full + rank * chunk, chunk) for i in range(shape[0]))
    return RankSlice(ranges, chunk * shape[0])
