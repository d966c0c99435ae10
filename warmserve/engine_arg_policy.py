"""Which of vLLM's engine arguments a tenant may set in ``spec.engine.args``, and how the platform
admin widens that (docs/security.md, "Engine arguments").

vLLM runs inside the agent's pooled worker process on a GPU node, next to every tenant's weights.
An engine argument that loads code, names a class, module or plugin, reads or writes a path,
opens a network endpoint or fetches from a hub would let whoever writes a ModelDeployment act on
that node.  So tenants get an **allowlist** of argument *dests* (vLLM's names, e.g.
``max_model_len``) that are data, not code; every dest of vLLM's schema is classified here
(a test keeps the classification complete when the schema is regenerated):

* :data:`TENANT`: allowed by default, some with a :class:`Rule` on their values (built-in
  quantization methods only, the keys of a JSON config that are data);
* :data:`MANAGED`: set by warmserve itself, never by a tenant or the admin;
* :data:`CODE`: can run code on the node; only the admin's loudly named
  ``--unsafe-allow-code-engine-arg`` lifts it (and lifts a :class:`Rule` the same way);
* :data:`WIDENABLE`: not for tenants by default, for the reason given; the admin's
  ``--allow-engine-arg DEST`` allows it.

A dest the schema has but this module does not classify (a newer vLLM) is treated like
:data:`CODE`.  The operator applies the policy at admission and the agent again before an
instance starts (``warmserve.engine_args.validate_engine_args``).  Most of this module is the
classification table, hence its length.

Over 400 lines: most of it is the rule tables, what a tenant may set per vLLM argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# ---- the value rules -------------------------------------------------------------------------
# A JSON key's kind: "int", "number", "int_list", or the exact strings allowed.
KeyKind = str | frozenset[str]


@dataclass(frozen=True)
class Rule:
    """What a tenant may give an allowed dest: one of ``values`` (exact strings), or, for a JSON
    config, only the ``keys`` listed (each value of its kind; no nested keys)."""

    values: frozenset[str] | None = None
    keys: Mapping[str, KeyKind] | None = None
    # the values are a list of the shipped schema (e.g. "quantization_methods": vLLM's built-in
    # quantization methods, regenerated with the schema)
    schema_values: str = ""


# A tenant dest without a rule: any value vLLM's schema accepts, given whole (no JSON keys).
SCALAR = Rule()

_SAMPLING_DEFAULTS: dict[str, KeyKind] = dict.fromkeys(
    (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_new_tokens",
    ),
    "number",
)
_CUDAGRAPH_MODES = frozenset(
    {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}
)

# dest -> rule (None: any value vLLM's schema accepts).  Data, not code: sizes, limits, dtypes,
# built-in kernels' switches, sampling defaults.
TENANT: dict[str, Rule | None] = {
    "max_model_len": None,
    "max_num_seqs": None,
    "max_num_batched_tokens": None,
    "long_prefill_token_threshold": None,
    "dtype": None,
    "kv_cache_dtype": None,
    "block_size": None,
    "enable_prefix_caching": None,
    "prefix_caching_hash_algo": None,
    "enable_chunked_prefill": None,
    "enforce_eager": None,
    "async_scheduling": None,
    "scheduling_policy": None,
    "seed": None,
    "max_logprobs": None,
    "logprobs_mode": None,
    "disable_sliding_window": None,
    "disable_cascade_attn": None,
    "cudagraph_capture_sizes": None,
    "max_cudagraph_capture_size": None,
    "stream_interval": None,
    # built-in methods only (the schema lists them); a plugin's name is no built-in
    "quantization": Rule(schema_values="quantization_methods"),
    # a folder path otherwise
    "generation_config": Rule(values=frozenset({"auto", "vllm"})),
    "override_generation_config": Rule(keys=_SAMPLING_DEFAULTS),
    # "custom" and other names resolve through plugin registries
    "tokenizer_mode": Rule(values=frozenset({"auto", "hf", "mistral"})),
    # backend (a callable's import path), inductor passes, custom ops, cache/dump paths: code
    "compilation_config": Rule(
        keys={
            "mode": "int",
            "cudagraph_mode": _CUDAGRAPH_MODES,
            "cudagraph_capture_sizes": "int_list",
            "max_cudagraph_capture_size": "int",
        }
    ),
}

_LOADER = "weights are loaded from the prewarm slot by warmserve's loader"
_MEMORY = "the agent owns the memory (prewarm slots), not vLLM's sleep mode or allocator"
_ONE_NODE = "warmserve places one instance on one node's GPU group"
_SCALE = "scale with instances (spec.minInstances/maxInstances) instead"
_WORKER = "the engine runs in warmserve's pooled worker process"
_KV = "the KV cache is sized to the slot's pages by the agent"

# dest -> why warmserve owns it
MANAGED: dict[str, str] = {
    "model": "the model is spec.model.name",
    "served_model_name": "instances are served under spec.model.name",
    "load_format": _LOADER,
    "model_loader_extra_config": _LOADER,
    "max_parallel_loading_workers": _LOADER,
    "safetensors_load_strategy": _LOADER,
    "safetensors_prefetch_block_size": _LOADER,
    "safetensors_prefetch_num_threads": _LOADER,
    "pt_load_map_location": _LOADER,
    "use_tqdm_on_load": _LOADER,
    "download_dir": "weights come from the node's weight store",
    "ignore_patterns": "weights come from the node's weight store",
    "tensor_parallel_size": "set spec.tensorParallel instead",
    "pipeline_parallel_size": _ONE_NODE,
    "prefill_context_parallel_size": _ONE_NODE,
    "nnodes": _ONE_NODE,
    "node_rank": _ONE_NODE,
    "master_addr": _ONE_NODE,
    "master_port": _ONE_NODE,
    "data_parallel_size": _SCALE,
    "data_parallel_size_local": _SCALE,
    "data_parallel_rank": _SCALE,
    "data_parallel_start_rank": _SCALE,
    "data_parallel_address": _SCALE,
    "data_parallel_rpc_port": _SCALE,
    "data_parallel_backend": _SCALE,
    "data_parallel_external_lb": _SCALE,
    "data_parallel_hybrid_lb": _SCALE,
    "data_parallel_multi_port_external_lb": _SCALE,
    "distributed_executor_backend": _WORKER,
    "worker_cls": _WORKER,
    "ray_workers_use_nsight": _WORKER,
    "device_ids": "the agent binds the instance to its GPU group",
    "gpu_memory_utilization": _KV,
    "kv_cache_memory_bytes": _KV,
    "num_gpu_blocks_override": _KV,
    "enable_sleep_mode": _MEMORY,
    "sleep_mode_offload_cudagraph": _MEMORY,
    "sleep_preserve_parameter_names": _MEMORY,
    "enable_nccl_comm_suspend": _MEMORY,
    "enable_cumem_allocator": _MEMORY,
    "otlp_traces_endpoint": "traces go where the agent's --otlp-traces-endpoint says "
    "(the chart's tracing.endpoint)",
}

# dest -> how it runs code (or lets a request do so) in the worker process
CODE: dict[str, str] = {
    "trust_remote_code": "runs the Python code of the model's repository",
    "worker_extension_cls": "imports a class into the engine's worker",
    "scheduler_cls": "imports a scheduler class",
    "logits_processors": "imports logits processor classes",
    "model_class_overrides": "imports model classes",
    "reasoning_parser_plugin": "imports a Python file as a plugin",
    "io_processor_plugin": "loads an IO processor plugin",
    "structured_outputs_config": "its reasoning_parser_plugin imports a Python file",
    "kv_transfer_config": "its kv_connector_module_path imports a module",
    "ec_transfer_config": "its ec_connector_module_path imports a module",
    "ec_manager_config": "its encoder_cache_manager_cls imports a class",
    "logging_config": "its pylogging_config_file is a dictConfig, which calls any factory",
    "log_config_file": "a logging dictConfig file, which calls any factory",
    "additional_config": "free-form configuration for platform plugins",
    "speculative_config": "its method custom_class imports a class; its model is fetched",
    "spec_method": "custom_class imports a class",
    "mm_processor_kwargs": "keyword arguments for Hugging Face's processor loader, "
    "which include trust_remote_code",
    "enable_prompt_embeds": "requests send serialised tensors that the engine deserialises",
    "enable_mm_embeds": "requests send serialised tensors that the engine deserialises",
}

_HUB = "names a model, tokenizer or revision to fetch; weights come from the node's store"
_PATH = "reads or writes a path on the node"
_NET = "opens or sends to a network endpoint"
_NODE = "uses node resources outside the agent's accounting"
_OBS = "changes logging, metrics or tracing of the node"
_PAR = "changes the instance's parallel layout"
_MM = "multimodal, LoRA and embedding inputs are the admin's choice"
_TUNE = "engine internals the platform admin vouches for"

_WIDEN_GROUPS: dict[str, tuple[str, ...]] = {
    _HUB: (
        "tokenizer",
        "tokenizer_revision",
        "revision",
        "code_revision",
        "hf_config_path",
        "hf_token",
        "hf_overrides",
        "config_format",
        "spec_model",
    ),
    _PATH: (
        "allowed_local_media_path",
        "profiler_config",
        "mm_encoder_fp8_scale_path",
        "mm_encoder_fp8_scale_save_path",
        "default_mm_loras",
    ),
    _NET: (
        "collect_detailed_traces",
        "allowed_media_domains",
        "kv_events_config",
        "weight_transfer_config",
        "distributed_timeout_seconds",
        "cpu_distributed_timeout_seconds",
    ),
    _NODE: (
        "cpu_offload_gb",
        "cpu_offload_params",
        "offload_backend",
        "offload_group_size",
        "offload_num_in_group",
        "offload_params",
        "offload_prefetch_step",
        "kv_offloading_backend",
        "kv_offloading_size",
        "numa_bind",
        "numa_bind_cpus",
        "numa_bind_nodes",
        "enable_shm_tensor_arena",
        "mm_ipc_gpu_memory_gb",
        "mm_processor_cache_gb",
        "mm_processor_cache_type",
        "mm_shm_cache_max_object_size_mb",
        "mm_tensor_ipc",
        "renderer_num_workers",
        "engram_config",
    ),
    _OBS: (
        "log_level",
        "disable_log_stats",
        "enable_log_requests",
        "aggregate_engine_logging",
        "enable_logging_iteration_details",
        "enable_layerwise_nvtx_tracing",
        "show_hidden_metrics_for_version",
        "kv_cache_metrics",
        "kv_cache_metrics_sample",
        "cudagraph_metrics",
        "enable_mfu_metrics",
        "custom_histogram_buckets",
        "per_request_spec_decode_metrics",
        "jit_monitor_mode",
        "jit_monitor_verbose",
        "fail_on_environ_validation",
    ),
    _PAR: (
        "decode_context_parallel_size",
        "dcp_comm_backend",
        "dcp_kv_cache_interleave_size",
        "dcp_q_replicate",
        "cp_kv_cache_interleave_size",
        "enable_expert_parallel",
        "expert_placement_strategy",
        "all2all_backend",
        "enable_eplb",
        "eplb_config",
        "enable_elastic_ep",
        "elastic_ep_max_dp_size",
        "enable_ep_weight_filter",
        "enable_dbo",
        "ubatch_size",
        "dbo_decode_token_threshold",
        "dbo_prefill_token_threshold",
        "disable_custom_all_reduce",
        "disable_nccl_for_dp_synchronization",
        "dp_sync_interval",
        "prefill_schedule_interval",
        "enable_batch_sharded_sampling",
        "enable_hc_sp",
        "enable_fault_tolerance",
        "fault_tolerance_config",
        "shutdown_timeout",
    ),
    _MM: (
        "limit_mm_per_prompt",
        "media_io_kwargs",
        "language_model_only",
        "interleave_mm_strings",
        "skip_mm_profiling",
        "disable_chunked_mm_input",
        "mm_hasher_algorithm",
        "mm_encoder_tp_mode",
        "mm_encoder_only",
        "mm_encoder_attn_backend",
        "mm_encoder_attn_dtype",
        "mm_encoder_fp8_scale_save_margin",
        "mm_device_do_normalize",
        "mm_processor_device",
        "video_pruning_method",
        "video_pruning_rate",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "max_lora_cls_labels",
        "lora_dtype",
        "lora_target_modules",
        "fully_sharded_loras",
        "specialize_active_lora",
        "enable_moe_shared_loras",
        "enable_tower_connector_lora",
        "enable_mixed_moe_lora_format",
        "skip_tokenizer_init",
    ),
    _TUNE: (
        "attention_backend",
        "attention_config",
        "kernel_config",
        "ir_op_priority",
        "linear_backend",
        "moe_backend",
        "mamba_backend",
        "gdn_prefill_backend",
        "kda_decode_backend",
        "kda_prefill_backend",
        "sparse_indexer_topk_backend",
        "enable_flashinfer_autotune",
        "optimization_level",
        "performance_mode",
        "model_impl",
        "runner",
        "convert",
        "pooler_config",
        "reasoning_parser",
        "reasoning_config",
        "quantization_config",
        "allow_deprecated_quantization",
        "kv_cache_dtype_skip_layers",
        "kv_sharing_fast_prefill",
        "disable_hybrid_kv_cache_manager",
        "max_num_active_seqs",
        "max_num_queued_reqs",
        "max_num_queued_tokens",
        "max_num_scheduled_tokens",
        "long_prefill_token_threshold_adaptive",
        "scheduler_reserve_full_isl",
        "prefix_cache_retention_interval",
        "prefix_match_unit",
        "spec_tokens",
        "diffusion_config",
        "watermark",
        "watermark_config",
        "aux_output_config",
        "enable_return_routed_experts",
        "return_sampling_mask",
        "enable_trace_replay",
        "use_fp64_gumbel",
        "mamba_block_size",
        "mamba_cache_dtype",
        "mamba_cache_mode",
        "mamba_cache_philox_rounds",
        "mamba_ssm_cache_dtype",
        "mamba_ssu_algorithm",
        "enable_mamba_cache_stochastic_rounding",
        "enable_mamba_shared_prefix_checkpoint",
        "use_replayssm",
        "replayssm_buffer_len",
        "swa_bounded_replay",
    ),
}
# dest -> why it is not a tenant's by default (the admin may allow it)
WIDENABLE: dict[str, str] = {d: why for why, ds in _WIDEN_GROUPS.items() for d in ds}

UNCLASSIFIED = "not classified for this vLLM version (treated as able to run code)"


class EngineArgPolicyError(ValueError):
    """An admin setting that cannot widen the allowlist (the CLI prints it as one line)."""


def _dest(name: str) -> str:
    """``--otlp-traces-endpoint`` or ``otlp-traces-endpoint`` -> ``otlp_traces_endpoint``."""
    return name.strip().removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class EngineArgPolicy:
    """The admin's widening of :data:`TENANT`: ``extra`` dests from :data:`WIDENABLE`, and
    ``unsafe`` dests that may run code (any dest but :data:`MANAGED`)."""

    extra: frozenset[str] = field(default_factory=frozenset)
    unsafe: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_admin(
        cls,
        extra: Iterable[str] = (),
        unsafe: Iterable[str] = (),
        known: Iterable[str] | None = None,
    ) -> EngineArgPolicy:
        """Checked admin settings (dest or flag names); ``known``: the schema's dests."""
        known_set = set(known) if known is not None else None
        ext, uns = {_dest(d) for d in extra}, {_dest(d) for d in unsafe}
        for d in sorted(ext | uns):
            if known_set is not None and d not in known_set:
                raise EngineArgPolicyError(
                    f"{d}: not a vLLM engine argument (see `vllm serve --help`)"
                )
            if d in MANAGED:
                raise EngineArgPolicyError(
                    f"{d}: set by warmserve ({MANAGED[d]}); it cannot be allowed"
                )
        for d in sorted(ext):
            if TENANT.get(d) is not None:  # naming a plain tenant dest again changes nothing
                raise EngineArgPolicyError(
                    f"--allow-engine-arg {d}: tenants may set it already, within a rule on its "
                    "values; lifting the rule can run code (--unsafe-allow-code-engine-arg)"
                )
            if d not in WIDENABLE and d not in TENANT:
                why = CODE.get(d, UNCLASSIFIED)
                raise EngineArgPolicyError(
                    f"--allow-engine-arg {d}: it can run code on the GPU node ({why}); only "
                    f"--unsafe-allow-code-engine-arg {d} allows it, for tenants you trust "
                    "with the node"
                )
        return cls(frozenset(ext), frozenset(uns))

    def rule(self, dest: str) -> tuple[bool, Rule | None, str]:
        """(allowed, rule to apply, why not) for ``dest``; rule None: anything the schema
        accepts (what the admin allowed)."""
        if dest in MANAGED:
            return False, None, f"set by warmserve: {MANAGED[dest]}"
        if dest in self.unsafe:
            return True, None, ""
        if dest in TENANT:
            return True, TENANT[dest] or SCALAR, ""
        if dest in WIDENABLE:
            if dest in self.extra:
                return True, None, ""
            return (
                False,
                None,
                (
                    f"not allowed for tenants ({WIDENABLE[dest]}); the platform admin can allow it "
                    f"with --allow-engine-arg {dest} on the operator and the agents (Helm "
                    "engineArgs.extraAllowed)"
                ),
            )
        why = CODE.get(dest, UNCLASSIFIED)
        return False, None, f"not allowed for tenants: it can run code on the GPU node ({why})"

    def allowed_dests(self, schema_dests: Iterable[str]) -> frozenset[str]:
        """The dests a tenant may set under this policy (for tests and docs)."""
        return frozenset(d for d in schema_dests if self.rule(d)[0])


DEFAULT_POLICY = EngineArgPolicy()
