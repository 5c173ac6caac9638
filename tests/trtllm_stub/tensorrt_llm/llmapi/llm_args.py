"""The field names TensorRT-LLM's LLM API accepts, vendored from tensorrt_llm/llmapi/llm_args.py
(NVIDIA/TensorRT-LLM, stored snapshot 0004396720054fd8e205cbf616f21f0b57c6b412, read field by field:
``BaseLlmArgs`` + ``TorchLlmArgs``, ``KvCacheConfig``, ``CacheTransceiverConfig``,
``DecodeCudaGraphConfig`` (= ``CudaGraphConfig``), ``SchedulerConfig``). Every one of these
classes is a ``StrictBaseModel`` (pydantic, ``extra="forbid"``): a key not listed is an error
when ``LLM(**kwargs)`` builds ``TorchLlmArgs``.

How authoritative: the snapshot is a 1.3/1.4-era main branch, not the 1.3.0rc29 tag Dynamo 1.6.1
pins (not stored); it may list fields rc29 does not have yet (a key added after rc29 would pass
here and fail on rc29). Every key our engine YAMLs use is also in the 1.3.0rc26 API reference
(TorchLlmArgs, KvCacheConfig, CacheTransceiverConfig, CudaGraphConfig). Only names (and a few
enumerations) are vendored, not validators: value ranges beyond those below are not checked.

Also ``BaseLlmArgs.model_fields`` defaults, which dynamo/trtllm/backend_args.py 1.6.1 reads for its
``--max-batch-size`` / ``--max-num-tokens`` / ``--max-seq-len`` / ``--max-beam-width`` flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BASE_LLM_ARGS = (
    "model", "tokenizer", "tokenizer_mode", "custom_tokenizer", "post_processor_hook",
    "skip_tokenizer_init", "trust_remote_code", "tensor_parallel_size", "dtype", "revision",
    "tokenizer_revision", "model_kwargs", "pipeline_parallel_size", "context_parallel_size",
    "gpus_per_node", "moe_cluster_parallel_size", "moe_tensor_parallel_size",
    "moe_expert_parallel_size", "enable_attention_dp", "enable_lm_head_tp_in_adp", "pp_partition",
    "cp_config", "load_format", "enable_lora", "lora_config", "kv_cache_config",
    "enable_chunked_prefill", "guided_decoding_backend", "batched_logits_processor",
    "iter_stats_max_iterations", "request_stats_max_iterations", "peft_cache_config",
    "scheduler_config", "cache_transceiver_config", "sparse_attention_config",
    "kv_cache_compression_config", "speculative_config", "max_batch_size", "max_input_len",
    "max_seq_len", "max_beam_width", "max_num_tokens", "gather_generation_logits",
    "num_postprocess_workers", "postprocess_tokenizer_dir", "num_serve_frontends",
    "reasoning_parser", "decoding_config", "_mpi_session", "otlp_traces_endpoint", "backend",
    "return_perf_metrics", "perf_metrics_output_dir", "perf_metrics_max_requests",
    "prometheus_metrics_config", "enable_energy_metrics", "orchestrator_type", "env_overrides",
    "telemetry_config",
)
TORCH_LLM_ARGS = BASE_LLM_ARGS + (
    "generation_config", "garbage_collection_gen0_threshold", "cuda_graph_config",
    "encoder_cuda_graph_config", "enable_encoder_decoder_mixed_cuda_graph", "multimodal_config",
    "attention_dp_config", "disable_overlap_scheduler", "moe_config", "nvfp4_gemm_config",
    "dwdp_config", "encoder_max_batch_size", "encoder_max_num_tokens", "attn_backend",
    "enable_mla_skip_correction", "mla_skip_correction_threshold", "sampler_force_async_worker",
    "enable_in_graph_sampling", "enable_speculative_beam_history_d2h",
    "enable_early_first_token_response", "enable_low_latency_host_dispatch",
    "enable_iter_perf_stats", "enable_iter_req_stats", "print_iter_log", "batch_wait_timeout_ms",
    "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "torch_compile_config",
    "prefill_cuda_graph_backend", "prefill_capture_num_tokens", "enable_autotuner",
    "use_fine_grained_sync", "enable_layerwise_nvtx_marker", "enable_min_latency",
    "stream_interval", "force_dynamic_quantization", "allreduce_strategy", "checkpoint_loader",
    "checkpoint_format", "checkpoint_io_policy", "mx_config", "gms_config", "kv_connector_config",
    "mm_encoder_only", "disable_mm_encoder", "encode_only", "ray_worker_extension_cls",
    "ray_placement_config", "ray_worker_nsight_options", "sleep_config", "reorder_policy_config",
    "enable_resource_governor", "use_cute_dsl_blockscaling_mm", "use_cute_dsl_blockscaling_bmm",
    "use_cute_dsl_bf16_bmm", "use_cute_dsl_bf16_gemm", "max_stats_len",
    "layer_wise_benchmarks_config",
)
NESTED = {
    "kv_cache_config": (
        "enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length",
        "free_gpu_memory_fraction", "host_cache_size", "disk_cache_size", "disk_cache_path",
        "cross_kv_cache_fraction", "secondary_offload_min_priority", "event_buffer_max_size",
        "attention_dp_events_gather_period_ms", "kv_events_config", "enable_partial_reuse",
        "copy_on_partial_reuse", "use_uvm", "max_gpu_total_bytes", "iteration_stats_interval",
        "dtype", "mamba_ssm_cache_dtype", "mamba_ssm_stochastic_rounding",
        "mamba_ssm_philox_rounds", "tokens_per_block", "mamba_state_cache_interval",
        "mamba_state_config", "use_kv_cache_manager_v2", "enable_swa_scratch_reuse",
        "kv_cache_event_hash_algo", "max_util_for_resume", "enable_kv_pool_rebalance",
        "kv_pool_rebalance_min_sampled_kv_caches", "kv_pool_rebalance_cooldown_secs",
        "kv_pool_rebalance_target_ratio_update_interval", "kv_pool_rebalance_ratio_threshold",
        "kv_pool_rebalance_moving_average_decay", "kv_pool_rebalance_check_interval",
        "disk_prefetch_num_reqs", "fp8_context_mla_kv_len_cap", "pool_ratio", "avg_seq_len",
        "block_reuse_config"),
    "cache_transceiver_config": (
        "backend", "transceiver_runtime", "max_tokens_in_buffer", "kv_transfer_timeout_ms",
        "kv_transfer_sender_future_timeout_ms", "kv_transfer_poll_interval_ms",
        "kv_cache_bounce_size_mb", "enable_pipelined_transfer"),
    "cuda_graph_config": ("mode", "batch_sizes", "max_batch_size", "enable_padding"),
    "scheduler_config": (
        "capacity_scheduler_policy", "context_chunking_policy", "dynamic_batch_config",
        "waiting_queue_policy", "use_python_scheduler", "enable_prefix_aware_scheduling"),
}
# Literal[...] / enum fields among the keys we ship.
CHOICES = {
    ("backend",): ("pytorch",),  # TorchLlmArgs.backend: Literal["pytorch"]
    ("cache_transceiver_config", "backend"): ("DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"),
    ("scheduler_config", "capacity_scheduler_policy"): (
        "MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH"),
    ("scheduler_config", "context_chunking_policy"): (
        "FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS", "FORCE_CHUNK"),
}
BOUNDED = {("kv_cache_config", "free_gpu_memory_fraction"): (0.0, 1.0)}  # ge=0, le=1


def llm_args_errors(kwargs: dict[str, Any]) -> list[str]:
    """What pydantic would reject building ``TorchLlmArgs(**kwargs)`` (names and the few
    enumerations above); empty if nothing."""
    errors = []
    for key, value in kwargs.items():
        if key not in TORCH_LLM_ARGS:
            errors.append(f"{key}: Extra inputs are not permitted")
            continue
        if (key,) in CHOICES and value not in CHOICES[(key,)]:
            errors.append(f"{key}: {value!r} is not one of {CHOICES[(key,)]}")
        if key in NESTED and isinstance(value, dict):
            for sub, sub_value in value.items():
                where = f"{key}.{sub}"
                if sub not in NESTED[key]:
                    errors.append(f"{where}: Extra inputs are not permitted")
                elif (key, sub) in CHOICES and sub_value not in CHOICES[(key, sub)]:
                    errors.append(f"{where}: {sub_value!r} is not one of {CHOICES[(key, sub)]}")
                elif (key, sub) in BOUNDED:
                    low, high = BOUNDED[(key, sub)]
                    if not (isinstance(sub_value, (int, float)) and low <= sub_value <= high):
                        errors.append(f"{where}: {sub_value!r} is not in [{low}, {high}]")
    return errors


@dataclass(frozen=True)
class _FieldInfo:
    default: Any


class BaseLlmArgs:
    """Only ``model_fields[...].default`` of the four runtime sizes (BaseLlmArgs in the snapshot)."""

    model_fields = {"max_batch_size": _FieldInfo(2048), "max_num_tokens": _FieldInfo(8192),
                    "max_seq_len": _FieldInfo(None), "max_beam_width": _FieldInfo(1)}
