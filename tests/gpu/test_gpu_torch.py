"""torch on VMM slot memory (device only: needs torch, transformers and a GPU).

* A slot range wrapped as a CUDA tensor computes exactly what an ordinary tensor computes, and
  stays usable after its pages are unmapped and mapped again at the same address.
* A small random-weight Llama whose parameters are views into a slot (loaded by the agent's
  loader) gives logits bit-identical to the same checkpoint loaded by ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmserve_agent.backends.cuda import CudaBackend
from warmserve_agent.loader import load_layers
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.slot_tensors import bind_module
from warmserve_agent.store import WeightStore

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_torch]

P = 2 * 1024**2


@pytest.fixture
def torch_cuda() -> Any:
    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"
    torch.cuda.init()  # the primary context torch uses is the one the backend retains
    return torch


def test_slot_range_as_a_tensor_computes_like_an_ordinary_one(driver: Any, torch_cuda: Any) -> None:
    torch = torch_cuda
    mm = MemoryManager(CudaBackend(driver=driver, page_bytes=P, reserve_bytes=0))
    mm.add_gpu(0, 16 * P)
    try:
        mm.create_slot("s", [0])
        mm.map_range("s", 0, 4)
        va = mm.va_base("s", 0)
        base = mm.backend.torch_view(0, va, 4 * P)
        a = base[: 2 * P].view(torch.float32).view(1024, 512)
        b = base[2 * P :].view(torch.float32).view(512, 1024)
        a.normal_()
        b.normal_()
        ref = a.clone() @ b.clone()
        assert torch.equal(a @ b, ref)
        torch.cuda.synchronize()
        mm.unmap_range("s", 0, 4)
        mm.map_range("s", 0, 4)  # same virtual range, pages mapped again
        base.fill_(7)
        torch.cuda.synchronize()
        assert mm.read("s", 0, 0, 4 * P) == bytes([7]) * (4 * P)
        del a, b, base
        torch.cuda.synchronize()
    finally:
        mm.close()


def test_llama_in_a_slot_matches_an_ordinary_load(
    driver: Any, torch_cuda: Any, tmp_path: Path
) -> None:
    torch = torch_cuda
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    ids = torch.tensor([[1, 17, 42, 99, 5, 300]], device="cuda")
    ref_model = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    del ref_model

    store = WeightStore(tmp_path)
    layout = store.layout("llama", 1)
    mm = MemoryManager(CudaBackend(driver=driver, page_bytes=P, reserve_bytes=0))
    mm.add_gpu(0, (pages_for(layout.total_bytes) + 4) * P)
    try:
        mm.create_slot("s", [0])
        load_layers(mm, store, "s", layout, [0], 0, layout.model.num_layers)
        with init_empty_weights():
            model = LlamaForCausalLM(cfg)
        base = mm.backend.torch_view(0, mm.va_base("s", 0), layout.total_bytes)
        bound = bind_module(model, layout, base)
        assert bound == layout.model.weight_bytes
        model.to("cuda")  # buffers (rotary frequencies); parameters already live in the slot
        assert all(p.data_ptr() >= mm.va_base("s", 0) for p in model.parameters())
        with torch.no_grad():
            out = model(ids).logits.float()
        assert torch.equal(out, ref), (out - ref).abs().max()
        del model, base, out
        torch.cuda.synchronize()
    finally:
        mm.close()
