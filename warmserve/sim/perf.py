"""Physics of one serving instance: model shapes, a roofline engine model and start-up costs.

(The simulator's *performance model* of a serving engine, hence ``perf``; called ``engine.py``
before issue 11, when "engine" also meant the agent's serving processes and ``spec.engine``.)

The simulator asks this module four questions about a model running with tensor parallelism
``tp`` on a GPU type (:class:`warmserve.sim.hardware.GpuProfile`):

* how long a prefill takes (:meth:`EngineModel.prefill_s`) and how long one continuous-batching
  decode step takes (:meth:`EngineModel.decode_step_s`);
* how many KV-cache tokens fit (:meth:`EngineModel.kv_capacity_tokens`);
* how long loading weights from host memory takes (:meth:`EngineModel.load_s`) and how long the
  software start-up stages take (:meth:`EngineModel.startup_s`);
* when the first token appears if only the first ``r`` layers are resident and the rest streams
  in behind the forward pass (:meth:`EngineModel.first_token_after_start_s`).

Roofline (per transformer layer, per GPU of the TP group; identical layers, so the model is
``num_layers`` times one layer plus the LM head)::

    t_layer = max(FLOPs / (bf16_flops * prefill_efficiency),
                  bytes / (hbm_bw * decode_efficiency))  +  2 * t_allreduce(tokens)

FLOPs are ``2 * layer_params * tokens / tp`` (the GEMMs) plus attention
(``2 * n^2 * d`` per causal prefill of ``n`` tokens, ``4 * context * d`` per decoded token, with
``d = heads * head_dim``, split over TP).  Bytes are the layer's weight shard plus the KV cache
read (decode) or written (prefill).  Two all-reduces per layer (after attention and after the
MLP) move ``tokens * hidden * dtype`` bytes over NVLink with a ring:
``2 (tp-1)/tp * bytes / gpu_to_gpu_bw + allreduce_latency_s``.  Each forward pass also pays a
fixed ``step_overhead_s`` (kernel launches, scheduling, sampling).

The efficiency factors and every constant come from the profile YAML, each with a citation;
nothing here is fitted to the WarmServe paper's results.  Byte accounting for partial residency
matches :class:`warmserve.policy.cluster.ModelSpec` (weights split evenly over layers, embedding
and LM head amortised into them), so the policy's memory view and the simulator's timing agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from numbers import Integral

from warmserve.policy.cluster import PolicyInputError
from warmserve.sim.hardware import GpuProfile

VLLM_BLOCK_TOKENS = 16  # vLLM's default KV block size (--block-size 16)


class EngineInputError(PolicyInputError):
    """A model shape or engine argument the physics cannot use; the message names it."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise EngineInputError(message)


def _is_int(value: object) -> bool:
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
        _require(bool(self.name), "a model architecture needs a name")
        for key in ("params", "num_layers", "hidden", "num_kv_heads", "head_dim"):
            _require(getattr(self, key) >= 1, f"arch {self.name}: {key} must be >= 1")
        for key in ("weight_bytes", "kv_bytes_per_token", "vocab", "dtype_bytes"):
            _require(getattr(self, key) >= 1, f"arch {self.name}: {key} must be >= 1")
        heads = self.heads
        _require(
            heads % self.num_kv_heads == 0,
            f"arch {self.name}: num_heads {heads} is not a multiple of num_kv_heads "
            f"{self.num_kv_heads}",
        )
        _require(
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
        _require(hd >= 1, f"arch {name}: head_dim must be >= 1")
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
        _require(params > 0, f"arch {name}: params must be > 0")
        _require(num_layers >= 1, f"arch {name}: num_layers must be >= 1")
        a, b, c = 12.0 * num_layers, 2.0 * vocab, -float(params)
        hidden_f = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        hidden = max(head_dim, round(hidden_f / head_dim) * head_dim)
        heads = hidden // head_dim
        kvh = heads if kv_heads is None else kv_heads
        _require(1 <= kvh <= heads, f"arch {name}: kv_heads must be in [1, {heads}]")
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
        _require(weight_bytes >= 1, f"arch {self.name}: weight_bytes must be >= 1")
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


@dataclass(frozen=True, slots=True)
class EngineModel:
    """Roofline timing of one instance of ``arch`` on ``tp`` GPUs of type ``profile``.

    Pure and deterministic; every method validates its arguments and raises
    :class:`EngineInputError` naming the bad one.
    """

    profile: GpuProfile
    arch: ModelArch
    tp: int = 1

    def __post_init__(self) -> None:
        _require(self.tp >= 1, f"{self.arch.name}: tp must be >= 1, got {self.tp}")
        _require(
            self.tp <= self.profile.gpus_per_node,
            f"{self.arch.name}: tp {self.tp} exceeds the {self.profile.gpus_per_node} GPUs of a "
            f"{self.profile.name} node (TP stays inside a node)",
        )

    # -- memory ---------------------------------------------------------------------------

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.arch.weight_bytes / self.tp

    @property
    def layer_bytes_per_gpu(self) -> float:
        """Weight bytes of one layer's shard (embedding and LM head amortised, as ModelSpec)."""
        return self.weight_bytes_per_gpu / self.arch.num_layers

    @property
    def _bytes_per_param(self) -> float:
        """Checkpoint bytes per parameter (``weight_bytes`` may be a Table 1 or quantised size)."""
        return self.arch.weight_bytes / self.arch.params

    @property
    def block_read_bytes_per_gpu(self) -> float:
        """Bytes one forward pass streams from HBM for one transformer block's weight shard.

        Unlike :attr:`layer_bytes_per_gpu` (a load/residency unit) this excludes the embedding
        (a row lookup) and the LM head (timed separately), so a decode step reads each weight
        exactly once.
        """
        return self._bytes_per_param * self.arch.layer_params / self.tp

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """KV bytes one token costs on each GPU; KV heads are replicated when tp > kv_heads."""
        return self.arch.kv_bytes_per_token / min(self.tp, self.arch.num_kv_heads)

    def free_kv_bytes_per_gpu(self, resident_bytes_per_gpu: float | None = None) -> int:
        """vLLM's KV budget: usable bytes (HBM x utilization - reserve) minus the weight shard.

        ``resident_bytes_per_gpu`` overrides the weight shard (e.g. other models colocated).
        Never negative; 0 means the model does not fit.
        """
        used = (
            self.weight_bytes_per_gpu if resident_bytes_per_gpu is None else resident_bytes_per_gpu
        )
        _require(used >= 0, f"{self.arch.name}: resident_bytes_per_gpu must be >= 0")
        return max(0, int(self.profile.usable_bytes - used))

    def kv_capacity_tokens(self, free_bytes_per_gpu: float | None = None) -> int:
        """KV-cache tokens that fit in ``free_bytes_per_gpu`` (default: the vLLM budget),
        rounded down to whole vLLM blocks of 16 tokens."""
        free = self.free_kv_bytes_per_gpu() if free_bytes_per_gpu is None else free_bytes_per_gpu
        _require(free >= 0, f"{self.arch.name}: free_bytes_per_gpu must be >= 0, got {free}")
        blocks = int(free // (self.kv_bytes_per_token_per_gpu * VLLM_BLOCK_TOKENS))
        return blocks * VLLM_BLOCK_TOKENS

    # -- compute --------------------------------------------------------------------------

    def allreduce_s(self, tokens: int) -> float:
        """One ring all-reduce of ``tokens x hidden`` activations over the TP group (0 at tp=1)."""
        if self.tp == 1:
            return 0.0
        nbytes = tokens * self.arch.hidden * self.arch.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * nbytes / self.profile.gpu_to_gpu_bw
        return ring + self.profile.allreduce_latency_s

    def _roofline(self, flops: float, nbytes: float) -> float:
        p = self.profile
        return max(
            flops / (p.bf16_flops * p.prefill_efficiency),
            nbytes / (p.hbm_bw * p.decode_efficiency),
        )

    def _layer_s(self, tokens: int, attn_flops: float, kv_bytes: float) -> float:
        """One transformer block on one GPU: GEMMs+attention, weights+KV bytes, 2 all-reduces."""
        flops = (2.0 * self.arch.layer_params * tokens + attn_flops) / self.tp
        nbytes = self.block_read_bytes_per_gpu + kv_bytes / min(self.tp, self.arch.num_kv_heads)
        return self._roofline(flops, nbytes) + 2 * self.allreduce_s(tokens)

    def _head_s(self, seqs: int) -> float:
        """LM head for the ``seqs`` positions that emit a token (vLLM computes only those),
        plus the fixed per-forward-pass overhead (``step_overhead_s``): both are paid once per
        pass, after the last block."""
        flops = 2.0 * self.arch.head_params * seqs / self.tp
        nbytes = self._bytes_per_param * self.arch.head_params / self.tp
        return self._roofline(flops, nbytes) + self.profile.step_overhead_s

    @staticmethod
    def _lengths(prompt_tokens: int | Sequence[int]) -> list[int]:
        if isinstance(prompt_tokens, Integral):
            lens = [prompt_tokens]
        elif isinstance(prompt_tokens, Sequence) or hasattr(prompt_tokens, "__array__"):
            lens = list(prompt_tokens)
        else:
            raise EngineInputError(f"prompt_tokens must be integers >= 1, got {prompt_tokens!r}")
        _require(len(lens) > 0, "prompt_tokens must name at least one prompt")
        for n in lens:
            _require(
                _is_int(n) and n >= 1,
                f"prompt_tokens must be integers >= 1, got {n!r}",
            )
        return [int(n) for n in lens]

    def layer_compute_s(self, prompt_tokens: int | Sequence[int]) -> float:
        """Prefill time of one transformer block for the given prompt(s) (streaming unit)."""
        lens = self._lengths(prompt_tokens)
        tokens = sum(lens)
        attn = sum(2.0 * n * n * self.arch.attn_dim for n in lens)  # causal QK^T + AV
        kv_write = tokens * self.arch.kv_bytes_per_token_per_layer
        return self._layer_s(tokens, attn, kv_write)

    def prefill_s(self, prompt_tokens: int | Sequence[int]) -> float:
        """Time to prefill one prompt (int) or a batch of prompts run as one forward pass."""
        lens = self._lengths(prompt_tokens)
        return self.arch.num_layers * self.layer_compute_s(lens) + self._head_s(len(lens))

    def prefill_batch_s(self, num_prompts: int, prompt_tokens: int) -> float:
        """:meth:`prefill_s` of ``num_prompts`` equal prompts in one pass, in O(1) (planners)."""
        _require(num_prompts >= 1, f"num_prompts must be >= 1, got {num_prompts!r}")
        _require(prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {prompt_tokens!r}")
        tokens = num_prompts * prompt_tokens
        attn = num_prompts * 2.0 * prompt_tokens * prompt_tokens * self.arch.attn_dim
        kv_write = tokens * self.arch.kv_bytes_per_token_per_layer
        layer = self._layer_s(tokens, attn, kv_write)
        return self.arch.num_layers * layer + self._head_s(num_prompts)

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """One decode iteration for ``batch`` sequences holding ``kv_tokens`` context in total.

        Each layer reads its weight shard once and every sequence's K/V
        (``kv_tokens x kv_bytes_per_token_per_layer``); attention FLOPs are ``4 x kv_tokens x d``.
        """
        _require(
            _is_int(batch) and batch >= 1,
            f"decode batch must be an integer >= 1: {batch!r}",
        )
        _require(kv_tokens >= 0, f"decode kv_tokens must be >= 0, got {kv_tokens!r}")
        attn = 4.0 * kv_tokens * self.arch.attn_dim
        kv_read = kv_tokens * self.arch.kv_bytes_per_token_per_layer
        per_layer = self._layer_s(batch, attn, kv_read)
        return self.arch.num_layers * per_layer + self._head_s(batch)

    # -- loading and start-up -------------------------------------------------------------

    @property
    def layer_load_s(self) -> float:
        """Host->GPU copy of one layer's shard; the TP GPUs copy in parallel over own links."""
        return self.layer_bytes_per_gpu / self.profile.host_to_gpu_bw

    def load_s(self, layers: int | None = None) -> float:
        """Time to copy the first ``layers`` layers (default: all weights) from host memory."""
        n = self.arch.num_layers if layers is None else layers
        _require(
            _is_int(n) and 0 <= n <= self.arch.num_layers,
            f"{self.arch.name}: layers must be an integer in [0, {self.arch.num_layers}]: {n!r}",
        )
        return n * self.layer_load_s

    def startup_s(
        self,
        pooled_process: bool = False,
        engine_ready: bool = False,
        comm_group_ready: bool = False,
    ) -> float:
        """Fixed start-up stages not already prewarmed (§7.2 Figure 8), weight loading excluded.

        ``pooled_process``: a worker process with the stack imported and a CUDA context exists
        (the paper's "+Device" and the import half of "+Engine"); ``engine_ready``: the engine is
        initialised ("+Engine"); ``comm_group_ready``: the NCCL group exists ("+CommGroup",
        irrelevant at tp=1).  ``activation_s`` (binding the engine to resident weights) is always
        paid.
        """
        s = self.profile.startup
        total = s.activation_s
        if not pooled_process:
            total += s.process_start_s + s.import_s + s.device_init_s
        if not engine_ready:
            total += s.engine_init_s
        if self.tp > 1 and not comm_group_ready:
            total += s.comm_group_s
        return total

    def cold_start_s(self) -> float:
        """A start from nothing: every stage plus loading all weights, sequentially (vLLM loads
        weights before profiling memory, so nothing overlaps; vllm-integration.md §2.5)."""
        return self.startup_s() + self.load_s()

    def first_token_after_start_s(
        self,
        resident_layers: int,
        prompt_tokens: int | Sequence[int],
        *,
        head_start_s: float = 0.0,
        streaming: bool = True,
    ) -> float:
        """Seconds from activation to the first token when ``resident_layers`` are on the GPU.

        The missing layers ``r..L-1`` are copied in order starting ``head_start_s`` before the
        forward pass begins (e.g. during activation).  Layer ``i >= r`` arrives at
        ``a_i = max(0, (i - r + 1) * l - h)`` (``l`` = per-layer load time); layer ``i`` starts
        computing at ``max(finish_{i-1}, a_i)`` and takes ``c`` (one block of this prefill).
        Unrolling that recurrence, the forward pass ends at ``max_i (a_i + (L - i) c)``; the
        argument is linear in ``i`` over the streamed range, so the maximum sits at an end:

            T = max(L c,  l - h + (L - r) c,  (L - r) l - h + c)   (+ LM head)

        i.e. compute-bound, the first missing layer, or the last layer's arrival.
        ``streaming=False`` models an engine that waits for all weights (stock vLLM):
        ``max(0, (L - r) l - h) + L c``.
        """
        L = self.arch.num_layers
        r = resident_layers
        _require(
            _is_int(r) and 0 <= r <= L,
            f"{self.arch.name}: resident_layers must be an integer in [0, {L}], got {r!r}",
        )
        _require(head_start_s >= 0, f"head_start_s must be >= 0, got {head_start_s!r}")
        lens = self._lengths(prompt_tokens)
        c = self.layer_compute_s(lens)
        head = self._head_s(len(lens))
        ell, h, missing = self.layer_load_s, head_start_s, L - r
        if missing == 0:
            return L * c + head
        if not streaming:
            return max(0.0, missing * ell - h) + L * c + head
        forward = max(L * c, ell - h + missing * c, missing * ell - h + c)
        return forward + head

    def min_resident_layers(
        self,
        prompt_tokens: int | Sequence[int],
        *,
        head_start_s: float = 0.0,
        tolerance: float = 0.0,
    ) -> int:
        """Fewest leading layers to keep resident so streaming never blocks the forward pass.

        The paper's offline profiling pass (§4): the smallest ``r`` whose first-token time is
        within ``(1 + tolerance)`` of a fully resident model's for this prompt size.
        """
        _require(tolerance >= 0, f"tolerance must be >= 0, got {tolerance!r}")
        full = self.first_token_after_start_s(self.arch.num_layers, prompt_tokens)
        bound = full * (1.0 + tolerance) + 1e-12
        lo, hi = 0, self.arch.num_layers  # T(r) is non-increasing in r: binary search
        while lo < hi:
            mid = (lo + hi) // 2
            t = self.first_token_after_start_s(mid, prompt_tokens, head_start_s=head_start_s)
            if t <= bound:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def ttft_s(
        self,
        prompt_tokens: int | Sequence[int],
        *,
        resident_layers: int = 0,
        pooled_process: bool = False,
        engine_ready: bool = False,
        comm_group_ready: bool = False,
        streaming: bool = False,
    ) -> float:
        """Convenience: start-up stages + (streamed or blocking) load + prefill of one start.

        With nothing prewarmed this is :meth:`cold_start_s` plus the prefill; with everything
        prewarmed it is ``activation_s`` plus the prefill (the §7.2 "+CommGroup" bar).
        """
        fixed = self.startup_s(pooled_process, engine_ready, comm_group_ready)
        rest = self.first_token_after_start_s(resident_layers, prompt_tokens, streaming=streaming)
        return fixed + rest


class StepTimer:
    """:meth:`EngineModel.decode_step_s` and :meth:`EngineModel.prefill_s` with every constant
    folded once: the event loop times a step at every batch change, millions of times a run.

    Same formulas (the roofline of the module docstring), written as linear functions of the
    batch, the KV tokens and the prompts' sum and sum of squares; results agree with the
    engine model's to float rounding (``tests/sim/test_perf.py``).  No argument checks: the
    loop only passes batches >= 1 and token counts >= 0.
    """

    __slots__ = (
        "L",
        "ar_c",
        "ar_l",
        "b_kv",
        "b_w",
        "f_dec",
        "f_pre",
        "f_tok",
        "h_b",
        "h_f",
        "over",
    )

    def __init__(self, e: EngineModel) -> None:
        p, a, tp = e.profile, e.arch, e.tp
        flops = p.bf16_flops * p.prefill_efficiency
        bw = p.hbm_bw * p.decode_efficiency
        self.L = a.num_layers
        self.f_tok = 2.0 * a.layer_params / tp / flops  # GEMMs, per token
        self.f_dec = 4.0 * a.attn_dim / tp / flops  # decode attention, per KV token
        self.f_pre = 2.0 * a.attn_dim / tp / flops  # causal prefill attention, per n^2
        self.b_w = e.block_read_bytes_per_gpu / bw
        self.b_kv = a.kv_bytes_per_token_per_layer / min(tp, a.num_kv_heads) / bw
        if tp == 1:
            self.ar_c = self.ar_l = 0.0
        else:
            self.ar_c = 2.0 * 2 * (tp - 1) / tp * a.hidden * a.dtype_bytes / p.gpu_to_gpu_bw
            self.ar_l = 2.0 * p.allreduce_latency_s
        self.h_f = 2.0 * a.head_params / tp / flops
        self.h_b = e._bytes_per_param * a.head_params / tp / bw
        self.over = p.step_overhead_s

    def decode(self, batch: int, kv_tokens: float) -> float:
        layer = max(self.f_tok * batch + self.f_dec * kv_tokens, self.b_w + self.b_kv * kv_tokens)
        layer += self.ar_c * batch + self.ar_l
        return self.L * layer + max(self.h_f * batch, self.h_b) + self.over

    def prefill(self, prompts: int, tokens: int, squares: int) -> float:
        """One prefill pass of ``prompts`` prompts, ``tokens`` in total, sum of squared lengths
        ``squares``."""
        layer = max(self.f_tok * tokens + self.f_pre * squares, self.b_w + self.b_kv * tokens)
        layer += self.ar_c * tokens + self.ar_l
        return self.L * layer + max(self.h_f * prompts, self.h_b) + self.over


def scaled_profile(profile: GpuProfile, compute_share: float, hbm_share: float) -> GpuProfile:
    """The profile as seen by a job holding ``compute_share`` of the SMs (CUDA MPS) and
    ``hbm_share`` of the HBM bandwidth (jobs running concurrently on one GPU split it).

    Used for GPU sharing (the MuxServe baseline): an :class:`EngineModel` built on the scaled
    profile times a colocated job.  Shares must be in (0, 1].
    """
    _require(0 < compute_share <= 1, f"compute_share must be in (0, 1], got {compute_share!r}")
    _require(0 < hbm_share <= 1, f"hbm_share must be in (0, 1], got {hbm_share!r}")
    return replace(
        profile,
        bf16_flops=profile.bf16_flops * compute_share,
        hbm_bw=profile.hbm_bw * hbm_share,
    )


PAPER_TABLE1_GIB = {"7b": 12.55, "13b": 24.24, "70b": 128.49}  # WarmServe Table 1 sizes


def physics_table(
    profile: GpuProfile,
    prompt_tokens: int = 1155,
    output_tokens: int = 211,
    load_setup_s: float = 0.0,
) -> list[dict[str, float | str]]:
    """Headline numbers of the paper's three models (TP 1/2/4, Table 1 sizes) on ``profile``:
    step times, KV capacity, load and start-up times, and the §7.2 Figure 8 stage-by-stage
    first-token times; ``load_setup_s`` is the start-up profile's fixed cost of a load from
    scratch.  ``python -m warmserve.sim.perf [gpu profile] [start-up profile]`` prints it as the
    table in docs/simulator.md."""
    rows: list[dict[str, float | str]] = []
    ctx = 32 * (prompt_tokens + output_tokens // 2)
    for size, tp in (("7b", 1), ("13b", 2), ("70b", 4)):
        arch = ModelArch.llama2(size).with_weight_bytes(int(PAPER_TABLE1_GIB[size] * 2**30))
        e = EngineModel(profile, arch, tp)
        full = e.arch.num_layers
        f = load_setup_s
        stages = [
            e.ttft_s(prompt_tokens) + f,
            e.ttft_s(prompt_tokens, pooled_process=True) + f,
            e.ttft_s(prompt_tokens, pooled_process=True, engine_ready=True) + f,
            e.ttft_s(prompt_tokens, resident_layers=full, pooled_process=True, engine_ready=True),
            e.ttft_s(
                prompt_tokens,
                resident_layers=full,
                pooled_process=True,
                engine_ready=True,
                comm_group_ready=True,
            ),
        ]
        rows.append(
            {
                "model": f"llama2-{size} (TP{tp})",
                "decode_b1_ms": e.decode_step_s(1, prompt_tokens) * 1e3,
                "decode_b32_ms": e.decode_step_s(32, ctx) * 1e3,
                "prefill_ms": e.prefill_s(prompt_tokens) * 1e3,
                "kv_tokens": e.kv_capacity_tokens(),
                "load_s": e.load_s() + f,
                "cold_start_s": e.cold_start_s() + f,
                "ttft_no_prewarm_s": stages[0],
                "ttft_device_s": stages[1],
                "ttft_engine_s": stages[2],
                "ttft_weights_s": stages[3],
                "ttft_commgroup_s": stages[4],
                "device_x": stages[0] / stages[1],
                "engine_x": stages[1] / stages[2],
                "weights_comm_x": stages[2] / stages[4],
                "total_reduction": stages[0] / stages[4],
            }
        )
    return rows


if __name__ == "__main__":  # pragma: no cover - a documentation helper
    import sys

    from warmserve.sim.hardware import load_profile
    from warmserve.sim.startup import load_startup

    gpu = load_profile(sys.argv[1] if len(sys.argv) > 1 else "h800")
    sp = load_startup(sys.argv[2] if len(sys.argv) > 2 else "fast-path", gpu)
    table = physics_table(sp.apply(gpu), load_setup_s=sp.load_setup_s)
    print("| " + " | ".join(table[0]) + " |")
    print("|" + "---|" * len(table[0]))
    for row in table:
        cells = [
            f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
            for v in row.values()
        ]
        print("| " + " | ".join(cells) + " |")
