"""Where the ranks of a tensor-parallel vLLM engine live: one pooled worker process per GPU.

An agent with engines in its own process (``use_workers=False``; ``python -m
warmserve_agent.testing`` without ``--workers``) has no process to host rank 1 of a TP=2 group.
It refuses a vllm ``Prewarm``/``Activate`` on a multi-GPU group with FAILED_PRECONDITION before
anything changes, as it refuses a split the heads cannot make (before, the Prewarm was accepted and
rank 0's engine failed a minute later waiting for a rank that never came)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
from safetensors.numpy import save_file
from warmserve_agent.testing import AgentThread

from tests.agent.agent_support import cfg_for
from tests.agent.test_agent_grpc import code_of
from warmserve.api.agent.client import SyncAgentClient

LLAMA = "llama-tp"


def _write_llama(root: Path, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> None:
    """A Llama-shaped checkpoint whose every tensor splits 2 ways as vLLM's layers load it."""
    rng = np.random.default_rng(0)
    hd, inter, vocab, layers = hidden // heads, 2 * hidden, 128, 2

    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    tensors = {
        "model.embed_tokens.weight": t(vocab, hidden),
        "model.norm.weight": t(hidden),
        "lm_head.weight": t(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": t(heads * hd, hidden),
            p + "self_attn.k_proj.weight": t(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": t(kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": t(hidden, heads * hd),
            p + "mlp.gate_proj.weight": t(inter, hidden),
            p + "mlp.up_proj.weight": t(inter, hidden),
            p + "mlp.down_proj.weight": t(hidden, inter),
            p + "input_layernorm.weight": t(hidden),
            p + "post_attention_layernorm.weight": t(hidden),
        }
    d = root / LLAMA
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
    }
    (d / "config.json").write_text(json.dumps(cfg))


def test_in_process_engines_refuse_a_vllm_tensor_parallel_group(tmp_path: Path) -> None:
    root = tmp_path / "models"
    _write_llama(root)
    cfg = cfg_for(tmp_path, root, engines=("vllm", "simulated"))
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        for call in (
            lambda: c.prewarm_wait(LLAMA, [0, 1], engine="vllm"),
            lambda: c.activate(LLAMA, [0, 1], engine="vllm"),
        ):
            code, msg = code_of(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, msg
            assert "tensorParallel=2" in msg and "worker process per GPU" in msg, msg
        d = c.describe()
        assert not d.slots and not d.instances
        # the split itself is fine (the heads divide): the simulated engine, whose ranks need no
        # process of their own, is accepted on the same group
        c.prewarm_wait(LLAMA, [0, 1], engine="simulated")
        (slot,) = c.describe().slots
        assert list(slot.gpus) == [0, 1] and slot.model == LLAMA
