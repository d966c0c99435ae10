"""Convert a GGUF checkpoint into a Hugging Face model directory (bf16 safetensors, config,
tokenizer, chat template), with transformers' own GGUF reader.

Runs as ``python -m warmserve.realmodel.convert SRC.gguf OUT_DIR`` in an interpreter that has
torch, transformers, gguf and accelerate (the vLLM venv from hack/vllm/setup.sh, which installs
the last two as an add-on).  Its own process, so the ~1 GB the conversion holds is returned at
once.  Contract with the caller (warmserve.realmodel.cache), for any converter module: files in
OUT_DIR, and on stdout a line ``WARMSERVE-CONVERTED {json}`` with the versions that did the
conversion; ``--check`` exits 0 when the interpreter can convert; exit status 3 with one line on
stderr when a module is missing.  Only the standard library is imported at
module level.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

NEEDS = ("torch", "transformers", "gguf", "accelerate", "safetensors")
RESULT_PREFIX = "WARMSERVE-CONVERTED "
EXIT_MISSING = 3


def versions() -> dict[str, str]:
    """The installed distributions' versions (not every module has ``__version__``)."""
    out = {"python": sys.version.split()[0]}
    for name in NEEDS:
        out[name] = importlib.metadata.version(name)
    return out


def convert(src: Path, out: Path) -> dict[str, str]:
    """Dequantise ``src`` to bf16 and save it with its tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.bfloat16
    )
    # The dequantised weights are plain tensors now; without this save_pretrained refuses
    # ("quantized with GGUF, not serializable") and would write a quantization_config that
    # makes loaders look for GGUF again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return versions()


def main(argv: list[str]) -> int:
    if argv not in (["--check"],) and len(argv) != 2:
        print(
            "usage: python -m warmserve.realmodel.convert (SRC.gguf OUT_DIR | --check)",
            file=sys.stderr,
        )
        return 2
    missing = [n for n in NEEDS if importlib.util.find_spec(n) is None]
    if missing:
        print(
            f"{sys.executable} lacks {', '.join(missing)} (converting needs "
            f"{', '.join(NEEDS)}: use the python hack/vllm/setup.sh prints, which has them)",
            file=sys.stderr,
        )
        return EXIT_MISSING
    if argv == ["--check"]:
        return 0
    # Never reach a model hub: everything comes from the GGUF file.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result = convert(Path(argv[0]), Path(argv[1]))
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
