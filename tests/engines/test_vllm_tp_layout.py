"""The per-rank slot layout against vLLM's own tensor-parallel loaders (CPU): for each rank of a
group, vLLM's layers (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``/``ParallelLMHead``) built for that rank and loaded with the whole
checkpoint tensors through their ``weight_loader`` hold exactly the bytes
``warmserve.policy.tensor_parallel.rank_slice`` puts in that rank's slot, in the same order
(fused parameters: their parts' slices concatenated), and every parameter is exactly as large as
the slot reserves for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.tensor_parallel import TpShape, rank_slice, shape_problem

pytestmark = pytest.mark.vllm


@contextmanager
def _as_rank(rank: int, size: int) -> Iterator[None]:
    """vLLM's layers read their rank from the distributed state when built: answer for
    ``rank`` of ``size`` (no process group is needed to build and load them)."""
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.linear as lin
    import vllm.model_executor.layers.vocab_parallel_embedding as voc
    import vllm.model_executor.parameter as par

    patched = []
    for mod in (ps, lin, voc, par):
        for fn, value in (
            ("get_tensor_model_parallel_rank", rank),
            ("get_tensor_model_parallel_world_size", size),
        ):
            if hasattr(mod, fn):
                patched.append((mod, fn, getattr(mod, fn)))
                setattr(mod, fn, lambda v=value: v)
    try:
        yield
    finally:
        for mod, fn, orig in patched:
            setattr(mod, fn, orig)


def _slot_bytes(name: str, full: np.ndarray, tp: int, rank: int, m: TpShape) -> tuple[bytes, int]:
    raw = full.tobytes()
    sl = rank_slice(name, full.shape, full.itemsize, tp, rank, m)
    return b"".join(raw[s : s + n] for s, n in sl.ranges), sl.slot_bytes


@st.composite
def geometries(draw: st.DrawFn) -> tuple[TpShape, int]:
    tp = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    if heads % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        heads = tp * kv
    m = TpShape(
        heads,
        kv,
        draw(st.sampled_from([4, 8])),
        draw(st.sampled_from([8, 16, 24])),
        tp * draw(st.integers(1, 5)),
        draw(st.integers(1, 300)),
    )
    assert shape_problem(tp, m) is None
    return m, tp


@settings(max_examples=25, deadline=None)
@given(geometries())
def test_each_rank_slot_is_what_vllms_weight_loaders_load(geo: tuple[TpShape, int]) -> None:
    import torch
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    m, tp = geo
    g = torch.Generator().manual_seed(m.vocab)
    q_rows, kv_rows = m.heads * m.head_dim, m.kv_heads * m.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    ckpt = {
        "model.layers.0.self_attn.q_proj.weight": rand(q_rows, m.hidden),
        "model.layers.0.self_attn.k_proj.weight": rand(kv_rows, m.hidden),
        "model.layers.0.self_attn.v_proj.weight": rand(kv_rows, m.hidden),
        "model.layers.0.self_attn.o_proj.weight": rand(m.hidden, q_rows),
        "model.layers.0.mlp.gate_proj.weight": rand(m.intermediate, m.hidden),
        "model.layers.0.mlp.up_proj.weight": rand(m.intermediate, m.hidden),
        "model.layers.0.mlp.down_proj.weight": rand(m.hidden, m.intermediate),
        "model.embed_tokens.weight": rand(m.vocab, m.hidden),
        "lm_head.weight": rand(m.vocab, m.hidden),
    }
    p = "model.layers.0."
    for rank in range(tp):
        with _as_rank(rank, tp), torch.device("cpu"):
            qkv = QKVParallelLinear(m.hidden, m.head_dim, m.heads, m.kv_heads, bias=False)
            gate_up = MergedColumnParallelLinear(m.hidden, [m.intermediate] * 2, bias=False)
            o = RowParallelLinear(q_rows, m.hidden, bias=False)
            down = RowParallelLinear(m.intermediate, m.hidden, bias=False)
            emb = VocabParallelEmbedding(m.vocab, m.hidden)
            head = ParallelLMHead(m.vocab, m.hidden)
        loads = [
            (qkv.weight, [(p + "self_attn.q_proj.weight", "q"), (p + "self_attn.k_proj.weight",
                                                                 "k"),
                          (p + "self_attn.v_proj.weight", "v")]),
            (gate_up.weight, [(p + "mlp.gate_proj.weight", 0), (p + "mlp.up_proj.weight", 1)]),
            (o.weight, [(p + "self_attn.o_proj.weight", None)]),
            (down.weight, [(p + "mlp.down_proj.weight", None)]),
            (emb.weight, [("model.embed_tokens.weight", None)]),
            (head.weight, [("lm_head.weight", None)]),
        ]
        for param, parts in loads:
            param.data.fill_(float("nan"))  # nothing left over from construction passes
            want = b""
            reserved = 0
            for name, shard_id in parts:
                if shard_id is None:
                    param.weight_loader(param, ckpt[name])
                else:
                    param.weight_loader(param, ckpt[name], shard_id)
                data, slot = _slot_bytes(name, ckpt[name].numpy(), tp, rank, m)
                want += data
                reserved += slot
            got = param.detach().contiguous().numpy().tobytes()
            assert len(got) == reserved, (parts[0][0], rank, "slot reservation differs")
            assert got[: len(want)] == want, (parts[0][0], rank)
            # beyond the data only vocabulary padding, which vLLM zero-fills
            assert not any(got[len(want) :]), (parts[0][0], rank)
