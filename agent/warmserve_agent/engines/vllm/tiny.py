"""A tiny random-weight Llama and a tiny tokenizer, made offline (tests, benchmarks, demos).

No hub access: ``transformers`` builds the model from a ``LlamaConfig`` with random weights and
saves it as safetensors; ``tokenizers`` trains a small byte-level BPE on a built-in text and it
is saved beside the weights with a chat template, so ``/v1/completions`` and
``/v1/chat/completions`` work with text.  Greedy decoding of such a model is deterministic for
fixed weights, which is what the equality tests need.

    python -m warmserve_agent.engines.vllm.tiny DIR [--layers 2] [--hidden 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_CORPUS = (
    "warm serve predicts the load of every model and prewarms idle gpus with the first layers "
    "of several models so that a scale up becomes a prewarm hit instead of a cold start. "
    "the agent keeps weights resident in prewarm slots and hands a slot to a pooled engine. "
    "during a grace period the draining instance lends free kv cache pages to the next model. "
    "hello world, the quick brown fox jumps over the lazy dog; 0 1 2 3 4 5 6 7 8 9. "
    "User: what is a prewarm slot? Assistant: a range of gpu memory holding a model's weights."
)

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tokenizer(out: Path, vocab_size: int) -> int:
    """Train and save a byte-level BPE tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def make_tiny_llama(
    out: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    intermediate: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    max_positions: int = 512,
) -> Path:
    """Write config.json, model.safetensors and a tokenizer to ``out``; returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_tok = make_tokenizer(out, vocab)
    if n_tok > vocab:
        raise ValueError(f"tokenizer has {n_tok} tokens, more than the model's {vocab}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    # transformers writes its own dtype key; make sure vLLM's --dtype auto sees the saved one
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["torch_dtype"] = dtype
    cfg_path.write_text(json.dumps(data, indent=1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_tiny_llama(a.out, layers=a.layers, hidden=a.hidden, seed=a.seed))


if __name__ == "__main__":
    main()
