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

from collections.abc import Sequence
from dataclasses import dataclass, replace
from numbers import Integral

from warmserve.policy.prewarm_depth import forward_time_s
from warmserve.policy.prewarm_depth import min_resident_layers as policy_min_resident_layers
from warmserve.sim.hardware import GpuProfile
from warmserve.sim.model_arch import (
    VLLM_BLOCK_TOKENS,
    EngineInputError,
    ModelArch,
    is_int,
    require,
)


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
        require(self.tp >= 1, f"{self.arch.name}: tp must be >= 1, got {self.tp}")
        require(
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
        require(used >= 0, f"{self.arch.name}: resident_bytes_per_gpu must be >= 0")
        return max(0, int(self.profile.usable_bytes - used))

    def kv_capacity_tokens(self, free_bytes_per_gpu: float | None = None) -> int:
        """KV-cache tokens that fit in ``free_bytes_per_gpu`` (default: the vLLM budget),
        rounded down to whole vLLM blocks of 16 tokens."""
        free = self.free_kv_bytes_per_gpu() if free_bytes_per_gpu is None else free_bytes_per_gpu
        require(free >= 0, f"{self.arch.name}: free_bytes_per_gpu must be >= 0, got {free}")
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
        require(len(lens) > 0, "prompt_tokens must name at least one prompt")
        for n in lens:
            require(
                is_int(n) and n >= 1,
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
        require(num_prompts >= 1, f"num_prompts must be >= 1, got {num_prompts!r}")
        require(prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {prompt_tokens!r}")
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
        require(
            is_int(batch) and batch >= 1,
            f"decode batch must be an integer >= 1: {batch!r}",
        )
        require(kv_tokens >= 0, f"decode kv_tokens must be >= 0, got {kv_tokens!r}")
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
        require(
            is_int(n) and 0 <= n <= self.arch.num_layers,
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
        forward pass begins (e.g. during activation); the policy's closed form
        (:func:`warmserve.policy.prewarm_depth.forward_time_s`) on this engine's per-layer load
        and compute times:

            T = max(L c,  l - h + (L - r) c,  (L - r) l - h + c)   (+ LM head)

        i.e. compute-bound, the first missing layer, or the last layer's arrival.
        ``streaming=False`` models an engine that waits for all weights (stock vLLM):
        ``max(0, (L - r) l - h) + L c``.
        """
        L = self.arch.num_layers
        r = resident_layers
        require(
            is_int(r) and 0 <= r <= L,
            f"{self.arch.name}: resident_layers must be an integer in [0, {L}], got {r!r}",
        )
        require(head_start_s >= 0, f"head_start_s must be >= 0, got {head_start_s!r}")
        lens = self._lengths(prompt_tokens)
        return forward_time_s(
            L, r, self.layer_load_s, self.layer_compute_s(lens), head_s=self._head_s(len(lens)),
            head_start_s=head_start_s, streaming=streaming,
        )

    def min_resident_layers(
        self,
        prompt_tokens: int | Sequence[int],
        *,
        head_start_s: float = 0.0,
        tolerance: float = 0.0,
    ) -> int:
        """Fewest leading layers to keep resident so streaming never blocks the forward pass.

        The paper's offline profiling pass (§4), the policy's rule
        (:func:`warmserve.policy.prewarm_depth.min_resident_layers`) on this engine's numbers:
        the smallest ``r`` whose first-token time is within ``(1 + tolerance)`` of a fully
        resident model's for this prompt size.
        """
        require(tolerance >= 0, f"tolerance must be >= 0, got {tolerance!r}")
        load, compute, head = self.depth_inputs(prompt_tokens)
        return policy_min_resident_layers(
            self.arch.num_layers, load, compute, head_s=head, head_start_s=head_start_s,
            tolerance=tolerance,
        )

    def depth_inputs(self, prompt_tokens: int | Sequence[int]) -> tuple[float, float, float]:
        """(per-layer load s, per-layer compute s, LM head s) for ``prompt_tokens``: what the
        policy's depth rule takes (the profile the operator gets from the node agents)."""
        lens = self._lengths(prompt_tokens)
        return self.layer_load_s, self.layer_compute_s(lens), self._head_s(len(lens))

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
    require(0 < compute_share <= 1, f"compute_share must be in (0, 1], got {compute_share!r}")
    require(0 < hbm_share <= 1, f"hbm_share must be in (0, 1], got {hbm_share!r}")
    return replace(
        profile,
        bf16_flops=profile.bf16_flops * compute_share,
        hbm_bw=profile.hbm_bw * hbm_share,
    )
