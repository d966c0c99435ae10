"""Model shapes for the simulator's engine model (:class:`ModelArch`): parameter counts,
layer and head sizes, KV bytes per token, built from Llama 2's published shapes or from a
checkpoint's config; and :class:`EngineInputError`, the one error of the physics modules.
:mod:`warmserve.sim.perf` times a model of these shapes on a GPU profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from numbers import Integral

from warmserve.policy.cluster import PolicyInputError

VLLM_BLOCK_TOKENS = 16  # vLLM's default KV block size (--block-size 16)


class EngineInputError(PolicyInputError):
    """A model shape or engine argument the physics cannot use; the message names it."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise EngineInputError(message)


def is_int(value: object) -> bool:
    """An integer count (Python or NumPy), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ModelArch:
    """Shapes of a decoder-only transformer (Llama family layout: SwiGLU MLP, RMSNorm, GQA).

    ``weight_bytes`` may differ from ``params * dtype_bytes`` (e.g. the paper's Table 1 sizes or
    a quantised checkpoint); byte-based quantities use it, FLOP-based ones use ``params``.
    ``kv_bytes_per_token`` is for the whole model (all layers, K and V).
    """

    name: str
    params: int
    num_layers: int
    hidden: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int
    kv_bytes_per_token: int
    num_heads: int | None = None
    vocab: int = 32000
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        require(bool(self.name), "a model architecture needs a name")
        for key in ("params", "num_layers", "hidden", "num_kv_heads", "head_dim"):
            require(getattr(self, key) >= 1, f"arch {self.name}: {key} must be >= 1")
        for key in ("weight_bytes", "kv_bytes_per_token", "vocab", "dtype_bytes"):
            require(getattr(self, key) >= 1, f"arch {self.name}: {key} must be >= 1")
        heads = self.heads
        require(
            heads % self.num_kv_heads == 0,
            f"arch {self.name}: num_heads {heads} is not a multiple of num_kv_heads "
            f"{self.num_kv_heads}",
        )
        require(
            self.params > 2 * self.vocab * self.hidden,
            f"arch {self.name}: params {self.params} do not exceed the embedding + LM head "
            f"({2 * self.vocab * self.hidden})",
        )

    # -- derived shapes -------------------------------------------------------------------

    @property
    def heads(self) -> int:
        """Query heads (defaults to ``hidden // head_dim``, i.e. no separate attention width)."""
        return (
            self.num_heads if self.num_heads is not None else max(1, self.hidden // self.head_dim)
        )

    @property
    def attn_dim(self) -> int:
        """Width of the attention (``heads * head_dim``)."""
        return self.heads * self.head_dim

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer block (untied embedding and LM head excluded)."""
        return (self.params - 2 * self.vocab * self.hidden) / self.num_layers

    @property
    def head_params(self) -> int:
        """LM-head parameters (``vocab x hidden``): one GEMM per sequence that emits a token."""
        return self.vocab * self.hidden

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        return self.kv_bytes_per_token / self.num_layers

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def from_shapes(
        cls,
        name: str,
        *,
        num_layers: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate: int,
        vocab: int = 32000,
        head_dim: int | None = None,
        dtype_bytes: int = 2,
    ) -> ModelArch:
        """Exact parameter count of a Llama-layout model from its config.json shapes.

        Per block: q and o projections ``2 * hidden * heads * hd``, k and v
        ``2 * hidden * kv_heads * hd``, SwiGLU MLP ``3 * hidden * intermediate``, two RMSNorms;
        plus untied embedding and LM head ``2 * vocab * hidden`` and the final norm.
        """
        hd = head_dim if head_dim is not None else hidden // num_heads
        require(hd >= 1, f"arch {name}: head_dim must be >= 1")
        per_layer = (
            2 * hidden * num_heads * hd
            + 2 * hidden * num_kv_heads * hd
            + 3 * hidden * intermediate
            + 2 * hidden
        )
        params = num_layers * per_layer + 2 * vocab * hidden + hidden
        return cls(
            name=name,
            params=params,
            num_layers=num_layers,
            hidden=hidden,
            num_kv_heads=num_kv_heads,
            head_dim=hd,
            weight_bytes=params * dtype_bytes,
            kv_bytes_per_token=2 * num_layers * num_kv_heads * hd * dtype_bytes,
            num_heads=num_heads,
            vocab=vocab,
            dtype_bytes=dtype_bytes,
        )

    @classmethod
    def llama2(cls, size: str) -> ModelArch:
        """Llama 2 (the paper's model family, Table 1) from the published config.json shapes.

        7B: 32 layers, hidden 4096, 32 heads (MHA), MLP 11008 -> 6.74e9 params.
        13B: 40 layers, hidden 5120, 40 heads (MHA), MLP 13824 -> 13.02e9 params.
        70B: 80 layers, hidden 8192, 64 heads with 8 KV heads (GQA), MLP 28672 -> 68.98e9.
        All use vocab 32000 and head_dim 128 (meta-llama/Llama-2-*-hf config.json).
        """
        key = size.lower().removeprefix("llama2-").removeprefix("llama-2-")
        shapes = _LLAMA2.get(key)
        if shapes is None:
            raise EngineInputError(f"unknown Llama 2 size {size!r}; known: {sorted(_LLAMA2)}")
        return cls.from_shapes(f"llama2-{key}", **shapes)

    @classmethod
    def generic(
        cls,
        name: str,
        params: float,
        num_layers: int,
        *,
        head_dim: int = 128,
        kv_heads: int | None = None,
        vocab: int = 32000,
        dtype_bytes: int = 2,
    ) -> ModelArch:
        """A Llama-like model known only by parameter count and depth.

        Solves ``params ~= 12 * num_layers * hidden^2 + 2 * vocab * hidden`` (SwiGLU with
        intermediate = 8/3 hidden gives 12 h^2 per block) for ``hidden``, rounded to a multiple
        of ``head_dim``; MHA unless ``kv_heads`` is given.  The exact ``params`` are kept, so
        FLOPs and bytes match the stated size; only the attention width/KV size are estimated.
        """
        require(params > 0, f"arch {name}: params must be > 0")
        require(num_layers >= 1, f"arch {name}: num_layers must be >= 1")
        a, b, c = 12.0 * num_layers, 2.0 * vocab, -float(params)
        hidden_f = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        hidden = max(head_dim, round(hidden_f / head_dim) * head_dim)
        heads = hidden // head_dim
        kvh = heads if kv_heads is None else kv_heads
        require(1 <= kvh <= heads, f"arch {name}: kv_heads must be in [1, {heads}]")
        while heads % kvh:
            kvh -= 1
        vocab_eff = vocab
        if params <= 2 * vocab * hidden:  # tiny model: shrink the vocabulary assumption
            vocab_eff = max(1, int(params // (4 * hidden)))
        return cls(
            name=name,
            params=int(params),
            num_layers=num_layers,
            hidden=hidden,
            num_kv_heads=kvh,
            head_dim=head_dim,
            weight_bytes=int(params * dtype_bytes),
            kv_bytes_per_token=2 * num_layers * kvh * head_dim * dtype_bytes,
            num_heads=heads,
            vocab=vocab_eff,
            dtype_bytes=dtype_bytes,
        )

    @classmethod
    def named(cls, name: str) -> ModelArch:
        """Architecture by name: ``llama2-7b``, ``llama2-13b``, ``llama2-70b`` (see
        :func:`known_archs`)."""
        key = name.strip().lower()
        if key.startswith(("llama2-", "llama-2-")):
            return cls.llama2(key)
        raise EngineInputError(f"unknown model architecture {name!r}; known: {known_archs()}")

    def with_weight_bytes(self, weight_bytes: int) -> ModelArch:
        """Same shapes, different checkpoint size (e.g. the paper's Table 1 figure)."""
        require(weight_bytes >= 1, f"arch {self.name}: weight_bytes must be >= 1")
        return replace(self, weight_bytes=int(weight_bytes))


_LLAMA2: dict[str, dict[str, int]] = {
    "7b": {
        "num_layers": 32,
        "hidden": 4096,
        "num_heads": 32,
        "num_kv_heads": 32,
        "intermediate": 11008,
    },
    "13b": {
        "num_layers": 40,
        "hidden": 5120,
        "num_heads": 40,
        "num_kv_heads": 40,
        "intermediate": 13824,
    },
    "70b": {
        "num_layers": 80,
        "hidden": 8192,
        "num_heads": 64,
        "num_kv_heads": 8,
        "intermediate": 28672,
    },
}


def known_archs() -> list[str]:
    """Names :meth:`ModelArch.named` accepts."""
    return [f"llama2-{k}" for k in _LLAMA2]
