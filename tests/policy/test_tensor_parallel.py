"""The tensor-parallel split of a Llama-family checkpoint (``warmserve.policy.tensor_parallel``):
which sizes a model admits, and that the ranks' slices of every tensor put back together are the
tensor (vLLM's own loaders are compared in tests/engines/test_vllm_tp_layout.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.tensor_parallel import (
    Split,
    TpShape,
    heads_problem,
    rank_slice,
    shape_problem,
    tensor_split,
    tp_shape_from_config,
)


def test_heads_problem_follows_vllms_rules() -> None:
    assert heads_problem(1, 9, 3) is None
    assert heads_problem(3, 9, 3) is None
    assert "9 attention heads" in (heads_problem(2, 9, 3) or "")  # SmolLM2
    assert heads_problem(8, 64, 8) is None  # Llama-2 70B
    assert heads_problem(16, 64, 8) is None  # a KV head on two ranks
    assert "neither a divisor nor a multiple" in (heads_problem(8, 24, 3) or "")
    assert "6 KV heads" in (heads_problem(4, 8, 6) or "")
    assert heads_problem(0, 8, 8) is not None


def test_shape_from_config() -> None:
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    assert tp_shape_from_config(cfg) is None  # no MLP or vocabulary
    cfg |= {"intermediate_size": 256, "vocab_size": 500}
    assert tp_shape_from_config(cfg) == TpShape(4, 2, 32, 128, 256, 500)
    assert tp_shape_from_config({**cfg, "head_dim": 16}) == TpShape(4, 2, 16, 128, 256, 500)
    assert tp_shape_from_config({**cfg, "num_attention_heads": True}) is None
    assert tp_shape_from_config([1]) is None
    # an absurd value (an untrusted file) is not a geometry: it would not fit Describe's uint32
    assert tp_shape_from_config({**cfg, "num_attention_heads": 2**40}) is None
    assert tp_shape_from_config({**cfg, "vocab_size": 2**32}) is None
    assert tp_shape_from_config({**cfg, "num_key_value_heads": 2**33}) is None
    assert tp_shape_from_config({**cfg, "num_key_value_heads": "2"}) is None
    shape = TpShape(4, 2, 32, 128, 250, 500)
    assert "250" in (shape_problem(4, shape) or "")


def _names(layer: int = 0) -> dict[str, str]:
    p = f"model.layers.{layer}."
    return {
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
        "norm": p + "input_layernorm.weight",
        "embed": "model.embed_tokens.weight",
        "head": "lm_head.weight",
    }


def _shapes(m: TpShape) -> dict[str, tuple[int, ...]]:
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "q": (q, m.hidden),
        "k": (kv, m.hidden),
        "v": (kv, m.hidden),
        "o": (m.hidden, q),
        "gate": (m.intermediate, m.hidden),
        "up": (m.intermediate, m.hidden),
        "down": (m.hidden, m.intermediate),
        "norm": (m.hidden,),
        "embed": (m.vocab, m.hidden),
        "head": (m.vocab, m.hidden),
    }


@st.composite
def geometries(draw: st.DrawFn) -> tuple[TpShape, int]:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.integers(1, 4))
    if heads % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        heads = tp * kv  # keep it splittable
    head_dim = draw(st.sampled_from([2, 4, 8]))
    inter = tp * draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 200))
    return TpShape(heads, kv, head_dim, draw(st.integers(1, 24)), inter, vocab), tp


def _take(full: np.ndarray, name: str, tp: int, rank: int, m: TpShape) -> np.ndarray:
    raw = full.tobytes()
    sl = rank_slice(name, full.shape, full.itemsize, tp, rank, m)
    data = b"".join(raw[s : s + n] for s, n in sl.ranges)
    assert sl.nbytes == len(data) <= sl.slot_bytes
    return np.frombuffer(data, dtype=full.dtype)


@settings(max_examples=150, deadline=None)
@given(geometries())
def test_the_ranks_slices_put_back_together_are_the_tensor(geo: tuple[TpShape, int]) -> None:
    m, tp = geo
    assert shape_problem(tp, m) is None
    names, shapes = _names(), _shapes(m)
    rng = np.random.default_rng(0)
    for key, shape in shapes.items():
        full = rng.standard_normal(shape).astype(np.float32)
        name = names[key]
        split = tensor_split(name, shape, tp, m)
        parts = [_take(full, name, tp, r, m) for r in range(tp)]
        slots = {rank_slice(name, shape, 4, tp, r, m).slot_bytes for r in range(tp)}
        assert len(slots) == 1, f"{key}: every rank reserves the same slot bytes"
        if tp == 1 or split == Split.REPLICATED:
            assert (split == Split.REPLICATED and key in ("norm",)) or tp == 1
            for p in parts:
                np.testing.assert_array_equal(p.reshape(shape), full)
        elif key in ("k", "v"):
            per = max(1, m.kv_heads // tp) * m.head_dim
            rep = max(1, tp // m.kv_heads)
            for r, p in enumerate(parts):
                head = (r // rep) * per
                np.testing.assert_array_equal(p.reshape(per, m.hidden), full[head : head + per])
        elif split == Split.COLUMN:
            np.testing.assert_array_equal(np.concatenate(parts).reshape(shape), full)
        elif split == Split.ROW:
            back = np.concatenate([p.reshape(shape[0], -1) for p in parts], axis=1)
            np.testing.assert_array_equal(back, full)
        else:
            assert split == Split.VOCAB, (key, split)
            np.testing.assert_array_equal(np.concatenate(parts).reshape(shape), full)
            per = slots.pop() // (m.hidden * 4)
            assert per * tp >= m.vocab and per * tp % 64 == 0
        assert key != "norm" or split == Split.REPLICATED


def test_unknown_tensors_and_shapes_are_split_by_bytes() -> None:
    m = TpShape(4, 2, 8, 32, 64, 128)
    assert tensor_split("model.layers.0.self_attn.qkv_proj.weight", (64, 32), 2, m) == Split.BYTES
    assert tensor_split("model.layers.0.self_attn.q_proj.weight", (31, 32), 2, m) == Split.BYTES
    assert tensor_split("model.layers.0.self_attn.q_proj.weight", (32, 32), 3, m) == Split.BYTES
    assert tensor_split("model.layers.0.self_attn.q_proj.weight", (32, 32), 2, None) == Split.BYTES
    sl = [rank_slice("x", (10,), 1, 3, r, None) for r in range(3)]
    assert [s.ranges for s in sl] == [((0, 4),), ((4, 4),), ((8, 2),)]
    with pytest.raises(ValueError):
        rank_slice("x", (10,), 1, 3, 3, None)
